"""Averaging strategies over the transport: chunking, loss-tolerant all-reduce, Moshpit.

Modules are imported explicitly (``from gossipnet.collectives.chunks import FlatBuffer``);
this package imports nothing at import time so that strategies stay independent.
"""
