"""Packet kinds 64-79: route-aware gossip (rules: :mod:`gossipnet.runtime.kinds`)."""

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
