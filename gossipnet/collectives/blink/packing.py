"""Spanning-tree packing for Blink collectives (ALGORITHMS.md 5.1).

Blink (Wang et al., MLSys 2020) broadcasts over several spanning trees at once so that
every NVLink carries data; the best rate from a root is the min cut (Edmonds' branching
theorem).  This module computes

* the exact optimum: :func:`broadcast_min_cut` (max-flow) for a broadcast, and the
  Tutte/Nash-Williams partition bound for an all-reduce;
* a fractional packing by multiplicative weights (Garg-Koenemann) whose oracle is a
  minimum arborescence (Chu-Liu/Edmonds) or a minimum spanning tree.  Each MWU run is
  (1 - O(eps))-optimal; we then scale the weights up until the tightest link is full
  (the packing stays feasible and gets closer to optimal) and retry with eps halved
  (0.1, 0.05, 0.025, 0.0125) until the rate reaches ``target`` (default 99%) of the
  exact optimum; the MWU's dual bound certifies the gap where no exact value exists;
* a reduction to few trees (default "auto": max(6, k - 1)): a greedy that takes one
  tree at a time, the candidate with the largest *safe* residual rate (the rate that
  leaves the rest able to carry the remaining optimum; :mod:`._reduce`), then an LP
  re-optimises the chosen trees' rates.  On every 2- to 8-GPU DGX-1 V100/P100
  allocation (NVLink capacities) this kept 100% of the broadcast min cut and >= 96%
  of the all-reduce bound when written; ``bench/blink.py`` re-checks it.

A reduce uses the broadcast trees with edges reversed (:func:`edge_load` "up").

All-reduce model (derived): reduce goes up a tree and broadcast comes down the *same*
tree, so a tree edge {u, v} carries the tree's rate once in each direction, and the
best all-reduce over trees is the best packing of *undirected* spanning trees with
link capacity min(c_uv, c_vu).  The rate does not depend on the roots, so each tree is
rooted at its centre (shallowest pipeline); a single root would do the same rate.
With NVSwitch (every pair linked at one capacity c) the optimum N c / 2 is reached by
N one-hop stars, each GPU rooting 1/N of the buffer (= reduce-scatter + all-gather).
The buffer's all-reduce then takes about S / rate plus the pipeline's fill time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from gossipnet.collectives.blink._graph import (
    MAX_PARTITION_NODES,
    broadcast_min_cut,
    cut_rows,
    min_arborescence,
    min_spanning_tree,
    partition_bound,
    partition_rows,
)
from gossipnet.collectives.blink._mwu import Oracle, mwu_pack
from gossipnet.collectives.blink._reduce import lp_forward, polish, safe_greedy

__all__ = (
    "Packing",
    "Tree",
    "broadcast_min_cut",
    "edge_load",
    "fits",
    "pack_allreduce",
    "pack_broadcast",
)

EPS_SCHEDULE = (0.1, 0.05, 0.025, 0.0125)
_TOL = 1e-9
_POOL = 32  # MWU trees offered to the reduction, heaviest first
_MAX_CUT_ROWS_K = 12  # 2^(k-1) cut rows: enumerated up to here
#: "auto" all-reduce packings below this fraction of the bound may use _EXTRA_TREES more
#: trees (dense NVLink + PCIe graphs of 6 GPUs need 7-8 trees for >= 95%).
_KEEP = 0.95
_EXTRA_TREES = 2


@dataclass(frozen=True, slots=True)
class Tree:
    """A spanning tree over GPUs 0..k-1 (indices into the capacity matrix).

    Attributes:
        root: the root.
        parent: ``parent[v]`` for every node, ``parent[root] == -1``.
        rate: GB/s of buffer this tree carries.
    """

    root: int
    parent: tuple[int, ...]
    rate: float

    def __post_init__(self) -> None:
        p = self.parent
        if not 0 <= self.root < len(p) or p[self.root] != -1:
            raise ValueError(f"root {self.root} must have parent -1 in {p}")
        if sum(x == -1 for x in p) != 1 or any(not -1 <= x < len(p) for x in p):
            raise ValueError(f"parent array {p} is not a tree over {len(p)} nodes")
        if any(d < 0 for d in self.depths):
            raise ValueError(f"parent array {p} has a cycle")

    @property
    def k(self) -> int:
        return len(self.parent)

    @property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """(parent, child) pairs, directed away from the root."""
        return tuple((p, v) for v, p in enumerate(self.parent) if p >= 0)

    @property
    def depths(self) -> tuple[int, ...]:
        """Hops from the root per node; -1 for a node on a cycle (invalid tree)."""
        return _depths(self.parent)

    @property
    def height(self) -> int:
        return max(self.depths)


@functools.cache
def _depths(parent: tuple[int, ...]) -> tuple[int, ...]:
    k = len(parent)
    out = []
    for v in range(k):
        d, u = 0, v
        while parent[u] >= 0 and d <= k:
            u, d = parent[u], d + 1
        out.append(d if d <= k else -1)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Packing:
    """Trees with rates for one collective over k GPUs.

    Attributes:
        kind: "broadcast" (directed trees from ``root``; a reduce uses them reversed,
            see :func:`reverse`) or "allreduce" (each tree used up then down; each
            tree has its own root).
        root: the broadcast root; None for "allreduce".
        k: the number of GPUs.
        trees: the trees; their rates sum to ``rate``.
        rate: GB/s of buffer moved by the whole packing.
        min_cut: the exact optimum it is measured against: max-flow min cut from the
            root ("broadcast"), or the partition bound ("allreduce"; for more than 10
            GPUs the MWU's dual bound, an upper bound).
    """

    kind: str
    root: int | None
    k: int
    trees: tuple[Tree, ...]
    rate: float
    min_cut: float

    @property
    def gap(self) -> float:
        """1 - rate / min_cut (0 = optimal)."""
        if self.min_cut <= 0 or math.isinf(self.min_cut):
            return 0.0
        return 1.0 - self.rate / self.min_cut


def edge_load(packing: Packing, direction: str = "down") -> np.ndarray:
    """k x k GB/s each directed link carries.

    Args:
        packing: the trees.
        direction: "down" (broadcast: parent -> child), "up" (reduce: the same trees
            with edges reversed, child -> parent), or "both" (an all-reduce: up, then
            down, pipelined so both directions are busy at once).
    """
    if direction not in ("down", "up", "both"):
        raise ValueError(f"direction must be 'down', 'up' or 'both', got {direction!r}")
    load = np.zeros((packing.k, packing.k))
    for t in packing.trees:
        for p, v in t.edges:
            if direction in ("down", "both"):
                load[p, v] += t.rate
            if direction in ("up", "both"):
                load[v, p] += t.rate
    return load


def fits(packing: Packing, cap: np.ndarray, direction: str = "down", rtol: float = 1e-6) -> bool:
    """True when every directed link's load is within its capacity (``rtol`` slack)."""
    c = np.asarray(cap, dtype=np.float64)
    return bool((edge_load(packing, direction) <= c * (1 + rtol) + 1e-9).all())


def _best_mwu(
    cap: np.ndarray, oracle: Oracle, undirected: bool, exact: float | None, target: float
) -> tuple[dict[tuple[int, ...], float], float]:
    """MWU with eps halved until the rate is >= target x the optimum (exact, or else the
    best dual bound seen)."""
    weights: dict[tuple[int, ...], float] = {}
    bound = math.inf
    for eps in EPS_SCHEDULE:
        # stop a little past the target, so float rounding never lands just short
        stop = math.inf if exact is None else min(1.0, target + 0.0025) * exact
        weights, dual = mwu_pack(cap, oracle, undirected, eps, stop)
        bound = min(bound, dual)
        ref = exact if exact is not None else bound
        if sum(weights.values()) >= target * ref - _TOL:
            break
    return weights, (exact if exact is not None else bound)


def _few(
    cap: np.ndarray,
    weights: dict[tuple[int, ...], float],
    rows: tuple[np.ndarray, np.ndarray] | None,
    lam: float,
    *,
    root: int,
    oracle: Oracle,
    undirected: bool,
    max_trees: int,
) -> list[tuple[tuple[int, ...], float]]:
    """At most ``max_trees`` trees (see :mod:`._reduce`), rates re-optimised by an LP."""
    first = sorted(weights, key=lambda t: (-weights[t], t))[:_POOL]
    if rows is None:
        picked = lp_forward(cap, first, undirected=undirected, max_trees=max_trees, goal=lam)
        return polish(cap, picked, undirected)

    def candidates(res: np.ndarray, left: float) -> list[tuple[int, ...]]:
        if not undirected or left >= lam * (1 - 1e-12):
            return first
        w, _ = mwu_pack(res, oracle, True, EPS_SCHEDULE[0], 0.99 * left)
        return sorted(w, key=lambda t: (-w[t], t))[:_POOL]

    picked = safe_greedy(
        cap, rows, lam, candidates, root=root, undirected=undirected, max_trees=max_trees
    )
    return polish(cap, picked, undirected)


def _rooted(parent: tuple[int, ...], root: int) -> tuple[int, ...]:
    """The same undirected tree re-rooted at ``root``."""
    k = len(parent)
    adj: list[list[int]] = [[] for _ in range(k)]
    for v, p in enumerate(parent):
        if p >= 0:
            adj[v].append(p)
            adj[p].append(v)
    out = [-2] * k
    out[root] = -1
    stack = [root]
    while stack:
        u = stack.pop()
        for v in adj[u]:
            if out[v] == -2:
                out[v] = u
                stack.append(v)
    return tuple(out)


def _centre(parent: tuple[int, ...]) -> tuple[int, ...]:
    """Re-root an undirected tree at the node giving the smallest height (ties: lowest)."""
    options = [_rooted(parent, r) for r in range(len(parent))]
    return min(options, key=lambda p: max(_depths(p)))


def _is_uniform_clique(ucap: np.ndarray) -> bool:
    off = ucap[~np.eye(ucap.shape[0], dtype=bool)]
    return bool(off.size) and float(off.min()) > 0 and np.allclose(off, off[0])


def _finish(
    kind: str,
    root: int | None,
    k: int,
    picked: list[tuple[tuple[int, ...], float]],
    min_cut: float,
) -> Packing:
    trees = []
    for parent, rate in sorted(picked, key=lambda pr: (-pr[1], pr[0])):
        p = _centre(parent) if root is None else parent
        trees.append(Tree(p.index(-1), p, rate))
    return Packing(kind, root, k, tuple(trees), sum(t.rate for t in trees), min_cut)


def _tree_budget(max_trees: int | str | None, k: int) -> int | None:
    """Tree budget: "auto" = max(6, k - 1): about 6 streams, but k - 1 where a switch needs
    that many one-hop relays (a broadcast over NVSwitch); an all-reduce packing that
    stays below 95% of its bound may then take 2 more trees."""
    if max_trees == "auto":
        return max(6, k - 1)
    if max_trees is not None and (not isinstance(max_trees, int) or max_trees < 1):
        raise ValueError(f"max_trees must be 'auto', None or an int >= 1, got {max_trees!r}")
    return max_trees


def pack_broadcast(
    cap: np.ndarray, root: int, *, max_trees: int | str | None = "auto", target: float = 0.99
) -> Packing:
    """Arborescences from ``root`` whose rate is within 1 - ``target`` of the min cut.

    Args:
        cap: k x k GB/s per direction (``cap[u, v]``: u -> v), zero diagonal.
        root: the broadcasting GPU (index into ``cap``).
        max_trees: reduce to at most this many trees; "auto" = max(6, k - 1) (every
            allocation of the DGX-1 fixtures then keeps >= 95% of the optimum, most
            100%); None keeps every MWU tree.
        target: the fraction of the min cut the MWU must reach.

    Returns:
        A "broadcast" :class:`Packing`; rate 0 and no trees when some GPU is
        unreachable from ``root``.
    """
    cap = _check_cap(cap)
    k = cap.shape[0]
    max_trees = _tree_budget(max_trees, k)
    if not 0 <= root < k:
        raise ValueError(f"root {root} out of range for {k} GPUs")
    if k == 1:
        return Packing("broadcast", root, 1, (), math.inf, math.inf)
    exact = broadcast_min_cut(cap, root)
    if exact <= _TOL:
        return Packing("broadcast", root, k, (), 0.0, 0.0)

    def oracle(length: np.ndarray) -> np.ndarray | None:
        return min_arborescence(length, root)

    weights, _ = _best_mwu(cap, oracle, False, exact, target)
    if max_trees is None:
        return _finish("broadcast", root, k, list(weights.items()), exact)
    rows = cut_rows(k, root) if k <= _MAX_CUT_ROWS_K else None
    picked = _few(
        cap, weights, rows, exact, root=root, oracle=oracle, undirected=False, max_trees=max_trees
    )
    return _finish("broadcast", root, k, picked, exact)


def pack_allreduce(
    cap: np.ndarray, *, max_trees: int | str | None = "auto", target: float = 0.99
) -> Packing:
    """Undirected spanning trees for reduce-then-broadcast (see the module docstring).

    Args:
        cap: k x k GB/s per direction; a link counts with min(c_uv, c_vu).
        max_trees: as for :func:`pack_broadcast`, except that "auto" takes up to 2
            more trees when max(6, k - 1) stay below 95% of the bound (ignored for a
            uniform clique, which always gets k one-hop stars).
        target: the fraction of the partition bound the MWU must reach.

    Returns:
        An "allreduce" :class:`Packing`; rate 0 and no trees when the GPUs are not
        connected.
    """
    cap = _check_cap(cap)
    k = cap.shape[0]
    auto = max_trees == "auto"
    max_trees = _tree_budget(max_trees, k)
    ucap = np.minimum(cap, cap.T)
    if k == 1:
        return Packing("allreduce", None, 1, (), math.inf, math.inf)
    exact = partition_bound(ucap) if k <= MAX_PARTITION_NODES else None
    if exact is not None and exact <= _TOL:
        return Packing("allreduce", None, k, (), 0.0, 0.0)
    if _is_uniform_clique(ucap):  # NVSwitch: k stars, each GPU reduces 1/k
        c = float(ucap[0, 1])
        stars = [(tuple(-1 if v == r else r for v in range(k)), c / 2) for r in range(k)]
        return _finish("allreduce", None, k, stars, exact if exact is not None else k * c / 2)
    weights, bound = _best_mwu(ucap, min_spanning_tree, True, exact, target)
    if not weights:
        return Packing("allreduce", None, k, (), 0.0, 0.0)
    if max_trees is None:
        return _finish("allreduce", None, k, list(weights.items()), bound)
    rows = partition_rows(k) if k <= MAX_PARTITION_NODES else None
    for budget in (max_trees, max_trees + _EXTRA_TREES) if auto else (max_trees,):
        picked = _few(
            ucap,
            weights,
            rows,
            bound,
            root=0,
            oracle=min_spanning_tree,
            undirected=True,
            max_trees=budget,
        )
        if sum(w for _, w in picked) >= _KEEP * bound:
            break
    return _finish("allreduce", None, k, picked, bound)


def _check_cap(cap: np.ndarray) -> np.ndarray:
    arr = np.asarray(cap, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] == 0:
        raise ValueError(f"capacity matrix must be k x k with k >= 1, got shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError("capacities must be finite and >= 0 (GB/s per direction)")
    arr = arr.copy()
    np.fill_diagonal(arr, 0.0)
    return arr
