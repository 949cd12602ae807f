"""Few trees with rates: the reduction step after MWU (ALGORITHMS.md 5.1.4).

Why not keep the MWU's trees: it returns dozens (88 from GPU0 of a DGX-1V), and every
tree is a stream and a smaller chunk.  Blink picks a few with an integer program; a
third-party fork takes the largest residual bottleneck greedily.  That plain greedy
gives each pick its whole bottleneck, which can cut the remaining graph badly: on a
full DGX-1V it stops at 125 of 150 GB/s.  We keep the greedy but make each pick *safe*:

Safe greedy (derived from Lovasz's proof of Edmonds' branching theorem).  Let lam be
the optimum of what is left (broadcast: min cut; all-reduce: partition bound).  A tree
T may take rate w only if the rest still has optimum >= lam - w, i.e. for every cut
row i (every r-cut X, or every partition P; see :func:`._graph.cut_rows`)

    M_i . (res - w 1_T) >= d_i (lam - w)  <=>  w (M_i . 1_T - d_i) <= slack_i.

So the largest safe w is min over rows with M_i . 1_T > d_i of slack_i / (M_i . 1_T -
d_i), capped by T's residual bottleneck: one vectorised expression.  Each round takes
the candidate with the largest safe w; candidates are the MWU's trees and one tree
grown arc by arc, each arc chosen to keep the safe w largest.  With integral link
counts Lovasz's lemma guarantees a grown tree of one whole link, so a DGX-1 packs
exactly (e.g. 6 trees x 25 GB/s from GPU0 of a DGX-1V).  The rows are enumerated, so
this runs for up to 12 GPUs (broadcast) or 10 (all-reduce); above that
:func:`lp_forward` (forward selection by LP value) takes over.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gossipnet.collectives.blink._lp import LpResult, max_sum
from gossipnet.collectives.blink._mwu import edge_index

__all__ = ("lp_forward", "polish", "safe_greedy")

_TOL = 1e-9


def _safe_w(slack: np.ndarray, over: np.ndarray, bottleneck: np.ndarray) -> np.ndarray:
    """Largest safe rate per column: over = M . 1_T - d (rows x cols)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(over > _TOL, slack[:, None] / over, np.inf)
    return np.minimum(ratio.min(axis=0), bottleneck)


def _grow(
    res: np.ndarray, m: np.ndarray, d: np.ndarray, slack: np.ndarray, root: int, undirected: bool
) -> tuple[tuple[int, ...], float] | None:
    """Grow one tree from ``root``, each arc keeping the safe rate largest."""
    k = res.shape[0]
    parent = np.full(k, -1)
    inside = np.zeros(k, dtype=bool)
    inside[root] = True
    load = np.zeros(m.shape[0])  # M . 1_T
    bottleneck = np.inf
    w = np.inf
    for _ in range(k - 1):
        us, vs = np.nonzero(inside[:, None] & ~inside[None, :] & (res > _TOL))
        if us.size == 0:
            return None
        flat = np.minimum(us, vs) * k + np.maximum(us, vs) if undirected else us * k + vs
        over = load[:, None] + m[:, flat] - d[:, None]
        safe = _safe_w(slack, over, np.minimum(bottleneck, res.ravel()[flat]))
        best = int(np.argmax(safe))
        w = float(safe[best])
        if w <= _TOL:
            return None
        parent[vs[best]] = us[best]
        inside[vs[best]] = True
        load += m[:, flat[best]]
        bottleneck = min(bottleneck, float(res.ravel()[flat[best]]))
    return tuple(int(x) for x in parent), w


def safe_greedy(
    cap: np.ndarray,
    rows: tuple[np.ndarray, np.ndarray],
    lam: float,
    candidates: Callable[[np.ndarray, float], list[tuple[int, ...]]],
    *,
    root: int,
    undirected: bool,
    max_trees: int,
) -> list[tuple[tuple[int, ...], float]]:
    """Pick trees one at a time, each with its largest safe rate (module docstring).

    Args:
        cap: k x k capacities (for ``undirected``: symmetric, read on u < v).
        rows: (M, d) from :func:`._graph.cut_rows` or :func:`._graph.partition_rows`.
        lam: the optimum of ``cap`` for these rows.
        candidates: (residual k x k capacities, optimum left) -> parent arrays to
            consider besides the grown tree (the MWU's trees, of ``cap`` or of the
            residual; the residual's are needed for spanning trees, where a grown tree
            can dead-end).
        root: where grown trees start.
        undirected: spanning trees (all-reduce) instead of arborescences.
        max_trees: stop after this many trees.

    Returns:
        (parent array, rate) pairs; the rates sum to ``lam`` unless the tree budget ran
        out first, and never exceed a capacity.
    """
    k = cap.shape[0]
    m, d = rows
    res = cap.astype(np.float64).copy()
    if undirected:
        res = np.triu(res, 1)
    chosen: dict[tuple[int, ...], float] = {}
    left = lam
    while len(chosen) < max_trees and left > _TOL * max(lam, 1.0):
        slack = np.maximum(m @ res.ravel() - d * left, 0.0)
        best: tuple[tuple[int, ...], float] | None = _grow(res, m, d, slack, root, undirected)
        cand = np.array(candidates(res + res.T if undirected else res, left), dtype=np.int64)
        if cand.size:
            cand = cand.reshape(-1, k)
            cand_idx = np.stack([edge_index(c, k, undirected) for c in cand])
            cand_load = m[:, cand_idx].sum(axis=2)  # rows x candidates
            bott = res.ravel()[cand_idx].min(axis=1)
            safe = _safe_w(slack, cand_load - d[:, None], bott)
            j = int(np.argmax(safe))
            if best is None or safe[j] > best[1] + _TOL:
                best = (tuple(int(x) for x in cand[j]), float(safe[j]))
        if best is None or best[1] <= _TOL * max(lam, 1.0):
            break
        tree, w = best
        res.ravel()[edge_index(np.array(tree), k, undirected)] -= w
        chosen[tree] = chosen.get(tree, 0.0) + w
        left -= w
    return list(chosen.items())


def lp_forward(
    cap: np.ndarray,
    candidates: list[tuple[int, ...]],
    *,
    undirected: bool,
    max_trees: int,
    goal: float,
) -> list[tuple[tuple[int, ...], float]]:
    """Fallback for large islands: add, one at a time, the candidate that raises the
    optimal rate of the chosen set the most (the LP over those trees), until
    ``max_trees`` trees or ``goal``.  Rates are the LP's, so capacities hold."""
    k = cap.shape[0]
    mask = cap > _TOL
    if undirected:
        mask &= np.triu(np.ones((k, k), dtype=bool), 1)
    rows = np.flatnonzero(mask.ravel())
    row_of = np.full(k * k, -1)
    row_of[rows] = np.arange(rows.size)
    b = cap.ravel()[rows]

    def column(t: tuple[int, ...]) -> np.ndarray:
        col = np.zeros(rows.size)
        col[row_of[edge_index(np.array(t), k, undirected)]] = 1.0
        return col

    chosen: list[tuple[int, ...]] = []
    cols: list[np.ndarray] = []
    result: LpResult | None = None
    for _ in range(max_trees):
        step: tuple[float, tuple[int, ...], np.ndarray, LpResult] | None = None
        for t in candidates:
            if t in chosen:
                continue
            col = column(t)
            res = max_sum(np.stack([*cols, col], axis=1), b)
            if step is None or res.value > step[0] + _TOL:
                step = (res.value, t, col, res)
        if step is None:
            break
        _, t, col, result = step
        chosen.append(t)
        cols.append(col)
        if result.value >= goal * (1 - 1e-9):
            break
    if result is None:
        return []
    return [(t, float(w)) for t, w in zip(chosen, result.x, strict=True) if w > _TOL]


def polish(
    cap: np.ndarray, picked: list[tuple[tuple[int, ...], float]], undirected: bool
) -> list[tuple[tuple[int, ...], float]]:
    """Re-optimise the rates of fixed trees (one small LP); never lowers the total."""
    if not picked:
        return picked
    k = cap.shape[0]
    grid = np.triu(np.ones((k, k), dtype=bool), 1) if undirected else np.ones((k, k), bool)
    rows = np.flatnonzero(((cap > _TOL) & grid).ravel())
    row_of = np.full(k * k, -1)
    row_of[rows] = np.arange(rows.size)
    a = np.zeros((rows.size, len(picked)))
    for j, (t, _) in enumerate(picked):
        a[row_of[edge_index(np.array(t), k, undirected)], j] = 1.0
    res = max_sum(a, cap.ravel()[rows])
    if res.value <= sum(w for _, w in picked) + _TOL:
        return picked
    return [(t, float(w)) for (t, _), w in zip(picked, res.x, strict=True) if w > _TOL]
