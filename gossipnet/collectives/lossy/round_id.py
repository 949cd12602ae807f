"""What a round is: its id's valid range, its tensor layout, and who was elsewhere.

Why this exists: rounds used to be paired only by how many calls a peer had
made, so a peer that made one call more or fewer (a timed-out step, a stall
longer than the failure timeout) ran one round off the others for the rest of
the run while every report still said it contributed.  Now every data and END
packet carries

- ``r``, the round id: for the optimizer a function of the training step
  (:func:`optimizer_round`), for plain calls the engine's call counter;
- ``m``, the round's mode (gradients, resync, plain), so a resync is never
  mixed into a gradient round of the same id;
- ``L``, a 32-bit fingerprint of the flat layout (dtype and length of every
  bucket), so a peer with another model never has its chunks mixed into ours:
  the first such round raises :class:`~gossipnet.errors.LayoutMismatchError`
  naming the peer and both layouts (the description travels in heartbeats).

A peer also records, per round, which members were heard in *other* rounds and
sent nothing for this one (:func:`alignment`): the optimizer uses it to notice
within one round that it is behind or ahead of the others and to realign.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from gossipnet.collectives.chunks import ChunkPlan
from gossipnet.errors import LayoutMismatchError
from gossipnet.transport.wire import DTYPE_CODES

__all__ = (
    "MAX_ROUND",
    "MAX_MODE",
    "Alignment",
    "LayoutMismatchError",
    "layout_error",
    "layout_of",
    "optimizer_round",
    "step_of_round",
    "valid_mode",
    "valid_round",
)

#: Round ids are below 2**53: they survive any float conversion and msgpack, and a
#: step counter never gets there; a larger one in a header is a forgery or a bug.
MAX_ROUND = (1 << 53) - 1
#: Modes (what a round carries) are small ints (one byte).
MAX_MODE = 255
#: Longest layout description carried in a heartbeat.
MAX_LAYOUT_DESC = 160
#: Round ids per training step of the optimizer: explicit resync, scheduled resync,
#: gradient round (in that order within a step).
IDS_PER_STEP = 3
EXPLICIT_RESYNC, SCHEDULED_RESYNC, GRADIENTS = 0, 1, 2


def valid_round(r: object) -> TypeGuard[int]:
    """A round id from a header we may use: a plain int in [0, MAX_ROUND]."""
    return type(r) is int and 0 <= r <= MAX_ROUND


def valid_mode(m: object) -> TypeGuard[int]:
    return type(m) is int and 0 <= m <= MAX_MODE


def optimizer_round(step: int, slot: int) -> int:
    """The optimizer's round id of ``slot`` (a ``*_RESYNC`` or ``GRADIENTS``) at ``step``.

    Every peer at the same step computes the same id, whatever happened before:
    a stalled or restarted peer that has realigned its step count is paired
    with the others again from its next round on.
    """
    return IDS_PER_STEP * step + slot


def step_of_round(r: int) -> int:
    """The training step of an optimizer round id."""
    return r // IDS_PER_STEP


def layout_of(plans: Sequence[ChunkPlan], setting: str = "") -> tuple[int, str]:
    """``(fingerprint, description)`` of a round's flat buckets.

    The description names each bucket's dtype and length (``f32[1234567]+f64[15]``),
    which is what must agree between peers; chunk sizes may differ (they follow
    ``Config.chunk_bytes``) and shapes inside a bucket are the caller's business.
    ``setting``: a compressed round's (``ChunkCodec.setting``), which must agree
    too (``f32[1234567] compress=topk16/int8``).
    """
    parts = [f"{DTYPE_CODES.get(p.dtype, str(p.dtype))}[{p.numel}]" for p in plans]
    desc = "+".join(parts) + (f" compress={setting}" if setting else "")
    digest = hashlib.blake2b(desc.encode(), digest_size=4).digest()
    if len(desc) > MAX_LAYOUT_DESC:
        desc = desc[: MAX_LAYOUT_DESC - 3] + "..."
    return int.from_bytes(digest, "big"), desc


@dataclass(frozen=True, slots=True)
class Alignment:
    """Where the round's other members were, seen from this peer.

    Attributes:
        in_sync: members heard in this very round (us included).
        ahead: members heard only in later rounds: round id of the latest.
        behind: members heard only in earlier rounds (or this id in another mode).
    """

    in_sync: frozenset[str]
    ahead: dict[str, int]
    behind: dict[str, int]

    @property
    def we_are_behind(self) -> bool:
        """More members moved on without us than shared our round (ties: progress
        wins, so of two peers one step apart the one behind realigns)."""
        return bool(self.ahead) and len(self.ahead) >= len(self.in_sync)

    @property
    def we_are_ahead(self) -> bool:
        """More members are still in earlier rounds than shared ours."""
        return len(self.behind) > len(self.in_sync) and not self.we_are_behind


def alignment(me: str, heard: set[str], elsewhere: dict[str, int], r: int) -> Alignment:
    """Classify the members heard during round ``r`` (see :class:`Alignment`)."""
    in_sync = frozenset(heard | {me})
    ahead = {p: x for p, x in elsewhere.items() if p not in in_sync and x > r}
    behind = {p: x for p, x in elsewhere.items() if p not in in_sync and x <= r}
    return Alignment(in_sync, ahead, behind)


def layout_error(me: str, ours: str, theirs: dict[str, str]) -> LayoutMismatchError:
    """The error for peers whose round packets carried another layout than ours."""
    listed = "; ".join(f"{p}: {d}" for p, d in sorted(theirs.items()))
    return LayoutMismatchError(
        f"peer {me}: tensor layouts differ between peers. Ours: {ours}. Theirs: {listed}."
        " Every peer must pass the same tensors (same model, same dtypes, same order)"
        " to each collective; check the model definition and the order of parameters."
    )
