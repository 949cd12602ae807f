"""DropCompute: the cut-off rule, its automatic threshold, and the analytical model.

Giladi et al., *DropCompute* (NeurIPS 2023, arXiv 2306.10598): synchronous
training waits for the slowest worker, so each worker accumulates
micro-batch gradients only until a compute-time threshold ``tau`` and then
contributes what it has.  This module is the arithmetic, with no clock,
thread, state or network: the step loop (:mod:`gossipnet.training.microbatch`) asks
it when to cut and how to weight, :mod:`gossipnet.training.autotau` scores
thresholds with it, and the benchmarks call the same functions.  It also holds
:class:`MicrobatchReport`, one step's outcome as a value: the loop makes it and
the optimizer strategies read it through ``training.host.TrainingHost``, so it
lives below both (re-exported by :mod:`gossipnet.training.microbatch`).

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
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np

__all__ = (
    "MicrobatchReport",
    "Normalise",
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


# --------------------------------------------------------------------------- one step's report
@dataclass(frozen=True, slots=True)
class MicrobatchReport:
    """What one ``microbatches`` loop did (``net.last_microbatch_report``).

    Attributes:
        step: index of the loop on this peer (0, 1, ...).
        completed: micro-batches whose body ran.
        max_microbatches: K.
        tau_s: the threshold in force, seconds; None = no cut-off.
        compute_s: clock seconds from the loop's start to its last micro-batch's end.
        times_s: seconds of each completed micro-batch (data loading included).
        cut: the threshold ended the loop.
        exhausted: the iterable ran out before K.
        normalise: ``"completed"`` or ``"full"`` (see :func:`contribution`).
    """

    step: int
    completed: int
    max_microbatches: int
    tau_s: float | None
    compute_s: float
    times_s: tuple[float, ...]
    cut: bool
    exhausted: bool
    normalise: Normalise

    @property
    def drop_rate(self) -> float:
        """Share of the K micro-batches not run this step."""
        return 1.0 - self.completed / self.max_microbatches

    @property
    def grad_scale(self) -> float:
        """Factor applied to the accumulated gradient before the all-reduce."""
        return contribution(self.completed, self.max_microbatches, self.normalise)[0]

    @property
    def weight(self) -> float:
        """This peer's all-reduce weight."""
        return contribution(self.completed, self.max_microbatches, self.normalise)[1]

    def as_extra(self) -> dict[str, float]:
        """Floats for ``CollectiveReport.extra`` (tau ``inf`` = no cut-off)."""
        return {
            "mb_completed": float(self.completed),
            "mb_max": float(self.max_microbatches),
            "mb_drop_rate": self.drop_rate,
            "mb_compute_s": self.compute_s,
            "tau_s": math.inf if self.tau_s is None else self.tau_s,
            "mb_weight": self.weight,
        }


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
