"""One peer's runtime: the event-loop thread, the node and what ``join()`` resolves.

- :mod:`.runtime`: :class:`~.runtime.Runtime`, what :class:`gossipnet.Peer` holds: the
  loop thread (:mod:`.loop`), the node, engines by key, blocking calls, the join wait
  (:mod:`.join`, :mod:`._join_check`) and shutdown; plus the flat-buffer cache
  (:mod:`.flatbuffer`).
- :mod:`.node`: :class:`~.node.Node`, three parts held by composition: packet I/O and
  dispatch by kind (:mod:`.dispatch`), reliable control messages (:mod:`.reliable`)
  and the membership protocol (:mod:`.membership_protocol` over the bookkeeping in
  :mod:`.membership`); packet kinds 1-15 in :mod:`.kinds`.

Layer 2 of 5 (transport, runtime, collectives, training, facade): it imports the
transport and the value modules (``errors``, ``config``, ``clock``, ``reports``) only;
what it needs from above comes in as factories (engines) or callbacks (subscribers).
"""
