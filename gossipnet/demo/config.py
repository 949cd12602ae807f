"""The demo's settings and results: :class:`DemoConfig` (one training run), the
records each peer reports (:class:`StepRecord`, :class:`EvalRecord`) and what the
parent gathers (:class:`DemoResult`).

Why apart from the runner (:mod:`gossipnet.demo.harness`) and the model
(:mod:`gossipnet.demo.model`): these are plain values that cross process
boundaries (pickled to and from the spawned peers) and that ``gossipnet demo``
and ``bench/quality.py`` build and read; they import no model and start no
process.  Internal: import them from :mod:`gossipnet.demo.harness`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gossipnet.transport.faults import FaultPlan, GilbertElliott

__all__ = (
    "SPLITS",
    "STRATEGIES",
    "DemoConfig",
    "DemoResult",
    "EvalRecord",
    "LateLoss",
    "StepRecord",
)

STRATEGIES = ("allreduce", "grads")
SPLITS = ("shuffled", "contiguous")


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """One training run; the defaults finish in about a minute on 2 CPU cores.

    ``loss`` is the mean packet loss rate; with ``burst`` (mean burst length in
    packets) it is Gilbert-Elliott bursty loss instead of independent loss.
    ``strategy``: ``"allreduce"`` = ``net.optimizer`` (sharded step + parameter
    broadcast + a resync every ``resync_every`` rounds); ``"grads"`` =
    ``loss.backward(); net.all_reduce(grads); base.step()``: each peer steps a full
    replica, and wherever its averaged gradient chunk was lost it steps with its
    own, so replicas drift apart (nothing pulls them back; compare the two).
    """

    peers: int = 4
    steps: int = 300
    batch: int = 16
    context: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup_steps: int = 20
    eval_every: int = 50
    eval_windows: int = 128
    loss: float = 0.0
    burst: float | None = None
    seed: int = 7
    data_seed: int = 0
    model_seed: int = 0
    strategy: str = "allreduce"
    chunk_bytes: int | None = 16384
    resync_every: int = 100
    redundancy: int = 1  # Config.redundancy: copies of every data packet
    # Config.parity_group: one XOR parity packet per this many (None: the library's
    # default, parity in the optimizer's rounds while loss is seen; 0: none)
    parity_group: int | None = None
    stale_step: bool = True  # Config.stale_step: estimate lost parameter broadcasts
    timeout_s: float = 2.0  # per collective: 30x a loaded round on loopback; caps stalls
    corpus_bytes: int = 4_000_000
    split: str = "shuffled"  # how the stream is shared out: see _demo_model.shard_stream
    #: First step with loss (random loss only); the steps before it are loss-free, to
    #: see what loss costs late in training, near the paper's fine-tuning setting.
    loss_from: int = 0

    def __post_init__(self) -> None:
        if self.peers < 1 or self.steps < 1 or self.batch < 1 or self.context < 2:
            raise ValueError("peers, steps, batch must be >= 1 and context >= 2")
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of heads={self.heads}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.burst is not None and self.burst < 1.0:
            raise ValueError(f"burst is a mean burst length in packets (>= 1), got {self.burst}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.parity_group is not None and not 0 <= self.parity_group <= 64:
            raise ValueError(f"parity_group must be in [0, 64], got {self.parity_group}")
        if not 1 <= self.redundancy <= 8:
            raise ValueError(f"redundancy must be in [1, 8], got {self.redundancy}")
        if self.eval_every < 1 or self.eval_windows < 1:
            raise ValueError("eval_every and eval_windows must be >= 1")
        if not 0 <= self.loss_from < self.steps or (self.loss_from and self.burst is not None):
            raise ValueError(
                f"loss_from must be in [0, steps) and needs random (not bursty) loss,"
                f" got {self.loss_from}"
            )

    def fault_plan(self, late: LateLoss | None = None) -> FaultPlan | None:
        """The :class:`gossipnet.FaultPlan` of this run (None when lossless).

        ``late``: with ``loss_from``, the switch the training loop turns on at that step.
        """
        if self.loss == 0.0:
            return None
        if self.burst is not None:
            return FaultPlan(seed=self.seed, burst=GilbertElliott.from_rate(self.loss, self.burst))
        if late is not None:
            return FaultPlan(seed=self.seed, link_loss=late)
        return FaultPlan(seed=self.seed, loss=self.loss)

    def label(self) -> str:
        """A short name for tables and plot legends, e.g. ``loss=10% burst=8``."""
        text = f"loss={self.loss:.0%}" if self.loss else "lossless"
        text += f" burst={self.burst:g}" if self.burst and self.loss else ""
        text += f" from step {self.loss_from}" if self.loss_from and self.loss else ""
        if self.parity_group:
            text += f" parity 1/{self.parity_group}"
        elif self.parity_group == 0 and self.loss:
            text += " no parity"
        return text + (f" x{self.redundancy} copies" if self.redundancy > 1 else "")


class LateLoss:
    """``FaultPlan.link_loss`` that is 0 until the training loop sets ``on``."""

    def __init__(self, loss: float) -> None:
        self.loss = loss
        self.on = False

    def __call__(self, src: str, dst: str, t: float) -> float:
        return self.loss if self.on else 0.0


@dataclass(slots=True)
class StepRecord:
    """What one peer reports after one step (one CSV row)."""

    rank: int
    step: int
    round: int  # the collective's round number (the same on every peer in lockstep)
    train_loss: float
    packets_sent: int
    packets_received: int
    packets_lost: int
    contributors: int
    chunks_stale: int
    elapsed_s: float  # the collective
    step_s: float  # the whole step: batch, forward, backward, collective
    timed_out: bool


@dataclass(slots=True)
class EvalRecord:
    """Held-out loss (nats per character) of one peer's replica after ``step`` steps."""

    rank: int
    step: int
    eval_loss: float
    #: at the last step: whether the replica digests agreed after a final resync
    #: (None: the strategy has no resync, or an intermediate evaluation)
    digests_agree: bool | None = None


@dataclass(slots=True)
class DemoResult:
    """Everything a run produced, gathered in the parent process."""

    config: DemoConfig
    steps: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    wall_s: float = 0.0
    startup_s: float = 0.0  # spawn + import + data + join, until the first step

    def eval_curve(self) -> list[tuple[int, float]]:
        """(step, eval loss averaged over peers) at every evaluation."""
        by_step: dict[int, list[float]] = {}
        for e in self.evals:
            by_step.setdefault(e.step, []).append(e.eval_loss)
        return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())]

    def final_evals(self) -> list[EvalRecord]:
        """Every peer's evaluation at the last evaluated step."""
        last = max((e.step for e in self.evals), default=-1)
        return sorted((e for e in self.evals if e.step == last), key=lambda e: e.rank)

    @property
    def final_spread(self) -> tuple[float, float]:
        """(min, max) of the replicas' final eval losses."""
        losses = [e.eval_loss for e in self.final_evals()] or [float("nan")]
        return min(losses), max(losses)

    def disagreement(self) -> str | None:
        """Why the replicas cannot be trusted to be one model, or None.

        With a resync (the optimizer strategy) they must be bit-identical: digests
        agree and the eval losses are equal.  Without one (``grads``) lost chunks
        leave small differences by design: more than 1% relative spread is wrong.
        """
        finals = self.final_evals()
        if len(finals) < self.config.peers:
            return f"{len(finals)} of {self.config.peers} peers reported a final evaluation"
        lo, hi = self.final_spread
        if any(e.digests_agree is False for e in finals):
            bad = [e.rank for e in finals if e.digests_agree is False]
            return f"replica digests disagree after the final resync (seen by peers {bad})"
        exact = all(e.digests_agree for e in finals)
        limit = 1e-9 if exact else 0.01 * abs(lo)
        if hi - lo > limit:
            return f"replicas' eval losses differ: min {lo:.5f}, max {hi:.5f} nats/char"
        return None

    @property
    def final_eval_loss(self) -> float:
        curve = self.eval_curve()
        return curve[-1][1] if curve else float("nan")

    @property
    def final_ppl(self) -> float:
        """Per-character perplexity, exp(final eval loss)."""
        return math.exp(self.final_eval_loss)

    @property
    def lost_fraction(self) -> float:
        """Data packets lost / expected, over the whole run and all peers."""
        lost = sum(r.packets_lost for r in self.steps)
        got = sum(r.packets_received for r in self.steps)
        return lost / (lost + got) if lost + got else 0.0
