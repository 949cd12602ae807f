"""Packet kinds 48-63: state transfer.

Each protocol owns a range of kinds next to its code; ranges never overlap
(``tests/unit/test_kinds.py``).  Decoding accepts any kind in [0, 65535] (a newer
peer may send one); a node counts kinds nobody subscribed to as unhandled.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "StateKind")

#: The kinds this protocol may use.
KIND_RANGE = range(48, 64)


class StateKind(IntEnum):
    """State transfer: manifest and chunk requests, and the chunks."""

    REQ = 48
    DATA = 49
