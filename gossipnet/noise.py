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

__all__ = ("LogNormalDelay", "NoisePlan", "SlowPeer", "Stall")


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
        mult, p = _lognormal_table(self.mu, self.sigma, self.support)
        return 1 + 0.5 * self.delay_factor * rng.choice(mult, size=m, p=p)


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
    slow: tuple[SlowPeer, ...] = ()
    stalls: tuple[Stall, ...] = ()

    def __post_init__(self) -> None:
        if not self.base_s > 0:
            raise ValueError(f"NoisePlan.base_s must be > 0 seconds, got {self.base_s!r}")

    def times(self, peer: int, step: int, m: int) -> np.ndarray:
        """Seconds of micro-batches ``0 .. m-1`` of ``peer`` at ``step`` (float64 ``[m]``)."""
        scale = self.base_s
        for s in (*self.slow, *self.stalls):
            scale *= s.factor_at(peer, step)
        if self.lognormal is None:
            return np.full(m, scale)
        rng = np.random.default_rng([self.seed, peer, step])
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
        """(mean, std) seconds of one micro-batch of an unslowed peer (for the 3.4 model)."""
        if self.lognormal is None:
            return self.base_s, 0.0
        mean, sd = self.lognormal.moments()
        return self.base_s * mean, self.base_s * sd
