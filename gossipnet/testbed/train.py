"""The training workload run inside testbed hosts: a small MLP, data-parallel over UDP.

Task: a student MLP learns a fixed random teacher MLP's class distribution
(32 inputs, 10 classes) from fresh samples every step.  Why this task: it is
cheap enough that four peers train hundreds of steps in seconds on two cores;
fresh samples mean no overfitting, so the evaluation loss is a clean measure
of optimisation progress; and the teacher is sharp (temperature 0.25), so the
irreducible part of the loss (the teacher's entropy) is a small part of it and
"within 1% of the lossless run" is a tight band: the lossless run itself is
more than 1% higher a quarter of the run before its end (the tests check
that too), i.e. 1% catches a run that lost a quarter of its progress.

Evaluation is the exact expected cross-entropy against the teacher's soft
labels on 2048 fixed inputs: no sampling noise in the number compared.
Every peer draws its batches from ``(seed, rank, step)``, so a lossless and a
lossy run see the same data and differ only by the network.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ("TrainSpec", "eval_loss", "make_model", "make_teacher", "train_peer")

IN_DIM = 32
CLASSES = 10
TEACHER_T = 0.25
EVAL_SAMPLES = 2048


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """One peer's run.

    Attributes:
        peers: every peer's ``udp://ip:port`` address, in rank order.
        rank: this peer's index in ``peers``.
        steps: optimizer steps.
        batch: samples per peer per step.
        hidden: width of the student's two hidden layers.
        lr: peak SGD learning rate (momentum 0.9), cosine-annealed to 0 over
            ``steps``: the final loss then sits still instead of jittering with
            the last steps' gradient noise, so two runs compare to a fraction of 1%.
        seed: data and model seed (the same on every peer).
        chunk_bytes: gossipnet payload bytes per datagram; 1024 keeps a packet
            (payload + header + MAC + framing + IP/UDP) inside a 1500-byte MTU.
        eval_every: steps between evaluations (and the final step).
        progress_path: file to which the last finished step is written (so a
            controller can act "mid-run"); None = none.
        run_timeout_s: the run stops (returns, flagged) after this long.
        config: further :class:`gossipnet.Config` overrides.
    """

    peers: tuple[str, ...]
    rank: int
    steps: int = 300
    batch: int = 64
    hidden: int = 64
    lr: float = 0.1
    seed: int = 0
    chunk_bytes: int = 1024
    eval_every: int = 25
    progress_path: str | None = None
    run_timeout_s: float = 90.0
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.peers):
            raise ValueError(f"rank {self.rank} outside peers {self.peers}")
        if self.steps < 1 or self.batch < 1 or self.eval_every < 1:
            raise ValueError("steps, batch and eval_every must be >= 1")


def make_teacher(seed: int) -> nn.Module:
    """The fixed random teacher (same seed -> same function on every peer)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    teacher = nn.Sequential(nn.Linear(IN_DIM, 64), nn.Tanh(), nn.Linear(64, CLASSES))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 / p.shape[-1]) ** 0.5)
    return teacher.requires_grad_(False)


def make_model(hidden: int, seed: int) -> nn.Module:
    """The student MLP, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_DIM, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


def _soft_targets(teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.softmax(teacher(x) / TEACHER_T, dim=-1)


def batch_for(teacher: nn.Module, seed: int, rank: int, step: int, n: int) -> tuple[Any, Any]:
    """Inputs and sampled labels of ``rank``'s batch at ``step`` (deterministic)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)
    x = torch.randn(n, IN_DIM, generator=g)
    y = torch.multinomial(_soft_targets(teacher, x), 1, generator=g).squeeze(1)
    return x, y


def eval_loss(model: nn.Module, teacher: nn.Module, seed: int) -> float:
    """Expected cross-entropy of ``model`` against the teacher on fixed inputs."""
    g = torch.Generator().manual_seed(20_000 + seed)
    x = torch.randn(EVAL_SAMPLES, IN_DIM, generator=g)
    with torch.no_grad():
        target = _soft_targets(teacher, x)
        return float(-(target * F.log_softmax(model(x), dim=-1)).sum(-1).mean())


def _write_progress(path: str | None, step: int) -> None:
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, path)


def train_peer(spec: TrainSpec) -> dict[str, Any]:
    """Join the other peers over UDP and train; the summary of this peer's run.

    Returns a JSON-friendly dict: ``evals`` [(step, loss)], ``final_loss``,
    ``steps_done``, ``step_s`` (median), ``alive_end`` (peers this peer saw
    alive at the end), ``participants_last``, packet and stale-chunk totals,
    and ``timed_out`` when ``run_timeout_s`` cut the run short.  Packet loss
    and dead peers never raise (they are in the numbers).
    """
    import gossipnet

    torch.set_num_threads(1)
    t_start = time.monotonic()
    teacher = make_teacher(spec.seed)
    model = make_model(spec.hidden, spec.seed)
    peer = gossipnet.join(
        peers=list(spec.peers),
        listen=spec.peers[spec.rank],
        secret=b"gossipnet-testbed",
        peer_id=f"h{spec.rank}",
        chunk_bytes=spec.chunk_bytes,
        wait_for=len(spec.peers),
        **spec.config,
    )
    out: dict[str, Any] = {"rank": spec.rank, "evals": [], "timed_out": False}
    totals = dict.fromkeys(
        ("packets_sent", "packets_received", "packets_lost", "chunks_stale", "chunks_total"), 0
    )
    step_times: list[float] = []
    try:
        base = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
        opt = peer.optimizer(base)
        out["join_s"] = time.monotonic() - t_start
        step = 0
        report = None
        for step in range(1, spec.steps + 1):
            if time.monotonic() - t_start > spec.run_timeout_s:
                out["timed_out"] = True
                break
            t0 = time.monotonic()
            for group in base.param_groups:
                group["lr"] = spec.lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / spec.steps))
            x, y = batch_for(teacher, spec.seed, spec.rank, step, spec.batch)
            F.cross_entropy(model(x), y).backward()
            report = opt.step()
            opt.zero_grad()
            step_times.append(time.monotonic() - t0)
            for k in totals:
                totals[k] += getattr(report, k)
            _write_progress(spec.progress_path, step)
            if step % spec.eval_every == 0 or step == spec.steps:
                out["evals"].append((step, eval_loss(model, teacher, spec.seed)))
        out["steps_done"] = len(step_times)
        out["final_loss"] = eval_loss(model, teacher, spec.seed)
        out["alive_end"] = peer.alive_peers()
        out["participants_last"] = list(report.participants) if report else []
        out["step_s"] = sorted(step_times)[len(step_times) // 2] if step_times else None
        out.update(totals)
        out["stats"] = json.loads(json.dumps(peer.stats(), default=str))
    finally:
        peer.close()
    out["wall_s"] = time.monotonic() - t_start
    return out


def spec_dict(spec: TrainSpec) -> dict[str, Any]:
    """``spec`` as a plain dict (for logs and JSON)."""
    return dataclasses.asdict(spec)
