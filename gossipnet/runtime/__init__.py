"""One peer's runtime: the event-loop thread, the node (packet I/O, reliable control
messages, membership) and what ``join()`` resolves before it starts one.

Layer 2 of 5 (transport, runtime, collectives, training, facade): it imports the
transport and the value modules (``errors``, ``config``, ``clock``, ``reports``) only.
"""
