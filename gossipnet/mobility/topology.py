"""Parallel subgraphs and the algebraic-connectivity choice of which to use.

A reconstruction of RoADTrain's topology step (ALGORITHMS.md 4.1, steps 3-4; the
paper was not available), close to MATCHA (4.3):

1. The *feasible* graph: pairs that can finish an exchange inside the round's time
   budget, weighted by their best success probability (``r_ij``).
2. Half-duplex radios talk to one peer at a time, so the graph is edge-coloured
   into matchings (Misra-Gries, at most max-degree + 1 colours); the links of one
   matching transfer in parallel, one *phase* each.
3. Gossip converges at a rate set by the Fiedler value lambda2 of the expected
   Laplacian ``L = sum r_ij (e_i - e_j)(e_i - e_j)^T``.  Matchings are added
   greedily by lambda2 gain per second of phase time until the budget is spent.
   Phases run one after another, so each candidate is re-evaluated at the time it
   would start: a contact that will have ended by then no longer counts.  That is
   where the routes pay off.

Disconnected feasible graphs are the rule on a city map (vehicles far apart), and
there lambda2 of anything is 0.  The objective is therefore the size-weighted sum,
over connected components c of the feasible graph, of
``lambda2(L_S|c + delta * L_feasible|c)``: the small ``delta`` term makes a union
that is still split inside a component score by how close it is to joining up,
instead of a flat 0 that gives the greedy nothing to climb.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .radio import LinkTable

__all__ = (
    "Phase",
    "Schedule",
    "ScheduleConfig",
    "components",
    "edge_colouring",
    "fiedler_value",
    "laplacian",
    "plan_schedule",
)

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


def _colour_of(at: list[dict[int, int]], u: int, v: int) -> int | None:
    return next((c for c, w in at[u].items() if w == v), None)


def _colour_edge(
    at: list[dict[int, int]], nbrs: list[list[int]], palette: int, u: int, v: int
) -> None:
    """One Misra-Gries step: colour (u, v) by a fan rotation after a cd-path flip."""
    fan = [v]
    in_fan = {v}
    grown = True
    while grown:  # maximal fan: (u, f) coloured with a colour free on the previous fan vertex
        grown = False
        for w in nbrs[u]:
            c = _colour_of(at, u, w)
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
    for i in range(k):
        nxt = _colour_of(at, u, fan[i + 1])
        if nxt is None:  # pragma: no cover - a fan edge is always coloured
            raise AssertionError("Misra-Gries invariant broken")
        del at[u][nxt]
        del at[fan[i + 1]][nxt]
        _set(at, u, fan[i], nxt)
    _set(at, u, fan[k], d)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    """The per-round choice of phases.

    budget_s: seconds of radio time one round may use (phases run back to back).
    min_probability: links predicted to succeed less often are not used at all.
    regularisation: ``delta`` of the objective (module doc): a tie-breaker, << 1.
    """

    budget_s: float = 20.0
    min_probability: float = 0.05
    regularisation: float = 1e-3

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s!r}")
        if not 0.0 <= self.min_probability < 1.0:
            raise ValueError(f"min_probability must be in [0, 1), got {self.min_probability!r}")
        if not 0.0 <= self.regularisation < 1.0:
            raise ValueError(f"regularisation must be in [0, 1), got {self.regularisation!r}")


@dataclass(frozen=True, slots=True, eq=False)
class Phase:
    """One matching that transfers in parallel from ``start_s`` for ``duration_s``.

    ``edges`` (k, 2) are vertex pairs (no vertex twice); ``probability`` (k,) the
    predicted success of each link when started at ``start_s``.
    """

    edges: IntArray
    probability: FloatArray
    start_s: float
    duration_s: float


@dataclass(frozen=True, slots=True, eq=False)
class Schedule:
    """The phases of one round, in order, and what the scheduler expected of them."""

    n: int
    phases: tuple[Phase, ...]
    feasible_edges: IntArray
    feasible_weights: FloatArray
    matchings: tuple[IntArray, ...]

    @property
    def total_s(self) -> float:
        """Radio time the round uses: the end of the last phase (0 if none)."""
        return max((p.start_s + p.duration_s for p in self.phases), default=0.0)

    def expected_laplacian(self) -> FloatArray:
        """``sum r_ij L_ij`` over the chosen links (the expected union's Laplacian)."""
        if not self.phases:
            return np.zeros((self.n, self.n))
        edges = np.concatenate([p.edges for p in self.phases])
        probs = np.concatenate([p.probability for p in self.phases])
        return laplacian(self.n, edges, probs)


def feasible_graph(table: LinkTable, config: ScheduleConfig) -> tuple[IntArray, FloatArray]:
    """Pairs that can finish an exchange within the budget, and their best probability."""
    start = table.dt_s * np.arange(table.starts)
    fits = start[None, :] + table.duration_s <= config.budget_s
    prob = np.where(fits, table.probability, 0.0)
    best = prob.max(axis=1, initial=0.0)
    keep = best >= max(config.min_probability, 1e-12)
    return table.pairs[keep], best[keep]


def _objective(
    lap: FloatArray, blocks: list[IntArray], base: FloatArray, n: int, delta: float
) -> FloatArray:
    """Size-weighted sum of per-component regularised lambda2 for stacked ``lap`` (K, n, n)."""
    total = np.zeros(lap.shape[0])
    for idx in blocks:
        sub = lap[:, idx[:, None], idx[None, :]] + delta * base[idx[:, None], idx[None, :]]
        total += (len(idx) / n) * fiedler_value(sub)
    return total


def plan_schedule(table: LinkTable, config: ScheduleConfig) -> Schedule:
    """Choose this round's phases: greedy lambda2 gain per second within the budget.

    Args:
        table: exchange durations and probabilities for every pair and start step,
            from predicted (shared-route) positions, or from frozen positions for
            a scheduler that ignores routes.
        config: budget and thresholds.

    Returns:
        The chosen phases in time order; empty if no link is feasible.  The
        schedule is a pure function of its inputs, so every peer that holds the
        same routes derives the same one without talking.
    """
    n = table.n
    edges, weights = feasible_graph(table, config)
    matchings = tuple(edge_colouring(n, edges))
    phases: list[Phase] = []
    if not matchings:
        return Schedule(n, (), edges, weights, matchings)
    base = laplacian(n, edges, weights)
    labels = components(n, edges)
    blocks = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
    blocks = [b for b in blocks if len(b) > 1]
    row = table.pair_index()[edges[:, 0], edges[:, 1]]
    lap = np.zeros((n, n))
    current = _objective(lap[None], blocks, base, n, config.regularisation)[0]
    left = list(range(len(matchings)))
    clock = 0.0
    while left:
        step = min(int(np.ceil(clock / table.dt_s - 1e-9)), table.starts - 1)
        start = step * table.dt_s
        cands, laps = [], []
        for m in left:
            e = matchings[m]
            dur = table.duration_s[row[e], step]
            prob = table.probability[row[e], step]
            ok = (prob >= config.min_probability) & (start + dur <= config.budget_s)
            if ok.any():
                cands.append((m, e[ok], prob[ok], float(dur[ok].max())))
                laps.append(lap + laplacian(n, edges[e[ok]], prob[ok]))
        if not cands:
            break
        value = _objective(np.stack(laps), blocks, base, n, config.regularisation)
        gain = (value - current) / np.array([max(c[3], table.dt_s) for c in cands])
        best = int(np.argmax(gain))
        if not gain[best] > 1e-12:
            break
        m, e, prob, dur = cands[best]
        phases.append(Phase(edges[e], prob, start, dur))
        lap, current = laps[best], float(value[best])
        clock = start + dur
        left.remove(m)
    return Schedule(n, tuple(phases), edges, weights, matchings)
