"""What one all-reduce round is asked to do: :class:`RoundOptions`.

Why a value: a round has thirteen knobs (where results go, our weight, its bound,
a hook on the averages, the view, its mode and id, repair, copies, parity, stale
steps, compression, robust aggregation); as one frozen value they are checked
once, here, and a caller names only the ones it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gossipnet.collectives.lossy.compressed import ChunkCodec
from gossipnet.collectives.lossy.parity import MAX_GROUP
from gossipnet.collectives.lossy.reducer import MAX_WEIGHT, OwnedShard, valid_weight
from gossipnet.collectives.lossy.robust import CenteredClip
from gossipnet.collectives.lossy.round_id import valid_mode, valid_round
from gossipnet.collectives.lossy.stale_step import StaleStep

__all__ = ("ReduceHook", "RoundOptions")

#: ``on_reduced`` receives the owned shards with their averaged values and returns
#: the values to broadcast for those ranges (same order), e.g. stepped parameters.
ReduceHook = Callable[[list[OwnedShard]], list[torch.Tensor]]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundOptions:
    """Per-round options of :meth:`~.engine.LossyAllReduce.run`.

    Attributes:
        dst: where the gathered values go (default: the round's ``src``); chunks
            whose broadcast was lost keep the values ``dst`` already holds.
        weight: this peer's weight (e.g. micro-batches done), in ``[0, 2**24]``
            (:data:`.reducer.MAX_WEIGHT`: every peer refuses a contribution weighted
            more).  A chunk whose arrived weights sum to 0 keeps this peer's own values.
        timeout_s: bound of the whole round (default ``Config.collective_timeout_s``).
        on_reduced: maps the averaged owned shards to the values to broadcast
            (default: the averages themselves).
        participants: override the membership view (tests, Moshpit groups).
        mode: what the round carries (e.g. 0 gradients, 1 parameters), in [0, 255];
            packets of another mode are dropped, so peers that disagree on it
            never mix gradients into parameters.
        repair: after the all-gather, re-request lost chunks from their owners
            until none is missing or the deadline passes (resyncs that must leave
            every peer identical).
        redundancy: copies of every data packet, >= 1 (default ``Config.redundancy``);
            2 turns a loss rate p into about p^2 for twice the traffic.
        stale_step: estimate the chunks of ``dst`` whose broadcast was lost (an
            optimizer's parameters, ``src`` its gradient) instead of keeping them:
            see :mod:`.stale_step`; the report's ``extra["estimated"]``.
        parity_group: XOR parity group size while loss is seen, in [0, 64]
            (default ``Config.parity_for(optimizer=False)``); 0 for none.
        round_id: what this round is, the same on every peer (the optimizer's:
            :func:`.round_id.optimizer_round`), in [0, 2**53); above every id run
            before.  Default: the next call, caught up to the round a quorum of recent
            participants claims (:mod:`.claims`).
        compress: the round's compressor (:class:`.compressed.ChunkCodec`, e.g. a
            :class:`gossipnet.collectives.compress.CompressSession`); None: dense.
            No parity and no repair with it (parity XORs dense payloads).
        robust: how an owner aggregates its chunks: None, the weighted mean;
            a :class:`.robust.CenteredClip`, centered clipping of the
            contributions (bounds what one peer's values can do; keeps every
            contribution in memory).  Not with ``compress``.

    Raises:
        ValueError: a value out of the ranges above.
    """

    dst: Sequence[torch.Tensor] | None = None
    weight: float = 1.0
    timeout_s: float | None = None
    on_reduced: ReduceHook | None = None
    participants: Sequence[str] | None = None
    mode: int = 0
    repair: bool = False
    redundancy: int | None = None
    stale_step: StaleStep | None = None
    parity_group: int | None = None
    round_id: int | None = None
    compress: ChunkCodec | None = None
    robust: CenteredClip | None = None

    def __post_init__(self) -> None:
        if self.round_id is not None and not valid_round(self.round_id):
            raise ValueError(f"round_id must be an int in [0, 2**53), got {self.round_id!r}")
        rd = self.redundancy
        if rd is not None and not (isinstance(rd, int) and rd >= 1):
            raise ValueError(f"redundancy must be an int >= 1, got {rd!r}")
        pg = self.parity_group
        if pg is not None and not (isinstance(pg, int) and 0 <= pg <= MAX_GROUP):
            raise ValueError(f"parity_group must be an int in [0, {MAX_GROUP}], got {pg}")
        if not valid_weight(self.weight):  # NaN fails too
            raise ValueError(f"weight must be a number in [0, {MAX_WEIGHT:.0f}], got {self.weight}")
        if not valid_mode(self.mode):
            raise ValueError(f"mode must be an int in [0, 255], got {self.mode!r}")
        if self.robust is not None and not isinstance(self.robust, CenteredClip):
            raise ValueError(f"robust must be a CenteredClip or None, got {self.robust!r}")
        if self.compress is not None and self.robust is not None:
            raise ValueError(
                "a compressed round cannot clip (contributions enter the sums compressed)"
            )
        if self.compress is not None and self.repair:
            raise ValueError("a compressed round cannot repair (repair serves dense bytes)")
