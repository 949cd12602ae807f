"""SPARQ-SGD gossip: the compression operator, its packets, estimates and their repair.

Read :mod:`.codec` (C(x) and the wire format), :mod:`.estimates` (versions per block)
and :mod:`.exchange` (a round, and how copies resync under loss); the strategy glue
is :mod:`gossipnet.training.sparq`.
"""

from __future__ import annotations

from gossipnet.collectives.sparq.config import SparQ

__all__ = ("SparQ",)
