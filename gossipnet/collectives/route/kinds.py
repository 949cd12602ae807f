"""Packet kinds 64-79: route-aware gossip.

Each protocol owns a range of kinds next to its code; ranges never overlap
(``tests/unit/test_kinds.py``).  Decoding accepts any kind in [0, 65535] (a newer
peer may send one); a node counts kinds nobody subscribed to as unhandled.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "RouteKind")

#: The kinds this protocol may use.
KIND_RANGE = range(64, 80)


class RouteKind(IntEnum):
    """Route-aware gossip: model halves, receipts, shared routes."""

    DATA = 64
    RECEIPT = 65
    SHARE = 66
