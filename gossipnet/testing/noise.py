"""Seeded compute-noise plans: how long each peer's micro-batches take.

Tests and benchmarks of the DropCompute cut-off need stragglers that replay
exactly.  A :class:`NoisePlan` is a pure function of ``(seed, peer, step,
micro-batch)``: the same plan gives the same seconds in every process, and
adding a peer never changes another peer's numbers (one RNG stream per
``(seed, peer, step)``, as ``FaultPlan`` does per link).

It only *says* how long a micro-batch takes; the caller spends that time,
with ``time.sleep`` on a real clock or ``FakeClock.advance`` in a test.
Why simulate rather than burn FLOPs: eight peers on two CPU cores cannot
compute in parallel, but they can sleep in parallel, so the step-time
statistics stay those of the plan.

Three ingredients, combined multiplicatively on a micro-batch's base time:

- :class:`LogNormalDelay`: the authors' injection (DropCompute repo,
  ``create_dist_lognormal``): after each micro-batch, an extra
  ``delay_factor * 0.5 * mult`` times its compute time, ``mult`` drawn from a
  log-normal shape on 1..999 (mu=4, sigma=1 in log space) normalised to mean 1.
- :class:`SlowPeer`: one peer is ``factor`` times slower for ``slow_steps``
  steps out of every ``period_steps`` (a noisy neighbour, thermal throttling).
- :class:`Stall`: one peer's micro-batches take ``factor`` times longer from
  ``start_step`` on, for ``steps`` steps (a failing disk, a swapped process).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gossipnet.clock import FakeClock
from gossipnet.training.autotau import AutoTau, AutoTauConfig, FixedTau
from gossipnet.training.dropcompute import Normalise
from gossipnet.training.microbatch import MicrobatchLoop

__all__ = ("FleetRun", "LogNormalDelay", "NoisePlan", "SlowPeer", "Stall", "simulate_fleet")


@functools.lru_cache(maxsize=8)
def _lognormal_table(mu: float, sigma: float, support: int) -> tuple[np.ndarray, np.ndarray]:
    """(multipliers with mean 1, probabilities) of the authors' discrete log-normal."""
    lengths = np.arange(1, support + 1, dtype=np.float64)
    p = np.exp(-((np.log(lengths) - mu) ** 2) / (2 * sigma**2)) / lengths
    p /= p.sum()
    mult = lengths / float((p * lengths).sum())
    mult.flags.writeable = False
    p.flags.writeable = False
    return mult, p


@functools.lru_cache(maxsize=8)
def _cdf(mu: float, sigma: float, support: int) -> np.ndarray:
    return np.cumsum(_lognormal_table(mu, sigma, support)[1])


@dataclass(frozen=True, kw_only=True, slots=True)
class LogNormalDelay:
    """Heavy-tailed extra time per micro-batch (ALGORITHMS.md 3.1).

    Attributes:
        delay_factor: the authors' ``--delay_factor``; the mean extra time is
            ``0.5 * delay_factor`` times the micro-batch's own time.
        mu / sigma: log-space location and scale of the multiplier's shape.
        support: largest integer length of the shape (the multiplier's cap).
    """

    delay_factor: float = 1.0
    mu: float = 4.0
    sigma: float = 1.0
    support: int = 999

    def __post_init__(self) -> None:
        if self.delay_factor < 0 or self.sigma <= 0 or self.support < 1:
            raise ValueError("need delay_factor >= 0, sigma > 0, support >= 1")

    def moments(self) -> tuple[float, float]:
        """(mean, std) of the factor ``1 + 0.5 * delay_factor * mult`` on a micro-batch."""
        mult, p = _lognormal_table(self.mu, self.sigma, self.support)
        sd = float(np.sqrt((p * (mult - 1.0) ** 2).sum()))
        return 1 + 0.5 * self.delay_factor, 0.5 * self.delay_factor * sd

    def factors(self, rng: np.random.Generator, m: int) -> np.ndarray:
        """``m`` factors ``1 + 0.5 * delay_factor * mult`` (inverse-CDF draws)."""
        mult = _lognormal_table(self.mu, self.sigma, self.support)[0]
        idx = np.searchsorted(_cdf(self.mu, self.sigma, self.support), rng.random(m), side="right")
        return 1 + 0.5 * self.delay_factor * mult[np.minimum(idx, len(mult) - 1)]


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowPeer:
    """Peer ``peer`` is ``factor`` x slower in the first ``slow_steps`` of every
    ``period_steps`` steps (counting from ``phase``)."""

    peer: int
    factor: float = 3.0
    period_steps: int = 10
    slow_steps: int = 1
    phase: int = 0

    def __post_init__(self) -> None:
        if (
            self.factor <= 0
            or self.period_steps < 1
            or not 0 <= self.slow_steps <= self.period_steps
        ):
            raise ValueError("need factor > 0, period_steps >= 1, 0 <= slow_steps <= period")

    def factor_at(self, peer: int, step: int) -> float:
        slow = peer == self.peer and (step - self.phase) % self.period_steps < self.slow_steps
        return self.factor if slow else 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Stall:
    """Peer ``peer``'s micro-batches take ``factor`` x longer during steps
    ``start_step .. start_step + steps - 1``."""

    peer: int
    start_step: int
    steps: int = 1_000_000_000
    factor: float = 20.0

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.steps < 0:
            raise ValueError("need factor > 0 and steps >= 0")

    def factor_at(self, peer: int, step: int) -> float:
        stalled = peer == self.peer and self.start_step <= step < self.start_step + self.steps
        return self.factor if stalled else 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class NoisePlan:
    """Seconds per micro-batch for every ``(peer, step, micro-batch)``; replayable.

    Attributes:
        base_s: a micro-batch's noise-free compute time in seconds.
        seed: RNG seed; one stream per ``(seed, peer, step)``.
        lognormal: heavy-tailed per-micro-batch delay, or None.
        step_sigma: log-space sigma of a per-(peer, step) slowdown of all of a step's
            micro-batches (median 1; 0 = none).  Why: a noisy neighbour or a GC pause
            outlasts one micro-batch, so it does not average out over K as
            per-micro-batch noise does; the step times get a heavy right tail.
        slow: periodically slow peers.
        stalls: stalled peers.

    Example::

        plan = NoisePlan(base_s=0.004, lognormal=LogNormalDelay(delay_factor=2.0))
        for i, batch in enumerate(net.microbatches(batches, max_microbatches=8)):
            ...; time.sleep(plan.times(rank, step, 8)[i])
    """

    base_s: float = 0.01
    seed: int = 0
    lognormal: LogNormalDelay | None = None
    step_sigma: float = 0.0
    slow: tuple[SlowPeer, ...] = ()
    stalls: tuple[Stall, ...] = ()

    def __post_init__(self) -> None:
        if not self.base_s > 0 or self.step_sigma < 0:
            raise ValueError("NoisePlan needs base_s > 0 seconds and step_sigma >= 0")

    def times(self, peer: int, step: int, m: int) -> np.ndarray:
        """Seconds of micro-batches ``0 .. m-1`` of ``peer`` at ``step`` (float64 ``[m]``)."""
        scale = self.base_s
        for slow in self.slow:
            scale *= slow.factor_at(peer, step)
        for stall in self.stalls:
            scale *= stall.factor_at(peer, step)
        if self.lognormal is None and not self.step_sigma:
            return np.full(m, scale)
        rng = np.random.default_rng([self.seed, peer, step])
        if self.step_sigma:
            scale *= float(np.exp(rng.normal(0.0, self.step_sigma)))
        if self.lognormal is None:
            return np.full(m, scale)
        return scale * self.lognormal.factors(rng, m)

    def sample(self, peers: int, steps: int, m: int, *, first_step: int = 0) -> np.ndarray:
        """``[peers, steps, m]`` seconds, identical to calling :meth:`times` for each."""
        return np.stack(
            [
                np.stack([self.times(p, first_step + s, m) for s in range(steps)])
                for p in range(peers)
            ]
        )

    def moments(self) -> tuple[float, float]:
        """(mean, std) seconds of one micro-batch of an unslowed peer (for the 3.4 model,
        which assumes i.i.d. micro-batches: ``step_sigma`` is outside it)."""
        if self.lognormal is None:
            return self.base_s, 0.0
        mean, sd = self.lognormal.moments()
        return self.base_s * mean, self.base_s * sd


# --------------------------------------------------------------------------- Monte-Carlo
@dataclass(slots=True)
class FleetRun:
    """Per-step outcome of :func:`simulate_fleet`.

    Attributes:
        step_s: ``[S]`` step seconds (slowest worker's compute + overhead).
        compute_s: ``[S, N]`` each worker's compute seconds.
        completed: ``[S, N]`` micro-batches each worker completed.
        tau_s: ``[S]`` the threshold in force (NaN = no cut-off).
        auto: the fleet's :class:`AutoTau` (``tau="auto"``), with its ``choices``.
    """

    step_s: np.ndarray
    compute_s: np.ndarray
    completed: np.ndarray
    tau_s: np.ndarray
    auto: AutoTau | None = None

    def drop_rate(self, max_microbatches: int) -> np.ndarray:
        """``[S]`` share of the fleet's micro-batches dropped per step."""
        return 1.0 - self.completed.mean(axis=1) / max_microbatches


def simulate_fleet(
    plan: NoisePlan,
    peers: int,
    steps: int,
    max_microbatches: int,
    *,
    tau: float | str | None = None,
    overhead_s: float = 0.0,
    auto: AutoTauConfig | None = None,
    normalise: Normalise = "completed",
) -> FleetRun:
    """Monte-Carlo of the real step loop: ``peers`` workers in lockstep under ``plan``.

    Each worker runs :class:`~gossipnet.training.microbatch.MicrobatchLoop` on its own
    :class:`FakeClock`, advancing it by the plan's micro-batch times; a step
    lasts the slowest worker's compute plus ``overhead_s`` (all-reduce and
    optimizer).  With ``tau="auto"`` one :class:`AutoTau` sees every worker's
    timings, as each peer does through the lossless timing gather (all peers
    then compute the same tau, so one estimator stands for all).
    """
    est = AutoTau(auto or AutoTauConfig()) if tau == "auto" else None
    fixed = FixedTau(None if tau is None or tau == "auto" else float(tau))
    hist: list[list[np.ndarray]] = [[] for _ in range(peers)]
    if est is not None:
        est.gather = lambda _own: [np.stack(h[-est.config.history_steps :]) for h in hist]
    step_s = np.zeros(steps)
    compute = np.zeros((steps, peers))
    done = np.zeros((steps, peers), dtype=np.int64)
    taus = np.full(steps, np.nan)
    now = 0.0
    for s in range(steps):
        policy = FixedTau(est.begin(now)) if est is not None else fixed
        rows = np.full((peers, max_microbatches), np.nan)
        for w in range(peers):
            clock = FakeClock(now)
            times = plan.times(w, s, max_microbatches)
            loop = MicrobatchLoop(
                range(max_microbatches),
                max_microbatches=max_microbatches,
                policy=policy,
                normalise=normalise,
                now=clock.now,
            )
            for i in loop:
                clock.advance(float(times[i]))
            rep = loop.finish()
            compute[s, w], done[s, w] = rep.compute_s, rep.completed
            rows[w, : rep.completed] = rep.times_s
        taus[s] = np.nan if policy.tau_s is None else policy.tau_s
        if est is not None:
            est.record(tuple(rows[0, : done[s, 0]]), max_microbatches)
            if est.step > est.config.warmup_steps:
                for w in range(peers):
                    hist[w].append(rows[w])
            est.maybe_estimate()
        step_s[s] = compute[s].max() + overhead_s
        now += step_s[s]
    return FleetRun(step_s, compute, done, taus, est)
