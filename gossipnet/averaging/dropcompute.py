"""DropCompute: the cut-off rule, its automatic threshold, and the analytical model.

Giladi et al., *DropCompute* (NeurIPS 2023, arXiv 2306.10598): synchronous
training waits for the slowest worker, so each worker accumulates
micro-batch gradients only until a compute-time threshold ``tau`` and then
contributes what it has.  This module is the arithmetic, with no clock,
thread or network: the step loop (:mod:`gossipnet._microbatch`) asks it when
to cut and how to weight, and the benchmarks call the same functions.

Two cut semantics appear below (``interruptible``):

- ``False`` (gossipnet): the check runs *between* micro-batches, so a
  micro-batch started at elapsed <= tau finishes and counts.  Worker
  compute = the first finish time past tau (or the last one).
- ``True`` (the authors' accounting in ``get_best_threshold``): only
  micro-batches that finish by tau count and the worker stops at the last
  such finish.  Their device sync plus clipped injected sleep approximate it.

Normalisation (ALGORITHMS.md 3.2): ``"completed"`` contributes the mean
gradient over the micro-batches done, weighted by their count, so the
all-reduce yields sum / (micro-batches done everywhere), unbiased.
``"full"`` is the authors' code: sum / K with weight 1, i.e. sum / (N * K),
so dropped work counts as zero gradient and shrinks the step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal, Protocol, runtime_checkable

import numpy as np

__all__ = (
    "AutoTau",
    "AutoTauConfig",
    "FixedTau",
    "Normalise",
    "TauPolicy",
    "ThresholdChoice",
    "best_threshold",
    "contribution",
    "expected_completed",
    "model_speedup",
    "model_step_time",
    "should_cut",
    "simulate_cut",
    "threshold_grid",
    "threshold_scores",
)

Normalise = Literal["completed", "full"]
_TIE = 1e-9  # scores closer than this are ties, resolved towards the larger tau (less drop)


# --------------------------------------------------------------------------- cut and weight
def should_cut(elapsed_s: float, tau_s: float | None) -> bool:
    """True when the step's compute time has passed the threshold.

    Strictly greater, as in the authors' ``check_drop_compute_throw``: a check at
    exactly ``tau`` still runs the micro-batch.  ``None`` means no cut-off.
    """
    return tau_s is not None and elapsed_s > tau_s


def contribution(
    completed: int, max_microbatches: int, normalise: Normalise
) -> tuple[float, float]:
    """(gradient scale, all-reduce weight) for a peer that completed ``completed`` of K.

    The accumulated gradient is the *sum* of per-micro-batch mean-loss gradients.

    - ``"completed"``: scale 1/completed, weight completed: the all-reduce
      (sum_n w_n x_n / sum_n w_n) gives sum of all gradients / total completed.
      A peer with none contributes weight 0 (scale 0, never 1/0).
    - ``"full"``: scale 1/K, weight 1: the all-reduce gives sum / (N * K).

    Raises:
        ValueError: bad counts or an unknown ``normalise``.
    """
    if max_microbatches < 1 or not 0 <= completed <= max_microbatches:
        raise ValueError(f"need 0 <= completed={completed} <= max_microbatches={max_microbatches}")
    if normalise == "completed":
        return (1.0 / completed if completed else 0.0), float(completed)
    if normalise == "full":
        return 1.0 / max_microbatches, 1.0
    raise ValueError(f"normalise must be 'completed' or 'full', got {normalise!r}")


def simulate_cut(
    times: np.ndarray, tau_s: float | None, *, interruptible: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(completed count, compute seconds) of each row of micro-batch times under ``tau``.

    Vectorised twin of the step loop, for models and benchmarks.

    Args:
        times: ``[..., M]`` seconds per micro-batch (>= 0).
        tau_s: threshold; ``None`` runs all M.
        interruptible: see the module docstring.
    """
    acc = np.cumsum(times, axis=-1)
    m = times.shape[-1]
    if tau_s is None:
        return np.full(acc.shape[:-1], m), acc[..., -1]
    if interruptible:
        done = (acc <= tau_s).sum(axis=-1)
    else:
        done = 1 + (acc[..., :-1] <= tau_s).sum(axis=-1)
    idx = np.clip(done - 1, 0, m - 1)[..., None]
    spent = np.where(done > 0, np.take_along_axis(acc, idx, axis=-1)[..., 0], 0.0)
    return done, spent


# --------------------------------------------------------------------------- automatic tau
@dataclass(frozen=True, slots=True)
class ThresholdChoice:
    """Outcome of :func:`best_threshold` (all means over steps).

    Attributes:
        tau_s: the chosen threshold in seconds.
        score: effective speed-up (1 - drop) / (1 - time saved) - 1 at ``tau_s``.
        drop_rate: share of (worker, micro-batch) pairs dropped.
        compute_speedup: time saved / uncut step time.
        grid_lo_s / grid_hi_s: the searched range.
    """

    tau_s: float
    score: float
    drop_rate: float
    compute_speedup: float
    grid_lo_s: float
    grid_hi_s: float


def threshold_grid(
    times: np.ndarray, *, points: int = 200, min_microbatches: int = 5
) -> np.ndarray:
    """``points`` thresholds from the earliest finish of micro-batch ``min_microbatches + 1``
    (the authors never cut before 5 accumulations) to the latest step finish.

    Args:
        times: ``[W, S, M]`` seconds per micro-batch.
    """
    acc = np.cumsum(times, axis=-1)
    first = min(min_microbatches, times.shape[-1] - 1)
    lo, hi = float(acc[..., first:].min()), float(acc.max())
    return np.linspace(lo, hi, points) if hi > lo else np.array([hi])


def threshold_scores(
    times: np.ndarray,
    taus: np.ndarray,
    *,
    overhead_s: float = 0.0,
    interruptible: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(score, drop rate, compute speed-up) per threshold: ``get_best_threshold``'s table.

    Per step s and threshold tau:
    ``gain = max_w total - max_w compute(tau)``, ``speed = gain / (max_w total + overhead)``,
    ``drop = dropped micro-batches / (W * M)``, ``score = mean_s (1 - drop)/(1 - speed) - 1``.

    Cost O(W S M log T + S T), not O(W S M T): each finish time is placed in the
    grid once (``searchsorted``); per step, counts are cumulated and the slowest
    worker's compute is a running maximum along the grid (a worker's compute only
    grows with tau, so the largest value started so far is the current maximum).

    Args:
        times: ``[W, S, M]`` seconds per micro-batch, every entry observed (no NaN).
        taus: thresholds in seconds (any order).
        overhead_s: per-step time outside compute (all-reduce, optimizer); the
            authors' ``raw_train_time / steps - mean(compute)``.
        interruptible: see the module docstring.
    """
    if times.ndim != 3 or not np.isfinite(times).all():
        raise ValueError("times must be a finite [workers, steps, microbatches] array")
    w, s, m = times.shape
    order = np.argsort(taus)
    ts = np.asarray(taus, dtype=np.float64)[order]
    t = len(ts)
    acc = np.cumsum(times, axis=-1)
    compute = acc[..., -1].max(axis=0)  # [S] the synchronous step waits for the slowest
    raw = compute + max(0.0, overhead_s)
    # a finish at or before tau lets one more micro-batch count (the next one to start,
    # or, interruptibly, this one), from the first grid threshold >= it onwards
    edges = acc if interruptible else acc[..., :-1]
    first = np.searchsorted(ts, edges, side="left")  # [W, S, E] in 0..T
    row = np.arange(s)[None, :, None] * (t + 1)
    counted = np.bincount((row + first).ravel(), minlength=s * (t + 1)).reshape(s, t + 1)
    done_sum = np.cumsum(counted, axis=1)[:, :t] + (0 if interruptible else w)
    # compute time of a worker from a grid point on: the finish of its last counted one
    starts = (row + first).ravel()
    values = (acc if interruptible else acc[..., 1:]).ravel()
    if not interruptible:  # the first micro-batch always runs
        starts = np.concatenate([starts, (row[..., 0] + np.zeros((w, 1), dtype=np.int64)).ravel()])
        values = np.concatenate([values, acc[..., 0].ravel()])
    spent = np.zeros(s * (t + 1))
    np.maximum.at(spent, starts, values)
    spent_max = np.maximum.accumulate(spent.reshape(s, t + 1), axis=1)[:, :t]
    speed = np.minimum((compute[:, None] - spent_max) / np.maximum(raw, 1e-300)[:, None], 1 - 1e-12)
    drop = 1.0 - done_sum / (w * m)  # [S, T]
    score = ((1 - drop) / (1 - speed) - 1).mean(axis=0)
    out = np.empty((3, t))
    out[:, order] = score, drop.mean(axis=0), speed.mean(axis=0)
    return out[0], out[1], out[2]


def best_threshold(
    times: np.ndarray,
    *,
    overhead_s: float = 0.0,
    points: int = 200,
    min_microbatches: int = 5,
    interruptible: bool = False,
    max_drop_rate: float | None = None,
    tolerance: float = 0.0,
) -> ThresholdChoice:
    """The authors' ``get_best_threshold``: the grid threshold with the best score.

    Ties (within 1e-9) go to the larger threshold, i.e. less dropped work; so
    constant timings, where no cut gains anything, give the grid's maximum.

    Args:
        times: ``[W, S, M]`` seconds per micro-batch of W workers over S steps.
        overhead_s / interruptible: as :func:`threshold_scores`.
        points / min_microbatches: as :func:`threshold_grid`.
        max_drop_rate: only thresholds dropping at most this share compete (None:
            any, as the authors).  Why: the score counts dropped samples as lost
            throughput only, while a large drop also adds gradient noise.
        tolerance: keep the largest threshold scoring within this of the best.  Why:
            the score is flat and noisy near its top, so a small tolerance buys a
            steadier tau and less dropped work for a negligible expected loss.
    """
    taus = threshold_grid(times, points=points, min_microbatches=min_microbatches)
    score, drop, speed = threshold_scores(
        times, taus, overhead_s=overhead_s, interruptible=interruptible
    )
    if max_drop_rate is not None:
        score = np.where(drop <= max_drop_rate, score, -np.inf)
        score[-1] = max(score[-1], -1.0)  # the largest threshold always competes
    best = float(score.max())
    i = int(np.flatnonzero(score >= best - max(tolerance, _TIE))[-1])
    return ThresholdChoice(
        float(taus[i]),
        float(score[i]),
        float(drop[i]),
        float(speed[i]),
        float(taus[0]),
        float(taus[-1]),
    )


@runtime_checkable
class TauPolicy(Protocol):
    """Decides each step's threshold; the step loop calls ``begin`` then ``observe``."""

    def begin(self, now_s: float) -> float | None:
        """A step starts at ``now_s`` (clock seconds); return its tau (None = no cut)."""
        ...

    def observe(self, times_s: Sequence[float], max_microbatches: int) -> None:
        """The step's completed micro-batch times (seconds, in order)."""
        ...


@dataclass(frozen=True, slots=True)
class FixedTau:
    """A fixed threshold in seconds (``tau_s=None``: never cut)."""

    tau_s: float | None

    def __post_init__(self) -> None:
        if self.tau_s is not None and not (self.tau_s >= 0 and math.isfinite(self.tau_s)):
            raise ValueError(f"tau must be a finite number of seconds >= 0, got {self.tau_s!r}")

    def begin(self, now_s: float) -> float | None:
        return self.tau_s

    def observe(self, times_s: Sequence[float], max_microbatches: int) -> None:
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoTauConfig:
    """Schedule and search of :class:`AutoTau` (defaults: the authors' run, plus drift).

    Attributes:
        warmup_steps: first steps neither timed nor cut (authors: 5).
        window_steps: timed uncut steps before the first estimate (authors: 45).
        history_steps: most recent steps every later estimate uses.
        reestimate_every_steps: steps between estimates (0 = once, as the authors).
        shift_ratio: when the median micro-batch time of the last
            ``reestimate_every_steps`` steps differs from the older history's by more
            than this factor, the older history is dropped, so tau follows the shift.
        grid_points / min_microbatches / interruptible / max_drop_rate / tolerance: as
            :func:`best_threshold` (``max_drop_rate=None, tolerance=0`` is the authors'
            rule; the default tolerance trades <= 0.01 of score for a steadier tau).
        bootstrap_workers_cap / bootstrap_steps: size of the simulated fleet when
            only this peer's timings exist.
        seed: imputation / bootstrap seed (peers holding the same timings agree).
    """

    warmup_steps: int = 5
    window_steps: int = 45
    history_steps: int = 200
    reestimate_every_steps: int = 25
    shift_ratio: float = 1.3
    grid_points: int = 200
    min_microbatches: int = 5
    interruptible: bool = False
    max_drop_rate: float | None = None
    tolerance: float = 0.01
    bootstrap_workers_cap: int = 512
    bootstrap_steps: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.window_steps < 2 or self.reestimate_every_steps < 0:
            raise ValueError("need warmup_steps >= 0, window_steps >= 2, reestimate_every >= 0")
        if self.history_steps < self.window_steps or not self.shift_ratio > 1:
            raise ValueError("need history_steps >= window_steps and shift_ratio > 1")
        if self.grid_points < 2 or self.min_microbatches < 0 or self.bootstrap_steps < 1:
            raise ValueError("need grid_points >= 2, min_microbatches >= 0, bootstrap_steps >= 1")


#: ``gather(own_rows) -> every peer's rows`` (own included); rows are ``[S, M]`` seconds,
#: NaN where a micro-batch did not run.  Must be called in lockstep by all peers.
Gather = Callable[[np.ndarray], list[np.ndarray]]


class AutoTau:
    """The authors' automatic tau, re-estimated as the timings drift.

    Steps ``warmup .. warmup + window`` run uncut and are timed; then tau =
    :func:`best_threshold` over every peer's timings, re-estimated every
    ``reestimate_every_steps`` over up to ``history_steps`` steps, and over the
    recent ones only once their median moved by ``shift_ratio``.

    Why re-estimation needs care: once cutting, dropped micro-batches are never
    timed.  Each timed one is still an unbiased draw (whether it runs depends only
    on earlier ones), so missing entries are imputed from the same worker's timed
    ones before scoring.  The overhead (time outside compute) is the measured
    step wall time minus the compute that actually ran.

    Timings of all peers come from ``gather`` (the peer wires a lossy all-gather
    in), so every peer computes the same tau, as the authors' all-reduce does.
    Without it, the other peers are modelled as ``world_size()`` bootstrap copies of
    this one: right for identically distributed peers, blind to a straggler.
    """

    def __init__(
        self,
        config: AutoTauConfig | None = None,
        *,
        gather: Gather | None = None,
        world_size: Callable[[], int] | int = 1,
    ) -> None:
        self.config = config or AutoTauConfig()
        self.gather = gather
        self.world_size = world_size
        self.tau_s: float | None = None
        self.step = 0  # steps observed
        self.choices: list[tuple[int, ThresholdChoice]] = []
        self._rows: deque[np.ndarray] = deque(maxlen=self.config.history_steps)
        self._walls: deque[float] = deque(maxlen=self.config.history_steps)
        self._last_start: float | None = None
        self._m = 0

    @property
    def last_choice(self) -> ThresholdChoice | None:
        return self.choices[-1][1] if self.choices else None

    @property
    def rows(self) -> np.ndarray:
        """The timed history, ``[S, M]`` seconds, NaN where a micro-batch did not run."""
        return np.stack(self._rows) if self._rows else np.empty((0, self._m))

    def begin(self, now_s: float) -> float | None:
        if self._last_start is not None and self.step > self.config.warmup_steps:
            self._walls.append(now_s - self._last_start)
        self._last_start = now_s
        return self.tau_s

    def observe(self, times_s: Sequence[float], max_microbatches: int) -> None:
        self.record(times_s, max_microbatches)
        self.maybe_estimate()

    def record(self, times_s: Sequence[float], max_microbatches: int) -> None:
        """Keep one step's timings (first half of :meth:`observe`)."""
        self.step += 1
        if self.step <= self.config.warmup_steps:
            return
        if max_microbatches != self._m:  # K changed: old rows no longer align
            self._rows.clear()
            self._m = max_microbatches
        row = np.full(max_microbatches, np.nan)
        row[: len(times_s)] = np.asarray(times_s, dtype=np.float64)[:max_microbatches]
        self._rows.append(row)

    def maybe_estimate(self) -> None:
        """Estimate tau if the schedule says so (second half of :meth:`observe`).

        Split from :meth:`record` so a simulation can record every worker's step
        before any of them gathers, as a real lockstep all-gather sees it.
        """
        cfg = self.config
        since = self.step - cfg.warmup_steps - cfg.window_steps
        every = cfg.reestimate_every_steps
        if since == 0 or (since > 0 and every and not since % every):
            self._estimate()

    def _estimate(self) -> None:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, self.step])
        own = self.rows
        if self.gather is not None:
            times = _align([r for r in self.gather(own) if r.shape[-1] == own.shape[-1]] or [own])
        else:
            times = own[None]
        recent = cfg.reestimate_every_steps or cfg.window_steps
        if _shifted(times, recent, cfg.shift_ratio):
            times = times[:, -recent:]
            for q in (self._rows, self._walls):
                for _ in range(max(0, len(q) - recent)):
                    q.popleft()
        if self.gather is None:
            n = self.world_size() if callable(self.world_size) else self.world_size
            workers = min(max(1, n), cfg.bootstrap_workers_cap)
            times = times[0][rng.integers(0, times.shape[1], size=(workers, cfg.bootstrap_steps))]
        ran = np.nan_to_num(times, nan=0.0).sum(axis=-1).max(axis=0)  # what the fleet computed
        walls = float(np.mean(self._walls)) if self._walls else 0.0
        full = _impute(times, rng)
        if full is None:
            return
        choice = best_threshold(
            full,
            overhead_s=max(0.0, walls - float(ran.mean())),
            points=cfg.grid_points,
            min_microbatches=cfg.min_microbatches,
            interruptible=cfg.interruptible,
            max_drop_rate=cfg.max_drop_rate,
            tolerance=cfg.tolerance,
        )
        self.tau_s = choice.tau_s
        self.choices.append((self.step, choice))


def _align(rows: list[np.ndarray]) -> np.ndarray:
    """Stack per-worker ``[S_w, M]`` rows on their last common steps: ``[W, S, M]``."""
    s = min(len(r) for r in rows)
    return np.stack([r[len(r) - s :] for r in rows])


def _shifted(times: np.ndarray, recent: int, ratio: float) -> bool:
    """Whether the last ``recent`` steps' median micro-batch time moved by ``ratio``."""
    if times.shape[1] <= recent:
        return False
    new, old = times[:, -recent:], times[:, :-recent]
    if not (np.isfinite(new).any() and np.isfinite(old).any()):
        return False
    a, b = float(np.nanmedian(new)), float(np.nanmedian(old))
    return a > 0 and b > 0 and max(a / b, b / a) > ratio


def _impute(times: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """Fill untimed (NaN) micro-batches from the same worker's timed ones (else anyone's).

    None if nothing at all was timed.
    """
    out = times.copy()
    everyone = times[np.isfinite(times)]
    if everyone.size == 0:
        return None
    for w in range(out.shape[0]):
        miss = ~np.isfinite(out[w])
        if miss.any():
            pool = times[w][np.isfinite(times[w])]
            out[w][miss] = rng.choice(pool if pool.size else everyone, size=int(miss.sum()))
    return out


# --------------------------------------------------------------------------- analytical model
def _max_z(n: int, order: Literal["gumbel", "blom"]) -> float:
    """E[max of n standard normals]: sqrt(2 ln n) (3.4's asymptote) or Blom's approximation."""
    if n <= 1:
        return 0.0
    if order == "gumbel":
        return math.sqrt(2 * math.log(n))
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def model_step_time(
    mu_s: float, sigma_s: float, m: int, n: int, *, order: Literal["gumbel", "blom"] = "gumbel"
) -> float:
    """ALGORITHMS.md 3.4: expected synchronous compute time, M mu + sigma sqrt(M) z_N.

    A worker's step is ~ Normal(M mu, M sigma^2) (i.i.d. micro-batches); the step
    waits for the maximum of N.  ``gumbel`` uses z_N = sqrt(2 ln N), which overshoots
    for small N; ``blom`` is accurate to ~1% for N >= 2.
    """
    return m * mu_s + sigma_s * math.sqrt(m) * _max_z(n, order)


def expected_completed(
    tau_s: float, mu_s: float, sigma_s: float, m: int, *, interruptible: bool = True
) -> float:
    """E[micro-batches done] = sum_m P(t_1 + ... + t_m <= tau) under the normal model.

    With ``interruptible=False`` micro-batch m runs if the first m - 1 finished by
    tau, so the count is 1 + sum_{m < M} P(S_m <= tau).
    """
    phi = NormalDist().cdf
    probs = [
        phi((tau_s - k * mu_s) / (sigma_s * math.sqrt(k)))
        if sigma_s > 0
        else float(k * mu_s <= tau_s)
        for k in range(1, m + 1)
    ]
    return sum(probs) if interruptible else 1 + sum(probs[:-1])


def model_speedup(
    tau_s: float,
    mu_s: float,
    sigma_s: float,
    m: int,
    n: int,
    *,
    overhead_s: float = 0.0,
    overshoot_s: float = 0.0,
    interruptible: bool = True,
    order: Literal["gumbel", "blom"] = "gumbel",
) -> float:
    """3.4's effective speed-up S_eff(tau) = (E[M~]/M) (E[T] + T_c)/(tau' + T_c) - 1.

    ``tau' = min(E[T], tau + overshoot_s)``: the cut step lasts tau (interruptible) or
    tau plus the micro-batch still running (gossipnet's check; pass about one mean
    micro-batch time).
    """
    sync = model_step_time(mu_s, sigma_s, m, n, order=order)
    step = min(sync, tau_s + overshoot_s)
    done = expected_completed(tau_s, mu_s, sigma_s, m, interruptible=interruptible)
    return (done / m) * (sync + overhead_s) / (step + overhead_s) - 1
