"""Packet kinds 48-63: state transfer (rules: :mod:`gossipnet.runtime.kinds`)."""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "StateKind")

#: The kinds this protocol may use.
KIND_RANGE = range(48, 64)


class StateKind(IntEnum):
    """State transfer: manifest and chunk requests, and the chunks."""

    REQ = 48
    DATA = 49
