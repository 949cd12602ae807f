"""Packet kinds 144-159: SPARQ-SGD gossip (rules: :mod:`gossipnet.runtime.kinds`)."""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "SparqKind")

#: The kinds this protocol may use.
KIND_RANGE = range(144, 160)


class SparqKind(IntEnum):
    """SPARQ-SGD: compressed differences, a round's end, repair requests, exact refreshes."""

    DELTA = 144
    END = 145
    NACK = 146
    REFRESH = 147
