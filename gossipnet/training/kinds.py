"""Packet kinds 96-111: replica digests (rules: :mod:`gossipnet.runtime.kinds`)."""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "TrainingKind")

#: The kinds this protocol may use.
KIND_RANGE = range(96, 112)


class TrainingKind(IntEnum):
    """The optimizer's replica digests, sent after each resync (also carried in heartbeats)."""

    DIGEST = 96
