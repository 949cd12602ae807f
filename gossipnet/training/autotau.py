"""Threshold policies of the DropCompute step loop: fixed, and the authors' automatic tau.

:class:`AutoTau` is ``get_best_threshold`` from the authors' code (ALGORITHMS.md
3.3) made to run for a whole training: it times warm-up steps, scores
thresholds with :func:`~gossipnet.training.dropcompute.best_threshold` on
every peer's timings, and re-estimates as they drift.  It holds state (a
window of timings) but no clock, thread or socket: the step loop feeds it
times, and the peer wires the timing gather in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from gossipnet.training.dropcompute import ThresholdChoice, best_threshold

__all__ = ("AutoTau", "AutoTauConfig", "FixedTau", "Gather", "TauPolicy")


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
        self.owner: object | None = None  # the TrainingHost it serves (timings are one peer's)
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
