"""The real half of ``bench/dropcompute.py``: peers as threads training one model per mode.

Why a separate module: the bench script keeps the scenarios, the simulated
N = 64 fleet and the report; this one owns what runs on sockets (the model,
the per-mode clock, the per-thread CPU clock, the trainer and the peers).
See ``bench/dropcompute.py``'s docstring for the set-up and why it is fair.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from _common import free_ports

import gossipnet
from gossipnet.testing.noise import NoisePlan
from gossipnet.training.autotau import AutoTau, AutoTauConfig
from gossipnet.training.dropcompute import Normalise

__all__ = ("DIM", "K", "MB", "MODES", "NET", "Run", "Settings", "run_real")

K = 8
MB = 32  # samples per micro-batch
DIM = 16
MODES = ("sync", "dropcompute", "dropcompute-full")
NET: dict[str, Any] = {
    "heartbeat_interval_s": 0.2,
    "failure_timeout_s": 5.0,
    "join_timeout_s": 20.0,
    "collective_timeout_s": 5.0,
}


@dataclass(frozen=True)
class Settings:
    steps: int
    auto: AutoTauConfig
    lr: float = 0.02


@dataclass
class Run:
    """One mode's outcome, assembled from every peer's records."""

    mode: str
    walls: list[float] = field(default_factory=list)  # rank 0: seconds at each step's end
    cpu: np.ndarray | None = None  # [N, steps] CPU s: trainer thread + its peer's loop thread
    losses: list[float] = field(default_factory=list)  # rank 0: eval loss after each step
    taus: np.ndarray | None = None  # [N, steps] each peer's tau (NaN = none)
    done: np.ndarray | None = None  # [N, steps] micro-batches completed
    compute: np.ndarray | None = None  # [N, steps] seconds of compute

    def steps_per_s(self, first: int = 0) -> float:
        t0 = self.walls[first - 1] if first else 0.0
        return (len(self.walls) - first) / (self.walls[-1] - t0)

    def samples_per_s(self, first: int = 0) -> float:
        assert self.done is not None
        t0 = self.walls[first - 1] if first else 0.0
        return float(self.done[:, first:].sum()) * MB / (self.walls[-1] - t0)

    def final_loss(self) -> float:
        return statistics.fmean(self.losses[-5:])

    def time_to(self, target: float) -> float:
        hit = [w for w, loss in zip(self.walls, self.losses, strict=True) if loss <= target]
        return hit[0] if hit else math.nan


# --------------------------------------------------------------------------- training
def teacher() -> Callable[[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    w1, w2 = torch.randn(DIM, 32, generator=g) / DIM**0.5, torch.randn(32, 1, generator=g) / 4
    return lambda x: torch.tanh(x @ w1) @ w2


def student() -> torch.nn.Module:
    """The model, with the same initial weights in every peer and mode.

    Why not ``torch.manual_seed`` here: peers build their models in parallel
    threads, and the global generator is shared, so the draws of one thread
    interleave with another's (an earlier version started each mode from
    different weights and compared trajectories, not modes).
    """
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in (model[0], model[2]):  # torch's default range, from our generator
            bound = 1 / layer.in_features**0.5
            for p in (layer.weight, layer.bias):
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * bound)
    return model


class ModeClock:
    """Real time that runs only during one mode's steps.

    Why: modes are interleaved, and AutoTau estimates the time outside compute
    from its step-to-step wall time; other modes' steps must not count in it.
    """

    def __init__(self) -> None:
        self.spent = 0.0
        self.since: float | None = None

    def now(self) -> float:
        running = time.perf_counter() - self.since if self.since is not None else 0.0
        return self.spent + running

    def start(self) -> None:
        self.since = time.perf_counter()

    def stop(self) -> float:
        """Pause; return the seconds of the step that just ended."""
        assert self.since is not None
        step = time.perf_counter() - self.since
        self.spent, self.since = self.spent + step, None
        return step


def cpu_clock(net: gossipnet.Peer) -> Callable[[], float]:
    """CPU seconds of the calling thread plus ``net``'s event-loop thread.

    Why per thread: all peers and modes share this process, so process CPU
    cannot be split by mode; a peer's own work is its trainer thread (forward,
    backward, optimizer) and its loop thread (the all-reduce's packets).
    """
    loop = next(t for t in threading.enumerate() if t.name == f"gossipnet-{net.peer_id}")
    assert loop.ident is not None
    clock_id = time.pthread_getcpuclockid(loop.ident)
    return lambda: time.thread_time() + time.clock_gettime(clock_id)


class Trainer:
    """One peer's model, optimizer and tau policy for one (scenario, mode)."""

    def __init__(self, net: gossipnet.Peer, rank: int, mode: str, plan: NoisePlan, cfg: Settings):
        self.net, self.rank, self.plan, self.cfg = net, rank, plan, cfg
        self.cpu = cpu_clock(net)
        self.f = teacher()
        self.model = student()
        self.base = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        self.opt = net.optimizer(self.base)
        self.tau = None if mode == "sync" else AutoTau(cfg.auto)
        self.normalise: Normalise = "full" if mode == "dropcompute-full" else "completed"
        self.gen = torch.Generator().manual_seed(1000 + rank)  # same data in every mode
        self.clock = ModeClock()

    def step(self, step: int, run: Run) -> None:
        """One training step; rank 0 times it (from its start to the optimizer's end)."""
        xs = torch.randn(K, MB, DIM, generator=self.gen)
        ys = self.f(xs) + 0.1 * torch.randn(K, MB, 1, generator=self.gen)
        times = self.plan.times(self.rank, step, K)
        cpu0 = self.cpu()
        self.clock.start()
        pairs = zip(xs, ys, strict=True)
        batches = self.net.microbatches(
            pairs,
            K,
            tau=self.tau,
            normalise=self.normalise,
            clock=self.clock,  # type: ignore[arg-type]  # a ModeClock has now() only
        )
        for i, (x, y) in enumerate(batches):
            torch.nn.functional.mse_loss(self.model(x), y).backward()  # mean loss, no 1/K
            time.sleep(float(times[i]))  # the plan's compute time of this micro-batch
        self.opt.step()
        self.opt.zero_grad()
        spent = self.clock.stop()
        assert run.cpu is not None
        run.cpu[self.rank, step] = self.cpu() - cpu0
        cos = 0.5 * (1 + math.cos(math.pi * (step + 1) / self.cfg.steps))
        self.base.param_groups[0]["lr"] = self.cfg.lr * cos
        rep = self.net.last_microbatch_report
        assert rep is not None
        assert run.done is not None
        assert run.compute is not None
        assert run.taus is not None
        run.done[self.rank, step], run.compute[self.rank, step] = rep.completed, rep.compute_s
        run.taus[self.rank, step] = math.nan if rep.tau_s is None else rep.tau_s
        if self.rank == 0:
            run.walls.append((run.walls[-1] if run.walls else 0.0) + spent)
            with torch.no_grad():
                x_eval = torch.randn(2048, DIM, generator=torch.Generator().manual_seed(7))
                loss = torch.nn.functional.mse_loss(self.model(x_eval), self.f(x_eval))
            run.losses.append(float(loss))


def run_real(n: int, plans: dict[str, NoisePlan], cfg: Settings) -> dict[str, dict[str, Run]]:
    """Join ``n`` peers once and train every (scenario, mode) on them, interleaved.

    Why interleaved (step s of every mode, then step s + 1 ...): the machine's
    background load then falls on all modes alike, and each mode's clock counts
    only its own steps.
    """
    jobs = [(s, m) for s in plans for m in MODES]
    # one peer per (rank, job): a peer averages one model (one optimizer)
    ports = iter(free_ports(n * len(jobs)))  # one call: the ports all differ
    addrs = {job: [f"tcp://127.0.0.1:{next(ports)}" for _ in range(n)] for job in jobs}
    runs = {s: {m: Run(m) for m in MODES} for s in plans}
    for s, m in jobs:
        runs[s][m].done = np.zeros((n, cfg.steps))
        runs[s][m].compute = np.zeros((n, cfg.steps))
        runs[s][m].cpu = np.zeros((n, cfg.steps))
        runs[s][m].taus = np.full((n, cfg.steps), np.nan)
    errors: list[BaseException] = []
    gate = threading.Barrier(n, timeout=120)

    def peer(rank: int) -> None:
        try:
            with contextlib.ExitStack() as stack:
                trainers = {}
                for j, (s, m) in enumerate(jobs):
                    a = addrs[s, m]
                    net = stack.enter_context(
                        gossipnet.join(a, listen=a[rank], peer_id=f"b{rank}.{j}", **NET)
                    )
                    trainers[s, m] = Trainer(net, rank, m, plans[s], cfg)
                gate.wait()
                for step in range(cfg.steps):
                    for s, m in jobs:
                        trainers[s, m].step(step, runs[s][m])
                gate.wait()
        except BaseException as err:
            errors.append(err)
            gate.abort()

    threads = [threading.Thread(target=peer, args=(r,), name=f"peer{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return runs
