"""Small dense graph algorithms for tree packing: max-flow, arborescences, spanning trees.

Why our own: the graphs are GPUs in one machine (<= 16 nodes), so dense k x k numpy
matrices are both the simplest and the fastest representation, and gossipnet does not
depend on networkx or scipy at run time (tests cross-check against networkx).

Conventions: ``cap[u, v]`` is the capacity of the directed edge u -> v (GB/s per
direction; 0 = no edge); ``length[u, v]`` is a cost, ``inf`` = no edge.  A tree is a
parent array: ``parent[root] == -1`` and every other node's parent, so the tree's edges
are ``(parent[v], v)`` for ``v != root``.
"""

from __future__ import annotations

import functools
from collections import deque

import numpy as np

__all__ = (
    "broadcast_min_cut",
    "cut_rows",
    "max_flow",
    "max_spanning_tree",
    "min_arborescence",
    "min_spanning_tree",
    "partition_bound",
    "partition_rows",
    "widest_arborescence",
)

#: Exact partition enumeration stops here (Bell(10) = 115975 partitions, ~0.1 s).
MAX_PARTITION_NODES = 10


def max_flow(cap: np.ndarray, s: int, t: int) -> float:
    """Value of a maximum s -> t flow (Edmonds-Karp: BFS shortest augmenting paths).

    Why Edmonds-Karp: O(V E^2) augmentations is nothing for 16 nodes, it terminates on
    real-valued capacities (shortest paths, not arbitrary ones), and it is short.
    """
    if s == t:
        raise ValueError("max_flow needs two different nodes")
    res = np.array(cap, dtype=np.float64)
    k = res.shape[0]
    total = 0.0
    tol = 1e-12 * max(1.0, float(res.max(initial=0.0)))
    while True:
        prev = np.full(k, -1)
        prev[s] = s
        queue = deque([s])
        while queue and prev[t] < 0:
            u = queue.popleft()
            for v in np.flatnonzero((res[u] > tol) & (prev < 0)):
                prev[v] = u
                queue.append(int(v))
        if prev[t] < 0:
            return total
        path_v = [t]
        while path_v[-1] != s:
            path_v.append(int(prev[path_v[-1]]))
        us, vs = np.array(path_v[1:]), np.array(path_v[:-1])
        push = float(res[us, vs].min())
        res[us, vs] -= push
        res[vs, us] += push
        total += push


def broadcast_min_cut(cap: np.ndarray, root: int) -> float:
    """Best broadcast rate from ``root``: min over v of max-flow(root, v).

    By Edmonds' branching theorem this equals the value of the best fractional packing
    of arborescences rooted at ``root`` (ALGORITHMS.md 5.1 step 2).  0 when some GPU
    cannot be reached.
    """
    k = cap.shape[0]
    if k == 1:
        return float("inf")
    return min(max_flow(cap, root, v) for v in range(k) if v != root)


@functools.cache
def _partitions(k: int) -> np.ndarray:
    """All set partitions of k items with >= 2 blocks, as restricted growth strings."""
    rows: list[list[int]] = []

    def grow(prefix: list[int], top: int) -> None:
        if len(prefix) == k:
            if top >= 1:
                rows.append(prefix.copy())
            return
        for b in range(top + 2):
            prefix.append(b)
            grow(prefix, max(top, b))
            prefix.pop()

    grow([0], 0)
    return np.array(rows, dtype=np.int8).reshape(-1, k)


@functools.cache
def cut_rows(k: int, root: int) -> tuple[np.ndarray, np.ndarray]:
    """Every r-cut as a row: M[X, u*k+v] = 1 iff u is outside X and v inside it.

    X runs over the non-empty subsets of the nodes other than ``root`` (2^(k-1) - 1
    rows), so ``M @ cap.ravel()`` is every cut's capacity and its minimum is the
    broadcast min cut.  Returns (M, d) with d = 1 per row (the demand a tree puts on
    a cut), matching :func:`partition_rows`.
    """
    others = np.array([v for v in range(k) if v != root])
    codes = np.arange(1, 2 ** (k - 1))
    inside = np.zeros((codes.size, k), dtype=bool)
    inside[:, others] = (codes[:, None] >> np.arange(k - 1)[None, :]) & 1 == 1
    m = (~inside)[:, :, None] & inside[:, None, :]
    return m.reshape(codes.size, k * k).astype(np.float64), np.ones(codes.size)


@functools.cache
def partition_rows(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every partition as a row: M[P, i*k+j] = 1 iff i < j lie in different blocks.

    Returns (M, d) with d = |P| - 1, the least number of edges of a spanning tree that
    cross P; the partition bound is min over rows of (M @ cap.ravel()) / d.
    """
    labels = _partitions(k)
    cross = labels[:, :, None] != labels[:, None, :]
    cross &= np.triu(np.ones((k, k), dtype=bool), 1)[None]
    d = labels.max(axis=1).astype(np.float64)
    return cross.reshape(labels.shape[0], k * k).astype(np.float64), d


def partition_bound(ucap: np.ndarray) -> float:
    """Best fractional spanning-tree packing of an undirected graph (Tutte/Nash-Williams).

    Value = min over partitions P of the nodes (|P| >= 2) of cap(edges between blocks)
    / (|P| - 1).  Exact by enumeration up to :data:`MAX_PARTITION_NODES` nodes.

    Args:
        ucap: symmetric k x k capacities of the undirected links.

    Raises:
        ValueError: more than :data:`MAX_PARTITION_NODES` nodes.
    """
    k = ucap.shape[0]
    if k == 1:
        return float("inf")
    if k > MAX_PARTITION_NODES:
        raise ValueError(f"exact partition bound is limited to {MAX_PARTITION_NODES} nodes")
    labels = _partitions(k)
    iu, ju = np.triu_indices(k, 1)
    crossing = labels[:, iu] != labels[:, ju]  # (P, pairs)
    cut = crossing.astype(np.float64) @ ucap[iu, ju]
    blocks = labels.max(axis=1).astype(np.float64)  # |P| - 1
    return float((cut / blocks).min())


def _find_cycle(parent: np.ndarray, root: int) -> np.ndarray | None:
    """One cycle of the 'best in-edge' graph, or None (then it is an arborescence)."""
    k = parent.shape[0]
    state = np.zeros(k, dtype=np.int64)  # 0 unseen, >0 the walk that saw it
    state[root] = -1
    for start in range(k):
        if state[start] != 0:
            continue
        v = start
        while state[v] == 0:
            state[v] = start + 1
            v = int(parent[v])
        if state[v] == start + 1:  # came back into this walk: a cycle through v
            cycle = [v]
            u = int(parent[v])
            while u != v:
                cycle.append(u)
                u = int(parent[u])
            return np.array(cycle)
    return None


def _chu_liu_edmonds(w: np.ndarray, root: int) -> np.ndarray | None:
    k = w.shape[0]
    cols = np.arange(k)
    parent = w.argmin(axis=0)
    best = w[parent, cols]
    parent[root] = -1
    best[root] = 0.0
    if np.isinf(best).any():
        return None
    cycle = _find_cycle(parent, root)
    if cycle is None:
        return parent
    in_cycle = np.zeros(k, dtype=bool)
    in_cycle[cycle] = True
    rest = np.flatnonzero(~in_cycle)
    m = rest.shape[0]  # the contracted cycle becomes node m
    w2 = np.full((m + 1, m + 1), np.inf)
    w_rest = w[rest]
    w2[:m, :m] = w_rest[:, rest]
    into = w_rest[:, cycle] - best[cycle][None, :]  # entering v breaks v's cycle edge
    j_in = into.argmin(axis=1)
    w2[:m, m] = into[np.arange(m), j_in]
    out = w[cycle][:, rest]
    i_out = out.argmin(axis=0)
    w2[m, :m] = out[i_out, np.arange(m)]
    root2 = int(np.searchsorted(rest, root))
    p2 = _chu_liu_edmonds(w2, root2)
    if p2 is None:
        return None
    full = parent.copy()
    pr = p2[:m]
    full[rest] = np.where(pr == m, cycle[i_out], rest[np.clip(pr, 0, m - 1)])
    full[root] = -1
    entry_from = int(p2[m])
    full[cycle[j_in[entry_from]]] = rest[entry_from]
    return full


def min_arborescence(length: np.ndarray, root: int) -> np.ndarray | None:
    """Minimum-cost arborescence rooted at ``root`` (Chu-Liu/Edmonds), or None.

    Each level picks every node's cheapest in-edge (one vectorised argmin); a cycle
    among those is contracted into one node with entering costs reduced by the cycle
    edge they would replace, solved recursively, then expanded.  At most k levels.

    Args:
        length: k x k costs of directed edges u -> v; ``inf`` where there is no edge.
        root: the root.

    Returns:
        The parent array, or None when some node is unreachable from ``root``.
    """
    w = np.array(length, dtype=np.float64)
    np.fill_diagonal(w, np.inf)
    w[:, root] = np.inf
    return _chu_liu_edmonds(w, root)


def _prim(score: np.ndarray, better: str, root: int, combine: str) -> np.ndarray | None:
    """Prim-style growth from ``root``: dense O(k^2), one vectorised update per node.

    ``combine`` = "edge" keeps the edge score (spanning trees); "min" keeps the
    bottleneck of the path (widest-path tree = max-bottleneck arborescence).
    """
    k = score.shape[0]
    worst = np.inf if better == "min" else -np.inf
    key = np.full(k, worst)
    parent = np.full(k, -1)
    done = np.zeros(k, dtype=bool)
    key[root] = -worst
    for _ in range(k):
        todo = np.flatnonzero(~done)
        if todo.size == 0:
            break
        u = int(todo[np.argmin(key[todo]) if better == "min" else np.argmax(key[todo])])
        if key[u] == worst:
            return None  # the rest is unreachable
        done[u] = True
        via = score[u] if combine == "edge" else np.minimum(score[u], key[u])
        improve = ~done & ((via < key) if better == "min" else (via > key))
        key[improve] = via[improve]
        parent[improve] = u
    parent[root] = -1
    return parent


def min_spanning_tree(length: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Minimum spanning tree of a symmetric cost matrix (``inf`` = no link), or None."""
    w = np.array(length, dtype=np.float64)
    np.fill_diagonal(w, np.inf)
    return _prim(w, "min", root, "edge")


def max_spanning_tree(ucap: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Maximum spanning tree of symmetric capacities (0 = no link); it maximises the
    bottleneck too.  None when the graph is disconnected."""
    w = np.where(ucap > 0, ucap, -np.inf).astype(np.float64)
    np.fill_diagonal(w, -np.inf)
    return _prim(w, "max", root, "edge")


def widest_arborescence(cap: np.ndarray, root: int) -> np.ndarray | None:
    """Arborescence at ``root`` with the largest bottleneck (union of widest paths)."""
    w = np.where(cap > 0, cap, -np.inf).astype(np.float64)
    np.fill_diagonal(w, -np.inf)
    return _prim(w, "max", root, "min")
