"""Packet kinds 240-255: the torch.distributed backend's reliable collectives.

Why a range of its own: the backend's broadcast, allgather and barrier travel as
acknowledged parts (:mod:`gossipnet.distributed.exchange`) that no other protocol
must mistake for its own packets.  240 leaves room below for the library's protocols.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "DistKind")

#: The kinds this protocol may use.
KIND_RANGE = range(240, 256)


class DistKind(IntEnum):
    """The backend's packets."""

    #: one part of one rank's message of a reliable collective (acknowledged)
    PART = 240
