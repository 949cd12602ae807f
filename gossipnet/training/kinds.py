"""Packet kinds 96-111: the optimizer's replica digests, sent after each resync.

Each protocol owns a range of kinds next to its code; ranges never overlap
(``tests/unit/test_kinds.py``).  Decoding accepts any kind in [0, 65535] (a newer
peer may send one); a node counts kinds nobody subscribed to as unhandled.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "TrainingKind")

#: The kinds this protocol may use.
KIND_RANGE = range(96, 112)


class TrainingKind(IntEnum):
    """The optimizer's replica digests, sent after each resync (also carried in heartbeats)."""

    DIGEST = 96
