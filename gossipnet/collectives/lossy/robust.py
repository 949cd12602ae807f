"""Robust aggregation at a chunk's owner: centered clipping (:class:`CenteredClip`).

Why: the plain weighted mean (:mod:`.reducer`) lets one participant put a chunk's
average anywhere: values are bounded only far beyond anything honest
(:data:`.reducer.VALUE_LIMIT`), so a member that sends its gradient times 1000
moves every replica by about 1000/N times it.  Centered clipping (Karimireddy,
He & Jaggi, *Learning from History for Byzantine Robust Optimization*, ICML
2021), which hivemind's BTARD (Gorbunov et al., 2022) runs at the owner of each
partition, bounds what any one contribution can do::

    v <- v + sum_i w_i clip(x_i - v) / sum_i w_i,   clip(z) = z min(1, r / ||z||)

for a few iterations from a robust start, the coordinate-wise median of the
contributions.  A contribution within ``r`` of ``v`` counts fully, as in the
mean; one farther counts as a step of length ``r`` towards it, so a peer of
weight ``w`` moves ``v`` at most ``r w / sum(w)`` per iteration, whatever it sends.

Here the unit is a chunk (what one packet carries): ``r = tau * sqrt(elements)``,
so ``tau`` is a radius per element (root mean square) and means the same for
every chunk size.  Pick it above the honest spread of contributions (e.g. a few
times the typical RMS distance of one peer's gradient from the mean): below
it, honest contributions are clipped too and the result is biased toward the
median.

Cost: the owner keeps every contribution (participants x shard elements, not one
accumulator), and ``iters`` passes over them at the end of the reduce-scatter.
No compressed round (its contributions enter the sums in the compressor) and no
effect on the all-gather, whose chunks come from their single owner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from gossipnet.collectives.lossy.reducer import Part, ShardReducer

__all__ = ("CenteredClip", "ClippingReducer", "centered_clip")


@dataclass(frozen=True, kw_only=True, slots=True)
class CenteredClip:
    """The owner's aggregation rule: centered clipping (see the module).

    Attributes:
        tau: clipping radius per element (RMS), > 0 and finite.
        iters: iterations from the median, in [1, 100].

    Raises:
        ValueError: a value out of those ranges.
    """

    tau: float
    iters: int = 3

    def __post_init__(self) -> None:
        if not (isinstance(self.tau, (int, float)) and 0 < self.tau < math.inf):
            raise ValueError(f"tau must be a finite number > 0, got {self.tau!r}")
        if not (isinstance(self.iters, int) and 1 <= self.iters <= 100):
            raise ValueError(f"iters must be an int in [1, 100], got {self.iters!r}")


def centered_clip(x: torch.Tensor, w: torch.Tensor, tau: float, iters: int) -> torch.Tensor:
    """Centered clipping of ``x`` (``[k, n, m]``: k senders' values of n chunks of m
    elements) with weights ``w`` (``[k, n]``, 0 where a sender's chunk did not
    arrive); per chunk, the start is the median of the contributions of weight > 0.

    Every chunk needs one contribution of weight > 0 (the caller keeps its own
    values where none has); absent entries of ``x`` must be finite (zeros).

    Returns:
        ``[n, m]``, the aggregate of each chunk.
    """
    present = (w > 0)[:, :, None]
    v = torch.where(present, x, math.nan).nanmedian(dim=0).values
    ws = w.to(x.dtype)
    total = ws.sum(0)[:, None]
    radius = tau * math.sqrt(x.shape[2])
    d = torch.empty_like(x)
    for _ in range(iters):
        torch.sub(x, v, out=d)
        scale = ws * (radius / torch.linalg.vector_norm(d, dim=2)).clamp_(max=1.0)
        v = v + torch.einsum("kn,knm->nm", scale, d) / total
    return v


class ClippingReducer(ShardReducer):
    """A :class:`~.reducer.ShardReducer` that keeps every contribution and averages
    by :func:`centered_clip`: the same refusals, counters and ``average`` contract.

    Args:
        acc, chunks, chunk_elems, weight: as :class:`~.reducer.ShardReducer`.
        rule: the clipping rule.
        senders: the round's participants, ``me`` among them: one row each.
        me: this peer (row 0: ``acc``'s values, unweighted).
    """

    __slots__ = ("_pw", "_row", "_x", "rule")

    def __init__(
        self,
        acc: torch.Tensor,
        chunks: range,
        chunk_elems: int,
        weight: float,
        rule: CenteredClip,
        senders: Sequence[str],
        me: str,
    ) -> None:
        others = [s for s in senders if s != me]
        self._row = {me: 0} | {s: i + 1 for i, s in enumerate(others)}
        self._x = torch.zeros(len(self._row), acc.numel(), dtype=acc.dtype)
        self._x[0].copy_(acc)  # before the base scales acc by our weight
        super().__init__(acc, chunks, chunk_elems, weight)
        self.rule = rule
        self._pw = torch.zeros(len(self._row), len(chunks), dtype=torch.float64)
        self._pw[0] = float(weight)

    def _refuse(self, sender: str, chunk: int, numel: int, weight: float) -> str | None:
        if sender not in self._row:
            return "not_participant"
        return super()._refuse(sender, chunk, numel, weight)

    def _add(self, sender: str, row: int, values: torch.Tensor, weight: float) -> None:
        lo = row * self.chunk_elems
        self._x[self._row[sender], lo : lo + values.numel()].copy_(values)
        self._pw[self._row[sender], row] = weight

    def _add_rows(
        self,
        parts: Sequence[Part],
        taken: list[tuple[int, int, float]],
        rows: dict[int, int],
        stacked: torch.Tensor | None,
    ) -> None:
        for i, row, weight in taken:
            r = rows.get(i) if stacked is not None else None
            values = cast(
                torch.Tensor, stacked[r] if stacked is not None and r is not None else parts[i][2]
            )
            self._add(parts[i][0], row, values, weight)

    def average(self, own: torch.Tensor) -> torch.Tensor:
        """Centered clipping per chunk into ``acc``, which is returned; a chunk with no
        weight keeps our own values (``own`` is not read: row 0 holds them)."""
        self.closed = True
        acc, step, k = self.acc, self.chunk_elems, self._x.shape[0]
        n_elems = acc.numel()
        if not len(self.chunks):
            return acc
        n_full = min(len(self.chunks), n_elems // step)
        pw = self._pw.clone()
        zero = pw.sum(0) <= 0
        pw[0, zero] = 1.0  # no weight arrived: our own values, as the mean does
        tau, iters = self.rule.tau, self.rule.iters
        if n_full:
            x = self._x[:, : n_full * step].view(k, n_full, step)
            acc[: n_full * step].view(n_full, step).copy_(
                centered_clip(x, pw[:, :n_full], tau, iters)
            )
        if n_elems > n_full * step:
            x = self._x[:, n_full * step :].view(k, 1, -1)
            acc[n_full * step :].copy_(centered_clip(x, pw[:, n_full:], tau, iters)[0])
        return acc
