"""Graph primitives of the topology step: Laplacians, Fiedler values, matchings.

A reconstruction of RoADTrain's topology step (ALGORITHMS.md 4.1, steps 3-4; the
paper was not available), close to MATCHA (4.3):

- Gossip converges at a rate set by the Fiedler value lambda2 (second-smallest
  eigenvalue) of the expected Laplacian ``L = D - A_w``, ``A_w[i, j] = r_ij`` the
  link's reliability: error ~ (1 - alpha lambda2)^t.  :func:`fiedler_value`.
- Half-duplex radios talk to one peer at a time, so the contact graph is
  edge-coloured into matchings (Misra-Gries, at most max-degree + 1 colours); the
  links of one matching transfer in parallel.  :func:`edge_colouring`.

Which matchings to use, and when, is :mod:`.schedule`'s job.
"""

from __future__ import annotations

import numpy as np

__all__ = ("components", "edge_colouring", "fiedler_value", "laplacian")

FloatArray = np.ndarray
IntArray = np.ndarray


def laplacian(n: int, edges: IntArray, weights: FloatArray | None = None) -> FloatArray:
    """``L = D - A_w`` (n, n) of an undirected weighted graph given as an edge list."""
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    w = np.ones(len(edges)) if weights is None else np.asarray(weights, dtype=np.float64)
    lap = np.zeros((n, n))
    i, j = edges[:, 0], edges[:, 1]
    np.add.at(lap, (i, j), -w)
    np.add.at(lap, (j, i), -w)
    np.add.at(lap, (i, i), w)
    np.add.at(lap, (j, j), w)
    return lap


def fiedler_value(lap: FloatArray) -> FloatArray:
    """Second-smallest eigenvalue of Laplacian(s) ``lap`` (..., n, n); 0 for n < 2.

    0 exactly when the graph is disconnected; larger means faster gossip.  Stacked
    Laplacians are solved in one batched ``eigvalsh`` call.
    """
    lap = np.asarray(lap, dtype=np.float64)
    if lap.shape[-1] < 2:
        return np.zeros(lap.shape[:-2])
    return np.maximum(np.linalg.eigvalsh(lap)[..., 1], 0.0)


def components(n: int, edges: IntArray) -> IntArray:
    """Connected-component label (0..c-1) of each of ``n`` vertices; union-find, no recursion."""
    parent = np.arange(n)

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = int(parent[x])
        return x

    for a, b in np.asarray(edges, dtype=np.int64).reshape(-1, 2):
        ra, rb = find(int(a)), find(int(b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    roots = np.array([find(v) for v in range(n)], dtype=np.int64)
    return np.unique(roots, return_inverse=True)[1]


def edge_colouring(n: int, edges: IntArray) -> list[IntArray]:
    """Split an undirected simple graph into matchings: Misra-Gries, <= max-degree + 1.

    Returns a list of arrays of edge indices (into ``edges``); every edge is in
    exactly one, and no vertex appears twice in one.  Each matching is one phase in
    which all its links transfer in parallel.

    Raises:
        ValueError: self-loops or repeated edges.
    """
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    if len(edges) == 0:
        return []
    key = np.sort(edges, axis=1)
    if np.any(key[:, 0] == key[:, 1]) or len(np.unique(key, axis=0)) != len(key):
        raise ValueError("edge_colouring needs a simple graph (no loops, no repeated edges)")
    deg = np.bincount(edges.ravel(), minlength=n)
    palette = int(deg.max()) + 1
    # at[v][c] = neighbour joined to v by an edge of colour c
    at: list[dict[int, int]] = [{} for _ in range(n)]
    nbrs: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges.tolist():
        nbrs[a].append(b)
        nbrs[b].append(a)
    for u, v in edges.tolist():
        _colour_edge(at, nbrs, palette, u, v)
    colour = {}
    for u in range(n):
        for c, w in at[u].items():
            colour[(u, w)] = c
    col = np.array([colour[(a, b)] for a, b in edges.tolist()])
    return [np.flatnonzero(col == c) for c in range(palette) if np.any(col == c)]


def _free(at: list[dict[int, int]], palette: int, v: int) -> int:
    return next(c for c in range(palette) if c not in at[v])


def _set(at: list[dict[int, int]], u: int, v: int, c: int) -> None:
    at[u][c] = v
    at[v][c] = u


def _colour_edge(
    at: list[dict[int, int]], nbrs: list[list[int]], palette: int, u: int, v: int
) -> None:
    """One Misra-Gries step: colour (u, v) by a fan rotation after a cd-path flip."""
    fan = [v]
    in_fan = {v}
    colour_to = {w: c for c, w in at[u].items()}
    grown = True
    while grown:  # maximal fan: (u, f) coloured with a colour free on the previous fan vertex
        grown = False
        for w in nbrs[u]:
            c = colour_to.get(w)
            if w not in in_fan and c is not None and c not in at[fan[-1]]:
                fan.append(w)
                in_fan.add(w)
                grown = True
                break
    c = _free(at, palette, u)
    d = _free(at, palette, fan[-1])
    if d in at[u]:  # invert the c/d path that starts at u with colour d
        path, x, want = [], u, d
        while want in at[x]:
            y = at[x][want]
            path.append((x, y, want))
            x, want = y, (c if want == d else d)
        for x, y, col in path:
            del at[x][col]
            del at[y][col]
        for x, y, col in path:
            _set(at, x, y, c if col == d else d)
    # the first fan vertex where d is free ends the prefix we rotate
    k = next(i for i, w in enumerate(fan) if d not in at[w])
    colour_to = {w: c for c, w in at[u].items()}
    for i in range(k):
        nxt = colour_to[fan[i + 1]]  # fan edges past the first are coloured
        del at[u][nxt]
        del at[fan[i + 1]][nxt]
        _set(at, u, fan[i], nxt)
    _set(at, u, fan[k], d)
