"""What ``net.optimizer`` and ``net.microbatches`` build: optimizer strategies
(all-reduce, Moshpit, route-aware gossip), replica checks, and the DropCompute cut-off.

Layer 4 of 5: it uses the collectives and the runtime, never the facade (``Peer``).
"""
