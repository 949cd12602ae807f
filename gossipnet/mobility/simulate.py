"""Vehicles that drive around a grid city and train one model by gossip over radio.

The simulator compares topology choices on *the same* city, routes, data, radio and
loss model (ALGORITHMS.md section 4; RoADTrain's CARLA setup was not available, so
this is a reconstruction).  Every round each vehicle trains locally for
``compute_s`` simulated seconds while it keeps driving, then the fleet communicates
under one of these strategies:

``route``        shared routes predict distances over the round; the schedule module
                 picks the phases (matchings) with the largest expected algebraic
                 connectivity within the budget, each started when its links will
                 still be in contact (RoADTrain, reconstructed).
``loss_aware``   the same choice from *current* distances held fixed: it knows each
                 link's reliability now but not where the vehicles are going.
``all_in_range`` every pair in range now exchanges, one matching after another
                 (Metropolis gossip with all neighbours), however long that takes.
``random``       one random perfect matching over the whole fleet (random gossip).
``sgp``          Stochastic Gradient Push: push-sum to ``i + 2^e mod n`` (SGP's
                 directed exponential graph), one out-peer per round; the local step
                 is taken on z = x / w, as in the authors' code.

Exchanges succeed or fail by the radio model on the vehicles' *actual* trajectories,
which differ from the shared routes by traffic noise.  Symmetric strategies skip a
failed exchange at both ends (mean kept); SGP keeps an undelivered share at the
sender (push-sum mass kept).  A planned phase ends on schedule; an unplanned
transfer ends when it finishes or at ``timeout_s``.  Time is simulated seconds.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from gossipnet.mobility._learning import Mlp, make_dataset
from gossipnet.mobility.mixing import consensus_error, mix_matching, push_sum_step, sgp_out_peers
from gossipnet.mobility.radio import RadioModel, link_table, static_positions
from gossipnet.mobility.routes import CityGrid, Itinerary, TrafficConfig, positions
from gossipnet.mobility.schedule import ScheduleConfig, plan_schedule
from gossipnet.mobility.topology import edge_colouring

__all__ = ("STRATEGIES", "Fleet", "SimConfig", "Trace", "simulate")

STRATEGIES = ("route", "loss_aware", "all_in_range", "random", "sgp")

FloatArray = np.ndarray
IntArray = np.ndarray

#: Routes are generated this many seconds at a time, as the simulated clock needs them.
_CHUNK_S = 600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """One simulated fleet.  Units are in the names.

    ``model_bytes`` is what one model costs on the air: a stand-in for a realistic
    on-board model (4 MB ~ 1M fp32 parameters) while the MLP that is really trained
    stays small so that a run takes seconds.
    """

    vehicles: int = 16
    city: CityGrid = field(default_factory=lambda: CityGrid(blocks_x=4, blocks_y=4))
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    radio: RadioModel = field(default_factory=RadioModel)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    model_bytes: float = 4.0e6
    timeout_s: float = 20.0
    phase_slack: float = 0.1
    compute_s: float = 2.0
    rounds: int = 120
    local_steps: int = 2
    lr: float = 0.1
    batch: int = 32
    hidden: int = 32
    data_noise: float = 1.5
    classes_per_vehicle: int = 2
    dt_s: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vehicles < 2:
            raise ValueError(f"need >= 2 vehicles, got {self.vehicles}")
        for name in ("model_bytes", "timeout_s", "compute_s", "lr", "dt_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if min(self.rounds, self.local_steps, self.batch, self.hidden) < 1:
            raise ValueError("rounds, local_steps, batch and hidden must be >= 1")
        if self.phase_slack < 0:
            raise ValueError("phase_slack must be >= 0")


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """Per-round history of one run: clock, test accuracy/loss (mean over vehicles), spread."""

    strategy: str
    time_s: FloatArray
    accuracy: FloatArray
    loss: FloatArray
    consensus: FloatArray
    tried: IntArray
    delivered: IntArray

    def rounds_to(self, accuracy: float) -> float:
        """First round (1-based) whose mean accuracy reaches ``accuracy``; inf if none."""
        hit = np.flatnonzero(self.accuracy >= accuracy)
        return float(hit[0] + 1) if hit.size else math.inf

    def seconds_to(self, accuracy: float) -> float:
        """Simulated seconds until the mean accuracy reaches ``accuracy``; inf if never."""
        hit = np.flatnonzero(self.accuracy >= accuracy)
        return float(self.time_s[hit[0]]) if hit.size else math.inf

    def rounds_to_consensus(self, error: float) -> float:
        """First round whose consensus error is <= ``error``; inf if none."""
        hit = np.flatnonzero(self.consensus <= error)
        return float(hit[0] + 1) if hit.size else math.inf

    def seconds_to_consensus(self, error: float) -> float:
        """Simulated seconds until the consensus error is <= ``error``; inf if never."""
        hit = np.flatnonzero(self.consensus <= error)
        return float(self.time_s[hit[0]]) if hit.size else math.inf


class Fleet:
    """The shared world of one seed: itineraries, data, initial model.

    Every strategy runs on the same fleet, so differences come from the strategy only.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        # one generator per vehicle: extending one route never changes another's
        self._rngs = [np.random.default_rng([config.seed, 1, v]) for v in range(config.vehicles)]
        self.itineraries = [
            Itinerary.random(config.city, config.traffic, rng, duration_s=_CHUNK_S)
            for rng in self._rngs
        ]
        self.data = make_dataset(
            config.vehicles,
            classes_per_vehicle=config.classes_per_vehicle,
            noise=config.data_noise,
            seed=config.seed,
        )
        self.model = Mlp(self.data.dim, config.hidden, self.data.classes)
        theta = self.model.init(np.random.default_rng([config.seed, 2]))
        self.theta0 = np.repeat(theta[None], config.vehicles, axis=0)

    def _cover(self, until_s: float) -> None:
        """Extend every route (lazily, in fixed chunks) so it covers ``until_s``."""
        cfg = self.config
        for v, it in enumerate(self.itineraries):
            while it.actual.times_s[-1] < until_s:
                it = it.extended(cfg.city, cfg.traffic, self._rngs[v], _CHUNK_S)
            self.itineraries[v] = it

    def actual_positions(self, t: FloatArray, who: IntArray | None = None) -> FloatArray:
        self._cover(float(np.max(t)))
        idx = range(self.config.vehicles) if who is None else who
        return positions([self.itineraries[i].actual for i in idx], t)

    def predicted_positions(self, t0_s: float, t: FloatArray) -> FloatArray:
        self._cover(float(np.max(t)))
        horizon = float(np.max(t)) - t0_s
        return positions([it.shared_route(t0_s, horizon) for it in self.itineraries], t)

    def run_transfers(
        self,
        pairs: IntArray,
        start_s: float,
        deadline_s: float,
        nbytes: float,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, FloatArray]:
        """Actual outcome of transfers started together: (delivered, seconds each used)."""
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if len(pairs) == 0:
            return np.zeros(0, bool), np.zeros(0)
        dt = self.config.dt_s
        t = start_s + dt * np.arange(math.ceil(deadline_s / dt) + 2)
        who, local = np.unique(pairs, return_inverse=True)
        pos = self.actual_positions(t, who)
        table = link_table(pos, self.config.radio, nbytes, dt, starts=1, pairs=local.reshape(-1, 2))
        dur, prob = table.duration_s[:, 0], table.probability[:, 0]
        ok = (dur <= deadline_s) & (rng.random(len(pairs)) < prob)
        return ok, np.minimum(dur, deadline_s)


def _half_duplex_phases(n: int, links: IntArray) -> list[IntArray]:
    """Directed links split into phases in which no vehicle sends and receives at once.

    ``i -> j`` and ``j -> i`` (SGP's hop n/2) are one undirected edge twice: the
    reverse copies get phases of their own.
    """
    key = np.sort(links, axis=1)
    _, first = np.unique(key, axis=0, return_index=True)
    rest = np.setdiff1d(np.arange(len(links)), first)
    phases = []
    for part in (np.sort(first), rest):
        phases += [part[m] for m in edge_colouring(n, links[part])]
    return phases


def _planned(
    fleet: Fleet, use_routes: bool, x: FloatArray, t0: float, rng: np.random.Generator
) -> tuple[FloatArray, float, int, int]:
    """A scheduled period: plan phases from predicted (or frozen) positions, then run them.

    Each phase gets its planned length plus ``phase_slack``; a transfer not done by
    then fails.  Returns new x, seconds used, exchanges tried and delivered.
    """
    cfg = fleet.config
    swap = 2.0 * cfg.model_bytes
    steps = math.ceil(cfg.schedule.budget_s / cfg.dt_s) + 1
    grid = t0 + cfg.dt_s * np.arange(steps)
    if use_routes:
        pos = fleet.predicted_positions(t0, grid)
    else:  # where everyone is now, assumed to stay there
        pos = static_positions(fleet.actual_positions(grid[:1]), steps)
    sched = plan_schedule(link_table(pos, cfg.radio, swap, cfg.dt_s), cfg.schedule)
    used, tried, got = 0.0, 0, 0
    for ph in sched.phases:
        slot = ph.duration_s * (1.0 + cfg.phase_slack)
        ok, _ = fleet.run_transfers(ph.edges, t0 + used, slot, swap, rng)
        x = mix_matching(x, ph.edges, ok)
        used, tried, got = used + slot, tried + len(ok), got + int(ok.sum())
    return x, used, tried, got


def _communicate(
    fleet: Fleet,
    strategy: str,
    x: FloatArray,
    w: FloatArray,
    t0: float,
    rnd: int,
    rng: np.random.Generator,
) -> tuple[FloatArray, FloatArray, float, int, int]:
    """One communication period; returns new (x, w), seconds used, exchanges tried/delivered."""
    cfg = fleet.config
    n = cfg.vehicles
    if strategy in ("route", "loss_aware"):
        x, used, tried, got = _planned(fleet, strategy == "route", x, t0, rng)
        return x, w, used, tried, got
    if strategy == "sgp":
        links = sgp_out_peers(n, rnd)
        used, ok_all = 0.0, np.zeros(len(links), bool)
        for m in _half_duplex_phases(n, links):
            ok, took = fleet.run_transfers(links[m], t0 + used, cfg.timeout_s, cfg.model_bytes, rng)
            ok_all[m] = ok
            used += float(took.max())
        x, w = push_sum_step(x, w, links, ok_all)
        return x, w, used, len(links), int(ok_all.sum())
    if strategy == "random":
        perm = rng.permutation(n)
        phases = [perm[: n - n % 2].reshape(-1, 2)]
    elif strategy == "all_in_range":
        pos = fleet.actual_positions(np.array([t0]))[:, 0]
        iu, ju = np.triu_indices(n, k=1)
        near = np.linalg.norm(pos[iu] - pos[ju], axis=1) <= cfg.radio.range_m
        edges = np.stack([iu[near], ju[near]], axis=1)
        phases = [edges[m] for m in edge_colouring(n, edges)]
    else:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    used, tried, got = 0.0, 0, 0
    for edges in phases:  # no plan: each phase lasts until its transfers end or time out
        ok, took = fleet.run_transfers(edges, t0 + used, cfg.timeout_s, 2.0 * cfg.model_bytes, rng)
        x = mix_matching(x, edges, ok)
        used += float(took.max())
        tried, got = tried + len(ok), got + int(ok.sum())
    return x, w, used, tried, got


def simulate(
    config: SimConfig, strategy: str, fleet: Fleet | None = None, *, train: bool = True
) -> Trace:
    """Train the fleet's model by decentralised SGD under ``strategy``; return the trace.

    With ``train=False`` nobody trains: each vehicle starts from its own random vector
    and the run measures only how fast gossip averages (consensus error; accuracy
    and loss are NaN).  The clock still counts ``compute_s`` per round, so both
    modes time rounds alike.  Deterministic: same config, strategy, seed, same trace.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    fleet = fleet or Fleet(config)
    data, model, n = fleet.data, fleet.model, config.vehicles
    comm_rng = np.random.default_rng([config.seed, 3, zlib.crc32(strategy.encode())])
    batch_rng = np.random.default_rng([config.seed, 4])
    x, w = fleet.theta0.copy(), np.ones(n)
    if not train:
        x = np.random.default_rng([config.seed, 5]).standard_normal((n, 8))
    train_x, train_y = np.stack(data.train_x), np.stack(data.train_y)
    rows = np.arange(n)[:, None]
    t = 0.0
    out: dict[str, list[float]] = {k: [] for k in ("t", "acc", "loss", "cons", "tried", "got")}
    for rnd in range(config.rounds):
        # SGP steps the de-biased z = x / w and turns it back into a numerator, as the
        # authors' code does (unbias -> step -> ps_numerator); w == 1 for the others.
        z = x / w[:, None]
        for _ in range(config.local_steps if train else 0):
            idx = batch_rng.integers(train_y.shape[1], size=(n, config.batch))
            _, grad = model.loss_grad(z, train_x[rows, idx], train_y[rows, idx])
            z = z - config.lr * grad
        x = z * w[:, None]
        t += config.compute_s
        x, w, used, tried, got = _communicate(fleet, strategy, x, w, t, rnd, comm_rng)
        t += used
        z = x / w[:, None]
        acc, loss = model.evaluate(z, data.test_x, data.test_y) if train else (np.nan, np.nan)
        row = (t, np.mean(acc), np.mean(loss), consensus_error(z), tried, got)
        for key, val in zip(out, row, strict=True):
            out[key].append(float(val))
    return Trace(
        strategy=strategy,
        time_s=np.array(out["t"]),
        accuracy=np.array(out["acc"]),
        loss=np.array(out["loss"]),
        consensus=np.array(out["cons"]),
        tried=np.array(out["tried"], dtype=np.int64),
        delivered=np.array(out["got"], dtype=np.int64),
    )
