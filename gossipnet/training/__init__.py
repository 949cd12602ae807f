"""What ``net.optimizer`` and ``net.microbatches`` build: optimizer strategies
(all-reduce, Moshpit, route-aware gossip) behind one ``Strategy`` protocol, each with
a frozen options value; replica checks; and the DropCompute cut-off.

Layer 4 of 5: it uses the collectives and the runtime, never the facade (``Peer``):
what it needs of a running peer is the ``host.TrainingHost`` protocol, which the
facade implements (``gossipnet._training_host``).  Read ``optimizer.py`` (the
wrapper), ``strategy.py`` (the protocol), then ``allreduce.py``, ``moshpit.py`` and
``route.py``.
"""
