"""Packet kinds 32-47: Moshpit averaging.

Each protocol owns a range of kinds next to its code; ranges never overlap
(``tests/unit/test_kinds.py``).  Decoding accepts any kind in [0, 65535] (a newer
peer may send one); a node counts kinds nobody subscribed to as unhandled.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "MoshpitKind")

#: The kinds this protocol may use.
KIND_RANGE = range(32, 48)


class MoshpitKind(IntEnum):
    """Moshpit: matchmaking (join, group), then the group all-reduce's packets."""

    JOIN = 32
    GROUP = 33
    RS_DATA = 34
    AG_DATA = 35
    RS_END = 36
    AG_END = 37
    REPAIR = 38
