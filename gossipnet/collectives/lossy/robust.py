"""Robust aggregation at a chunk's owner: centered clipping (:class:`CenteredClip`).

Why: the plain weighted mean (:mod:`.reducer`) lets one participant put a chunk's
average anywhere: values are bounded only far beyond anything honest
(:data:`.reducer.VALUE_LIMIT`), so a member that sends its gradient times 1000
moves every replica by about 1000/N times it.  Centered clipping (Karimireddy,
He & Jaggi, *Learning from History for Byzantine Robust Optimization*, ICML
2021), which hivemind's BTARD (Gorbunov et al., 2022) runs at the owner of each
partition, bounds what any one contribution can do::

    v <- v + sum_i w_i clip(x_i - v) / sum_i w_i,   clip(z) = z min(1, r / ||z||)

for a few iterations from a robust start: the owner's own contribution (it is
honest about its own values, or the chunk is lost whatever the rule) or the
coordinate-wise median of the contributions.  A contribution within ``r`` of
``v`` counts fully, as in the mean; one farther counts as a step of length ``r``
towards it, so a peer of weight ``w`` moves ``v`` at most ``r w / sum(w)`` per
iteration, whatever it sends.

Here the unit is a chunk (what one packet carries): ``r = tau * sqrt(elements)``,
so ``tau`` is a radius per element (root mean square) and means the same for
every chunk size.  Pick it above the honest spread of contributions (e.g. a few
times the typical RMS distance of one peer's gradient from the mean): below
it, honest contributions are clipped too and the result is biased toward the
start.

Cost: the owner keeps every contribution (participants x shard elements, not one
accumulator), and ``iters`` passes over them at the end of the reduce-scatter.
No compressed round (its contributions enter the sums in the compressor) and no
effect on the all-gather, whose chunks come from their single owner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch

from gossipnet.collectives.lossy.reducer import Part, ShardReducer

__all__ = ("CenteredClip", "ClippingReducer", "Start", "centered_clip")

#: Where the iterations start (:class:`CenteredClip`).
Start = Literal["own", "median"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CenteredClip:
    """The owner's aggregation rule: centered clipping (see the module).

    Attributes:
        tau: clipping radius per element (RMS), > 0 and finite.
        iters: iterations, in [1, 100].
        start: where the iterations start: ``"own"``, the owner's own values (its
            own contribution, which it knows to be honest: one copy), or
            ``"median"``, the coordinate-wise median of the contributions that
            arrived (needs no honest owner's values, and costs a sort of every
            element's contributions, several times the iterations).

    Raises:
        ValueError: a value out of those ranges.
    """

    tau: float
    iters: int = 3
    start: Start = "own"

    def __post_init__(self) -> None:
        if not (isinstance(self.tau, (int, float)) and 0 < self.tau < math.inf):
            raise ValueError(f"tau must be a finite number > 0, got {self.tau!r}")
        if not (isinstance(self.iters, int) and 1 <= self.iters <= 100):
            raise ValueError(f"iters must be an int in [1, 100], got {self.iters!r}")
        if self.start not in ("own", "median"):
            raise ValueError(f"start must be 'own' or 'median', got {self.start!r}")


def centered_clip(
    x: torch.Tensor, w: torch.Tensor, tau: float, iters: int, start: Start = "own"
) -> torch.Tensor:
    """Centered clipping of ``x`` (``[k, n, m]``: k senders' values of n chunks of m
    elements, ours first) with weights ``w`` (``[k, n]``, 0 where a sender's chunk
    did not arrive), from ``start`` (:class:`CenteredClip`).

    Every chunk needs one contribution of weight > 0 (the caller keeps its own
    values where none has); absent entries of ``x`` must be finite (zeros).

    Returns:
        ``[n, m]``, the aggregate of each chunk.
    """
    if start == "median":
        v = torch.where((w > 0)[:, :, None], x, math.nan).nanmedian(dim=0).values
    else:
        v = x[0]
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

    __slots__ = ("_pw", "_pw_np", "_row", "_x", "rule")

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
        # per sender and chunk, the weight its part came with (0: none came)
        self._pw = torch.zeros(len(self._row), len(chunks), dtype=torch.float64)
        self._pw[0] = float(weight)
        self._pw_np = self._pw.numpy()  # the same memory: cheap scalar writes

    def _refuse(self, sender: str, chunk: int, numel: int, weight: float) -> str | None:
        if sender not in self._row:
            return "not_participant"
        return super()._refuse(sender, chunk, numel, weight)

    def _add(self, sender: str, row: int, values: torch.Tensor, weight: float) -> None:
        """Keep one accepted part: sender's values of the shard's chunk ``row``."""
        lo = row * self.chunk_elems
        k = self._row[sender]
        self._x[k, lo : lo + values.numel()].copy_(values)
        self._pw_np[k, row] = weight

    def _add_rows(
        self,
        parts: Sequence[Part],
        taken: list[tuple[int, int, float]],
        rows: dict[int, int],
        stacked: torch.Tensor | None,
    ) -> None:
        """Keep the taken parts: stacked rows with one ``index_copy_`` per sender."""
        step = self.chunk_elems
        runs: dict[int, tuple[list[int], list[int]]] = {}  # sender row -> (stacked, chunk)
        for i, row, weight in taken:
            r = rows.get(i) if stacked is not None else None
            if r is None:
                self._add(parts[i][0], row, cast(torch.Tensor, parts[i][2]), weight)
                continue
            k = self._row[parts[i][0]]
            self._pw_np[k, row] = weight
            src, dst = runs.setdefault(k, ([], []))
            src.append(r)
            dst.append(row)
        for k, (src, dst) in runs.items():
            block = cast(torch.Tensor, stacked)
            grid = self._x[k, : (self._x.shape[1] // step) * step].view(-1, step)
            grid.index_copy_(0, torch.tensor(dst), block.index_select(0, torch.tensor(src)))

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
        rule = self.rule
        if n_full:
            x = self._x[:, : n_full * step].view(k, n_full, step)
            got = centered_clip(x, pw[:, :n_full], rule.tau, rule.iters, rule.start)
            acc[: n_full * step].view(n_full, step).copy_(got)
        if n_elems > n_full * step:
            x = self._x[:, n_full * step :].view(k, 1, -1)
            got = centered_clip(x, pw[:, n_full:], rule.tau, rule.iters, rule.start)
            acc[n_full * step :].copy_(got[0])
        return acc
