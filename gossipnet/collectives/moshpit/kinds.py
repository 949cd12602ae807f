"""Packet kinds 32-47: Moshpit averaging (rules: :mod:`gossipnet.runtime.kinds`)."""

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
