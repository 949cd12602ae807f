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
from typing import Literal

import torch

from gossipnet.collectives.lossy.reducer import ShardReducer

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
    """A :class:`~.reducer.ShardReducer` that averages by :func:`centered_clip`: the
    same store of every contribution, refusals, counters and ``average`` contract.

    Args:
        acc, chunks, chunk_elems, weight: as :class:`~.reducer.ShardReducer`.
        rule: the clipping rule.
        senders: the round's participants, ``me`` among them: one row each.
        me: this peer (row 0: ``acc``'s values, unweighted).
    """

    __slots__ = ("_all", "rule")

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
        # row 0 ours, then the others' (the base's store); zeros where nothing arrived,
        # as centered_clip needs
        block = torch.zeros(len(others) + 1, len(chunks) * chunk_elems, dtype=acc.dtype)
        block[0, : acc.numel()].copy_(acc)  # before the base scales acc by our weight
        super().__init__(acc, chunks, chunk_elems, weight, others, store=block[1:])
        self._all = block
        self.rule = rule

    def average(self, own: torch.Tensor) -> torch.Tensor:
        """Centered clipping per chunk into ``acc``, which is returned; a chunk with no
        weight keeps our own values (``own`` is not read: row 0 holds them)."""
        self.closed = True
        acc, step, k = self.acc, self.chunk_elems, self._all.shape[0]
        n_elems = acc.numel()
        if not len(self.chunks):
            return acc
        n_full = min(len(self.chunks), n_elems // step)
        own_w = torch.full((1, len(self.chunks)), self._own_w, dtype=torch.float64)
        pw = torch.cat([own_w, self._pw])
        zero = pw.sum(0) <= 0
        pw[0, zero] = 1.0  # no weight arrived: our own values, as the mean does
        rule = self.rule
        if n_full:
            x = self._all[:, : n_full * step].view(k, n_full, step)
            got = centered_clip(x, pw[:, :n_full], rule.tau, rule.iters, rule.start)
            acc[: n_full * step].view(n_full, step).copy_(got)
        if n_elems > n_full * step:
            x = self._all[:, n_full * step : n_elems].view(k, 1, -1)
            got = centered_clip(x, pw[:, n_full:], rule.tau, rule.iters, rule.start)
            acc[n_full * step :].copy_(got[0])
        return acc
