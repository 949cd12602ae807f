"""Garg-Koenemann multiplicative weights for fractional tree packing (ALGORITHMS.md 5.1.3).

Why MWU: it needs only a minimum-tree oracle (Chu-Liu/Edmonds for arborescences,
Prim for undirected spanning trees) and no LP solver, and it is (1 - O(eps))-optimal.
Trees are parent arrays (``parent[root] == -1``); weights are GB/s.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ("edge_index", "mwu_pack")

_TOL = 1e-9

Oracle = Callable[[np.ndarray], np.ndarray | None]


def edge_index(parent: np.ndarray, k: int, undirected: bool) -> np.ndarray:
    """Flat indices into a k x k matrix of a tree's edges: (parent, child) pairs, or
    (min, max) pairs when ``undirected``."""
    child = np.flatnonzero(parent >= 0)
    par = parent[child]
    if undirected:
        return np.minimum(par, child) * k + np.maximum(par, child)
    return par * k + child


def mwu_pack(
    cap: np.ndarray, oracle: Oracle, undirected: bool, eps: float, stop_at: float = math.inf
) -> tuple[dict[tuple[int, ...], float], float]:
    """Pack the trees ``oracle`` returns under ``cap``; returns (weights, dual bound).

    Garg-Koenemann: lengths start at delta / c_e; each step adds the shortest tree T
    with weight b = its bottleneck and multiplies each of its edges' length by
    (1 + eps b / c_e), until the shortest tree has length >= 1.  Instead of the
    textbook division by log_{1+eps}((1 + eps) / delta) we scale the weights so the
    most loaded link is exactly full: feasible by construction, and never smaller.
    The dual bound min over steps of sum(c_e l_e) / length(T) is an upper bound on the
    optimum (weak LP duality), so ``rate / bound`` certifies the gap.

    Args:
        cap: k x k capacities (symmetric when ``undirected``), zero diagonal.
        oracle: lengths (inf = no edge) -> the shortest tree's parent array, or None.
        undirected: pack undirected spanning trees (lengths kept symmetric).
        eps: accuracy; steps grow like m log m / eps^2 in the worst case.
        stop_at: stop as soon as the scaled rate reaches this (the caller knows the
            optimum and wants 99% of it); the default runs GK to its end.

    Returns:
        ({parent array: weight}, dual bound); ({}, 0.0) if no spanning tree exists.
    """
    k = cap.shape[0]
    has = cap > _TOL
    mask = has & np.triu(np.ones((k, k), dtype=bool), 1) if undirected else has
    m = int(mask.sum())
    delta = (1 + eps) * ((1 + eps) * m) ** (-1 / eps)
    length = np.full((k, k), np.inf)
    length[has] = delta / cap[has]
    trees: dict[tuple[int, ...], float] = {}
    bound = math.inf
    cap_m = cap[mask]
    load = np.zeros(k * k)
    flat_cap = cap.ravel()
    total = 0.0
    for _ in range(1_000_000):  # GK's bound is ~ m log_{1+eps}(1/delta); a backstop only
        parent = oracle(length)
        if parent is None:
            return {}, 0.0
        idx = edge_index(parent, k, undirected)
        alpha = float(length.flat[idx].sum())
        bound = min(bound, float((cap_m * length[mask]).sum()) / alpha)
        if alpha >= 1.0:
            break
        c = cap.flat[idx]
        b = float(c.min())
        key = tuple(int(x) for x in parent)
        trees[key] = trees.get(key, 0.0) + b
        load[idx] += b
        total += b
        used = load > 0
        if total * float((flat_cap[used] / load[used]).min()) >= stop_at:
            break
        length.flat[idx] *= 1.0 + eps * b / c
        if undirected:
            length.T.flat[idx] = length.flat[idx]
    used = load > 0
    scale = float((cap.ravel()[used] / load[used]).min()) if used.any() else 0.0
    return {t: w * scale for t, w in trees.items()}, bound
