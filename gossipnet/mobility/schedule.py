"""Which matchings a round uses, and when: the algebraic-connectivity choice.

A reconstruction of RoADTrain's topology step (ALGORITHMS.md 4.1, steps 3-4; the
paper was not available), close to MATCHA (4.3):

1. The *feasible* graph: pairs that can finish an exchange inside the round's time
   budget, weighted by their best success probability (``r_ij``).
2. Its Misra-Gries edge colouring: matchings whose links transfer in parallel, one
   *phase* each.
3. Phases are added one at a time, maximising the expected connectivity of the
   union per second of radio time, until the budget is spent.  Phases run one after
   another, so each candidate is re-evaluated at the time it would start: a contact
   that will have ended by then no longer counts.  That is where routes pay off.

Disconnected feasible graphs are the rule on a city map (vehicles far apart), and
there lambda2 of anything is 0.  The objective is therefore a sum over the connected
components c of the feasible graph, weighted by size: lambda2 of the chosen union
inside c, plus ``merge_weight`` times the fraction of c that the union has joined
up (0 with no link, 1 once connected).  lambda2 is 0 until a component is joined,
so without the second term the search has nothing to climb: it would not see that
two links, one per phase, join a cluster of three.  Once joined, lambda2 (order
0.1-1) outweighs the term (0.05 by default) and the choice is by connectivity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gossipnet.mobility.radio import LinkTable
from gossipnet.mobility.topology import components, edge_colouring, fiedler_value, laplacian

__all__ = ("Phase", "Schedule", "ScheduleConfig", "feasible_graph", "plan_schedule")

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    """The per-round choice of phases.

    budget_s: seconds of radio time one round may use (phases run back to back).
    min_probability: links predicted to succeed less often are not used at all.
    merge_weight: weight of "joined-up fraction" next to lambda2 (module doc).
    """

    budget_s: float = 20.0
    min_probability: float = 0.05
    merge_weight: float = 0.05

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s!r}")
        if not 0.0 <= self.min_probability < 1.0:
            raise ValueError(f"min_probability must be in [0, 1), got {self.min_probability!r}")
        if not 0.0 <= self.merge_weight < 1.0:
            raise ValueError(f"merge_weight must be in [0, 1), got {self.merge_weight!r}")


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
    """The phases of one round, in order, and what the scheduler expected of them.

    ``score`` is the scheduler's objective (module doc) for these phases.
    """

    n: int
    phases: tuple[Phase, ...]
    feasible_edges: IntArray
    feasible_weights: FloatArray
    matchings: tuple[IntArray, ...]
    score: float = 0.0

    @property
    def total_s(self) -> float:
        """Radio time the round uses: the end of the last phase (0 if none)."""
        return max((p.start_s + p.duration_s for p in self.phases), default=0.0)

    def connectivity(self) -> float:
        """Size-weighted sum over feasible components of lambda2 of the expected union.

        lambda2 of the whole graph when the feasible graph is connected; unlike it,
        not stuck at 0 when vehicles form separate clusters (module doc).
        """
        labels = components(self.n, self.feasible_edges)
        lap = self.expected_laplacian()
        total = 0.0
        for c in range(labels.max() + 1 if self.n else 0):
            idx = np.flatnonzero(labels == c)
            if len(idx) > 1:
                total += len(idx) / self.n * float(fiedler_value(lap[np.ix_(idx, idx)]))
        return total

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


class _Objective:
    """The scheduler's objective (module doc), kept incrementally for one partial schedule.

    Per feasible component c of size n_c: ``(n_c / n) * (lambda2(L_S|c) + mu * merged_c)``
    where ``merged_c = (n_c - clusters of S in c) / (n_c - 1)`` goes from 0 to 1 as the
    chosen links join the component up.  lambda2 is 0 until they do, so it is solved
    (one batched ``eigvalsh`` per component over the candidates that complete it) only
    then: large clusters that one round cannot join cost no eigenvalue at all.
    """

    def __init__(self, n: int, edges: IntArray, mu: float) -> None:
        labels = components(n, edges)
        self.n, self.mu, self.comp = n, mu, labels
        self.blocks = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
        self.local = np.zeros(n, dtype=np.int64)
        for idx in self.blocks:
            self.local[idx] = np.arange(len(idx))
        self.lap = [np.zeros((len(idx), len(idx))) for idx in self.blocks]
        self.lam = np.zeros(len(self.blocks))
        self.parts = np.array([len(idx) for idx in self.blocks], dtype=np.int64)
        self.cluster = np.arange(n)  # S-cluster label of each vertex
        self.total = 0.0  # the objective: kept up to date by add()

    def _total(self) -> float:
        size = np.array([len(b) for b in self.blocks], dtype=np.float64)
        merged = (size - self.parts) / np.maximum(size - 1, 1)
        return float(np.sum(size / self.n * (self.lam + self.mu * merged)))

    def copy(self) -> _Objective:
        """A copy that can be extended independently (arrays are replaced, not mutated)."""
        twin = object.__new__(_Objective)
        twin.n, twin.mu, twin.comp, twin.blocks, twin.local = (
            self.n,
            self.mu,
            self.comp,
            self.blocks,
            self.local,
        )
        twin.lap, twin.lam = list(self.lap), self.lam.copy()
        twin.parts, twin.cluster = self.parts.copy(), self.cluster.copy()
        twin.total = self.total
        return twin

    def _delta_lap(self, comp: int, edges: IntArray, probs: FloatArray) -> FloatArray:
        mine = self.comp[edges[:, 0]] == comp
        return laplacian(len(self.blocks[comp]), self.local[edges[mine]], probs[mine])

    def gains(self, cands: list[tuple[IntArray, FloatArray]]) -> FloatArray:
        """Objective gain of adding each candidate ``(edges, probabilities)``."""
        gain = np.zeros(len(cands))
        solve: dict[int, list[int]] = {}
        for k, (edges, _) in enumerate(cands):
            for comp, joined in _joins(self.cluster, self.comp, edges).items():
                size = len(self.blocks[comp])
                gain[k] += size / self.n * self.mu * joined / max(size - 1, 1)
                if self.parts[comp] - joined == 1:
                    solve.setdefault(comp, []).append(k)
            for comp in set(self.comp[edges[:, 0]].tolist()):
                if self.parts[comp] == 1:  # already joined: lambda2 grows with every link
                    solve.setdefault(comp, []).append(k)
        for comp, ks in solve.items():
            stack = np.stack([self.lap[comp] + self._delta_lap(comp, *cands[k]) for k in ks])
            size = len(self.blocks[comp])
            gain[ks] += size / self.n * (fiedler_value(stack) - self.lam[comp])
        return gain

    def add(self, edges: IntArray, probs: FloatArray) -> None:
        for comp, joined in _joins(self.cluster, self.comp, edges).items():
            self.parts[comp] -= joined
        self.cluster = _relabel(self.cluster, edges)
        for comp in set(self.comp[edges[:, 0]].tolist()):
            self.lap[comp] = self.lap[comp] + self._delta_lap(comp, edges, probs)
            if self.parts[comp] == 1:
                self.lam[comp] = float(fiedler_value(self.lap[comp]))
        self.total = self._total()


def _joins(cluster: IntArray, comp: IntArray, edges: IntArray) -> dict[int, int]:
    """Per feasible component, how many clusters of ``cluster`` the links ``edges`` join."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    out: dict[int, int] = {}
    for (a, b), c in zip(cluster[edges].tolist(), comp[edges[:, 0]].tolist(), strict=True):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
            out[c] = out.get(c, 0) + 1
    return out


def _relabel(cluster: IntArray, edges: IntArray) -> IntArray:
    """Cluster labels after adding ``edges`` (each cluster labelled by its smallest member)."""
    out = cluster.copy()
    for a, b in edges.tolist():
        ra, rb = out[a], out[b]
        if ra != rb:
            out[out == max(ra, rb)] = min(ra, rb)
    return out


#: Phase-length caps tried for each matching, as fractions of the budget: a matching
#: may leave out its slowest links rather than hold every other link's phase open.
_CAPS = (0.125, 0.25, 0.5, 1.0)


def _candidates(
    table: LinkTable, rows: IntArray, matchings: list[IntArray], step: int, config: ScheduleConfig
) -> list[tuple[int, IntArray, FloatArray, float]]:
    """(matching, its edges kept, their probabilities, phase seconds) if started at ``step``."""
    start = step * table.dt_s
    sizes = np.array([len(e) for e in matchings])
    if not sizes.sum():
        return []
    owner = np.repeat(np.arange(len(matchings)), sizes)
    offset = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    at = rows[np.concatenate(matchings)]
    dur, prob = table.duration_s[at, step], table.probability[at, step]
    ok = (prob >= config.min_probability) & (start + dur <= config.budget_s)
    seen = np.zeros(len(matchings), dtype=np.int64)
    out = []
    for cap in _CAPS:  # one candidate per (matching, cap) that adds links
        sel = ok & (dur <= cap * config.budget_s)
        count = np.bincount(owner[sel], minlength=len(matchings))
        for m in np.flatnonzero(count > seen).tolist():
            idx = np.flatnonzero(sel[offset[m] : offset[m] + sizes[m]])
            part = offset[m] + idx
            out.append((m, idx, prob[part], float(dur[part].max())))
        seen = np.maximum(seen, count)
    out.sort(key=lambda c: (c[0], len(c[1])))  # by matching, shortest cap first
    return out


def plan_schedule(
    table: LinkTable,
    config: ScheduleConfig,
    *,
    max_phases: int | None = None,
    rng: np.random.Generator | None = None,
) -> Schedule:
    """Choose this round's phases: the largest expected connectivity within the budget.

    Phases are added one at a time.  Each step tries every matching that is left,
    started when the previous phase ends, whole or without its slowest links (phase
    caps of 1/8 .. 1 of the budget); links a phase left out stay available.  A small
    beam keeps the partial schedules with the best objective and the best objective
    per second (``_BEAM`` of each), so a long first phase cannot crowd out two short
    ones that would have joined a cluster; the best schedule seen wins, ties going
    to the one that ends sooner.

    Args:
        table: exchange durations and probabilities for every pair and start step,
            from predicted (shared-route) positions, or from frozen positions for
            a scheduler that ignores routes.
        config: budget and thresholds.
        max_phases: stop after this many phases (default: when the budget or the
            gains run out).
        rng: pick each phase uniformly among the candidates instead of by gain: the
            "random choice of the same size" baseline, under the same constraints.

    Returns:
        The chosen phases in time order; empty if no link is feasible.  The
        schedule is a pure function of its inputs, so every peer that holds the
        same routes derives the same one without talking.
    """
    n = table.n
    edges, weights = feasible_graph(table, config)
    matchings = tuple(edge_colouring(n, edges))
    limit = len(edges) if max_phases is None else max_phases
    if not matchings or limit < 1:
        return Schedule(n, (), edges, weights, matchings)
    rows = table.pair_index()[edges[:, 0], edges[:, 1]]
    root = _State(_Objective(n, edges, config.merge_weight), [], list(matchings), 0.0)
    if rng is not None:
        best = _random_walk(table, config, edges, rows, root, limit, rng)
    else:
        best = _beam(table, config, edges, rows, root, limit)
    return Schedule(n, tuple(best.phases), edges, weights, matchings, best.objective.total)


#: Partial schedules kept per step, by objective and by objective per second: a
#: plain greedy is myopic (a long first phase can eat the budget that two short
#: ones would have used to join a cluster); a small beam is not, and stays cheap.
_BEAM = 3

Candidate = tuple[int, IntArray, FloatArray, float]


@dataclass(slots=True)
class _State:
    """A partial schedule: objective so far, phases, links left per matching, clock."""

    objective: _Objective
    phases: list[Phase]
    left: list[IntArray]
    clock: float

    def step(self, table: LinkTable) -> int:
        return min(int(np.ceil(self.clock / table.dt_s - 1e-9)), table.starts - 1)

    def extend(self, cand: Candidate, edges: IntArray, start_s: float) -> _State:
        m, keep, prob, dur = cand
        chosen = edges[self.left[m][keep]]
        objective = self.objective.copy()
        objective.add(chosen, prob)
        left = list(self.left)
        left[m] = np.delete(left[m], keep)
        return _State(
            objective, [*self.phases, Phase(chosen, prob, start_s, dur)], left, start_s + dur
        )


def _better(a: _State, b: _State) -> bool:
    """Larger objective wins; on a tie, the schedule that ends sooner."""
    va, vb = a.objective.total, b.objective.total
    return va > vb + 1e-12 or (va >= vb - 1e-12 and a.clock < b.clock)


def _beam(
    table: LinkTable,
    config: ScheduleConfig,
    edges: IntArray,
    rows: IntArray,
    root: _State,
    limit: int,
) -> _State:
    """Beam search over phase sequences; the best schedule seen (any length) wins."""
    states, best = [root], root
    while states:
        children: list[tuple[float, float, _State, Candidate]] = []
        for st in states:
            if len(st.phases) >= limit:
                continue
            start = st.step(table) * table.dt_s
            cands = _candidates(table, rows, st.left, st.step(table), config)
            if not cands:
                continue
            gain = st.objective.gains([(edges[st.left[m][k]], p) for m, k, p, _ in cands])
            secs = np.array([max(c[3], table.dt_s) for c in cands])
            picks = set(np.argsort(-gain, kind="stable")[:_BEAM].tolist())
            picks |= set(np.argsort(-gain / secs, kind="stable")[:_BEAM].tolist())
            children += [
                (st.objective.total + gain[k], start + cands[k][3], st, cands[k])
                for k in sorted(picks)
                if gain[k] > 1e-12
            ]
        if not children:
            break
        by_value = sorted(range(len(children)), key=lambda i: (-children[i][0], children[i][1]))
        by_rate = sorted(range(len(children)), key=lambda i: -children[i][0] / children[i][1])
        states = [
            children[i][2].extend(children[i][3], edges, children[i][2].step(table) * table.dt_s)
            for i in dict.fromkeys(by_value[:_BEAM] + by_rate[:_BEAM])
        ]
        for st in states:
            if _better(st, best):
                best = st
    return best


def _random_walk(
    table: LinkTable,
    config: ScheduleConfig,
    edges: IntArray,
    rows: IntArray,
    root: _State,
    limit: int,
    rng: np.random.Generator,
) -> _State:
    """Phases picked uniformly among the feasible candidates until budget or ``limit``."""
    st = root
    while len(st.phases) < limit:
        cands = _candidates(table, rows, st.left, st.step(table), config)
        if not cands:
            break
        st = st.extend(cands[int(rng.integers(len(cands)))], edges, st.step(table) * table.dt_s)
    return st
