"""Packet kinds 16-31: the loss-tolerant all-reduce (rules: :mod:`gossipnet.runtime.kinds`)."""

from __future__ import annotations

from enum import IntEnum

__all__ = ("KIND_RANGE", "LossyKind")

#: The kinds this protocol may use.
KIND_RANGE = range(16, 32)


class LossyKind(IntEnum):
    """The loss-tolerant all-reduce's data, END markers and repair requests.

    16-22 serve plain ``all_reduce`` calls, 23-27 the optimizer's own engine, whose
    rounds are numbered by training step: apart, so the two never mix.
    """

    RS_DATA = 16
    AG_DATA = 17
    BCAST = 18
    ROUND = 19
    RS_END = 20
    AG_END = 21
    REPAIR = 22
    OPT_RS_DATA = 23
    OPT_AG_DATA = 24
    OPT_RS_END = 25
    OPT_AG_END = 26
    OPT_REPAIR = 27
