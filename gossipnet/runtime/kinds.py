"""Packet kinds 1-15: node and membership control.

Each protocol owns a range of kinds next to its code; ranges never overlap
(``tests/unit/test_kinds.py``).  Decoding accepts any kind in [0, 65535] (a newer
peer may send one); a node counts kinds nobody subscribed to as unhandled.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "NodeKind")

#: The kinds this protocol may use.
KIND_RANGE = range(1, 16)


class NodeKind(IntEnum):
    """Node and membership control: hello, views, heartbeats, leaving, acks.

    Kinds in this range are sent ``urgent``, ahead of queued data.
    """

    HELLO = 1
    HELLO_ACK = 2
    HEARTBEAT = 3
    LEAVE = 4
    ACK = 5
    VIEW = 6
