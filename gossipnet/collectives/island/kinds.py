"""Packet kinds 80-95: Blink island control (rules: :mod:`gossipnet.runtime.kinds`)."""

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
