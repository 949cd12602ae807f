"""Packet kinds 80-95: Blink island control, one process per GPU.

Each protocol owns a range of kinds next to its code; ranges never overlap
(``tests/unit/test_kinds.py``).  Decoding accepts any kind in [0, 65535] (a newer
peer may send one); a node counts kinds nobody subscribed to as unhandled.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "IslandKind")

#: The kinds this protocol may use.
KIND_RANGE = range(80, 96)


class IslandKind(IntEnum):
    """Blink island control, one process per GPU: discovery, shared-buffer handles, ready/done."""

    INFO = 80
    SHARE = 81
    READY = 82
    DONE = 83
