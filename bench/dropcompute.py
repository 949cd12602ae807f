"""DropCompute vs plain synchronous training under injected compute noise.

Why: synchronous data parallelism waits for the slowest peer every step.
DropCompute (Giladi et al. 2023) cuts each peer's accumulation at a learned
threshold tau.  Target (issue 6): >= 1.3x steps/s at equal final loss
(within 1%) under heavy-tailed noise, and an honest map of where it does
not help.

Real part: N = 4 and 8 gossipnet peers as threads of this process, ZeroMQ
over 127.0.0.1.  Each step every peer runs K = 8 micro-batches of a small
teacher-student MLP regression: a real forward/backward, then ``time.sleep``
for the noise plan's time of that micro-batch (base 5 ms).  Compute is
simulated because 8 peers on 2 CPU cores cannot compute in parallel, but
they can sleep in parallel, so step times keep the plan's statistics.  The
all-reduce is real and costs CPU; on 2 shared cores it is slower than on 8
machines, more so when DropCompute makes all peers arrive together.
Modes run interleaved (step s of every mode, then s + 1), so background load
falls on all alike; each mode's clock counts only its own steps.  Same plan,
data and initial weights in every mode:

  sync              ``tau=None``: every peer runs all K (the baseline)
  dropcompute       ``tau=AutoTau(...)``, ``normalise="completed"`` (gossipnet's)
  dropcompute-full  the same tau rule, ``normalise="full"`` (the authors' 1/(N K))

AutoTau here: 3 warm-up steps, 12 (quick) or 30 timed steps, re-estimated as
often, ``max_drop_rate=0.1`` (ALGORITHMS.md 3.4: keep drop <~ 10%).

Scenarios: ``heavy`` (the authors' per-micro-batch injection plus a log-normal
slowdown of each peer's whole step, sigma 0.5: heavy-tailed step times),
``authors`` (their injection alone: delay_factor 1), ``mb-heavy``
(per-micro-batch only, delay_factor 4, sigma 1.5), ``slowpeer`` (peer 0 3x
slower every 4th step).  Per run: steps/s over the whole run and over the
steps after tau is first set ("steady"), samples/s, drop rate, final loss
(mean eval MSE of the last 5 steps, noiseless targets) and the time to
reach 1.05x the sync run's final loss.

Simulated part: N = 64 with the same plans: a Monte-Carlo of the real step
loop (``gossipnet.noise.simulate_fleet``, overhead = the N = 8 sync run's time
outside compute) and, where micro-batches are i.i.d., ALGORITHMS.md 3.4's
analytical model (sqrt(2 ln N) and Blom's order statistic) next to it.

    .venv/bin/python bench/dropcompute.py --quick   # heavy, 40 steps, < 60 s
    .venv/bin/python bench/dropcompute.py           # 4 scenarios, 200 steps (~20 min)

The last stdout line is JSON: ``speedup`` (steady steps/s, dropcompute / sync,
heavy, N = 8), ``loss_gap`` ((final dropcompute - final sync) / final sync),
``loss_gap_full`` (the same for the authors' normalisation) and the others.
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
from _common import bench_parser, emit_json, free_ports

import gossipnet
from gossipnet.averaging.autotau import AutoTau, AutoTauConfig
from gossipnet.averaging.dropcompute import (
    Normalise,
    expected_completed,
    model_speedup,
    model_step_time,
)
from gossipnet.noise import LogNormalDelay, NoisePlan, SlowPeer, simulate_fleet

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


def scenarios(base_s: float) -> dict[str, NoisePlan]:
    """The noise plans; ``heavy`` is the headline (heavy-tailed step times)."""
    authors = LogNormalDelay(delay_factor=1.0)  # their injection: mean +50%, log-normal tail
    return {
        "heavy": NoisePlan(base_s=base_s, seed=1, lognormal=authors, step_sigma=0.5),
        "authors": NoisePlan(base_s=base_s, seed=1, lognormal=authors),
        "mb-heavy": NoisePlan(
            base_s=base_s, seed=1, lognormal=LogNormalDelay(delay_factor=4.0, sigma=1.5)
        ),
        "slowpeer": NoisePlan(
            base_s=base_s,
            seed=1,
            lognormal=LogNormalDelay(delay_factor=0.5),
            slow=(SlowPeer(peer=0, factor=3.0, period_steps=4),),
        ),
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
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


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


class Trainer:
    """One peer's model, optimizer and tau policy for one (scenario, mode)."""

    def __init__(self, net: gossipnet.Peer, rank: int, mode: str, plan: NoisePlan, cfg: Settings):
        self.net, self.rank, self.plan, self.cfg = net, rank, plan, cfg
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
    addrs = [f"tcp://127.0.0.1:{p}" for p in free_ports(n)]
    jobs = [(s, m) for s in plans for m in MODES]
    runs = {s: {m: Run(m) for m in MODES} for s in plans}
    for s, m in jobs:
        runs[s][m].done = np.zeros((n, cfg.steps))
        runs[s][m].compute = np.zeros((n, cfg.steps))
        runs[s][m].taus = np.full((n, cfg.steps), np.nan)
    errors: list[BaseException] = []
    gate = threading.Barrier(n, timeout=120)

    def peer(rank: int) -> None:
        try:
            with gossipnet.join(addrs, listen=addrs[rank], peer_id=f"b{rank}", **NET) as net:
                trainers = {(s, m): Trainer(net, rank, m, plans[s], cfg) for s, m in jobs}
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


# --------------------------------------------------------------------------- 64 peers, simulated
def simulate(
    n: int, plan: NoisePlan, steps: int, overhead_s: float, auto: AutoTauConfig
) -> dict[str, float]:
    """Monte-Carlo of the loop (sync vs auto tau) and, for i.i.d. micro-batches, 3.4's model."""
    sync = simulate_fleet(plan, n, steps, K, overhead_s=overhead_s)
    dc = simulate_fleet(plan, n, steps, K, tau="auto", overhead_s=overhead_s, auto=auto)
    first = auto.warmup_steps + auto.window_steps
    out = {
        "sync_step_mc": float(sync.step_s[first:].mean()),
        "dc_step_mc": float(dc.step_s[first:].mean()),
        "tau_mc": float(np.nanmedian(dc.tau_s[first:])),
        "drop_mc": float(dc.drop_rate(K)[first:].mean()),
    }
    out["speedup_mc"] = out["sync_step_mc"] / out["dc_step_mc"]
    if plan.step_sigma or plan.slow or plan.stalls:
        return out  # the model assumes i.i.d. micro-batches
    mu, sd = plan.moments()
    sync_model = model_step_time(mu, sd, K, n, order="blom")
    grid = np.linspace(mu, sync_model, 400)
    scores = [
        model_speedup(t, mu, sd, K, n, overhead_s=overhead_s, overshoot_s=mu, order="blom")
        for t in grid
    ]
    tau = float(grid[int(np.argmax(scores))])
    at_model = simulate_fleet(plan, n, steps, K, tau=tau, overhead_s=overhead_s)
    out |= {
        "sync_step_model_gumbel": model_step_time(mu, sd, K, n) + overhead_s,
        "sync_step_model_blom": sync_model + overhead_s,
        "tau_model": tau,
        "dc_step_model": min(tau + mu, sync_model) + overhead_s,
        "dc_step_mc_at_tau_model": float(at_model.step_s[first:].mean()),
        "drop_model": 1 - expected_completed(tau, mu, sd, K, interruptible=False) / K,
        "drop_mc_at_tau_model": float(at_model.drop_rate(K)[first:].mean()),
        "speedup_model": (sync_model + overhead_s) / (min(tau + mu, sync_model) + overhead_s),
        "eff_speedup_model": max(scores),
    }
    return out


# --------------------------------------------------------------------------- report
def summarise(n: int, scenario: str, runs: dict[str, Run], first: int) -> dict[str, float]:
    sync = runs["sync"]
    target = 1.05 * sync.final_loss()
    out: dict[str, float] = {}
    print(f"\nN={n} {scenario}: target loss {target:.5f} (1.05 x sync final)")
    print(
        f"  {'mode':17s} {'steps/s':>8s} {'steady':>8s} {'samples/s':>10s} {'drop':>6s} "
        f"{'tau ms':>7s} {'final loss':>11s} {'t->target s':>12s}"
    )
    for m, r in runs.items():
        assert r.done is not None
        drop = 1 - float(r.done[:, first:].mean()) / K
        assert r.taus is not None
        tau = float(np.nanmedian(r.taus[:, first:])) * 1e3 if m != "sync" else math.nan
        if m != "sync":
            spread = np.nanmax(r.taus[:, first:], axis=0) / np.nanmin(r.taus[:, first:], axis=0)
            out[f"{m}_tau_spread"] = float(spread.max())
        print(
            f"  {m:17s} {r.steps_per_s():8.2f} {r.steps_per_s(first):8.2f} "
            f"{r.samples_per_s(first):10.0f} {drop:6.3f} {tau:7.1f} {r.final_loss():11.5f} "
            f"{r.time_to(target):12.2f}"
        )
        out[f"{m}_steady_steps_per_s"] = r.steps_per_s(first)
        out[f"{m}_drop"] = drop
        out[f"{m}_final_loss"] = r.final_loss()
        out[f"{m}_time_to_target_s"] = r.time_to(target)
    dc, full = runs["dropcompute"], runs["dropcompute-full"]
    out["speedup"] = dc.steps_per_s(first) / sync.steps_per_s(first)
    out["speedup_incl_warmup"] = dc.steps_per_s() / sync.steps_per_s()
    out["samples_speedup"] = dc.samples_per_s(first) / sync.samples_per_s(first)
    out["loss_gap"] = (dc.final_loss() - sync.final_loss()) / sync.final_loss()
    out["loss_gap_full"] = (full.final_loss() - sync.final_loss()) / sync.final_loss()
    out["time_to_target_ratio"] = sync.time_to(target) / dc.time_to(target)
    print(
        f"  speedup steady {out['speedup']:.2f}x (whole run {out['speedup_incl_warmup']:.2f}x), "
        f"samples/s {out['samples_speedup']:.2f}x, loss gap {out['loss_gap']:+.2%} "
        f"(authors' normalisation {out['loss_gap_full']:+.2%}), time to target "
        f"{out['time_to_target_ratio']:.2f}x"
    )
    return out


def overhead(runs: dict[str, Run]) -> float:
    """Median seconds per step outside compute: step wall - slowest peer's compute."""
    r = runs["sync"]
    assert r.compute is not None
    walls = np.diff([0.0, *r.walls])
    return float(np.median(walls - r.compute.max(axis=0)))


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    torch.set_num_threads(1)  # 8 trainer threads on 2 cores: no intra-op oversubscription
    base_s = 0.005
    every = scenarios(base_s)
    plans = {"heavy": every["heavy"]} if args.quick else every
    window = 12 if args.quick else 30
    auto = AutoTauConfig(
        warmup_steps=3, window_steps=window, reestimate_every_steps=window, max_drop_rate=0.1
    )
    cfg = Settings(steps=40 if args.quick else 200, auto=auto)
    first = auto.warmup_steps + auto.window_steps
    print(
        f"DropCompute bench: K={K}, {cfg.steps} steps, base micro-batch {base_s * 1e3:.0f} ms "
        f"(simulated compute: sleeps), threads over ZeroMQ 127.0.0.1, modes interleaved"
    )
    summary: dict[str, Any] = {}
    for n in (4, 8):
        t0 = time.perf_counter()
        real = run_real(n, plans, cfg)
        for s, runs in real.items():
            summary[f"n{n}_{s}"] = summarise(n, s, runs, first)
        summary[f"n{n}_overhead_s"] = oh = overhead(real["heavy"])
        print(
            f"  (N={n}: {time.perf_counter() - t0:.1f} s; sync step time outside compute "
            f"{oh * 1e3:.1f} ms)"
        )
        for s in plans:  # the same fleet without this machine's CPU contention
            mc = simulate(n, every[s], 200, oh, auto)
            summary[f"n{n}_{s}"]["speedup_mc"] = mc["speedup_mc"]
            print(
                f"  N={n} {s}: Monte-Carlo of the loop, same overhead and tau rule: "
                f"{mc['speedup_mc']:.2f}x steps/s, drop {mc['drop_mc']:.3f}"
            )
    print("\nN=64 simulated, seconds (model: ALGORITHMS.md 3.4; mc: Monte-Carlo of the loop)")
    sim_auto = AutoTauConfig(
        warmup_steps=3, window_steps=30, reestimate_every_steps=25, max_drop_rate=0.1
    )
    for s in ("heavy", "authors") if args.quick else every:
        sim = simulate(64, every[s], 120 if args.quick else 400, summary["n8_overhead_s"], sim_auto)
        summary[f"n64_{s}"] = sim
        print(f"  {s}: " + ", ".join(f"{k} {v:.4g}" for k, v in sim.items()))
    head = summary["n8_heavy"]
    emit_json(
        {
            "speedup": head["speedup"],
            "loss_gap": head["loss_gap"],
            "loss_gap_full": head["loss_gap_full"],
            "samples_speedup": head["samples_speedup"],
            "time_to_target_ratio": head["time_to_target_ratio"],
            "speedup_mc": head["speedup_mc"],
            "speedup_n4": summary["n4_heavy"]["speedup"],
            "speedup_n4_mc": summary["n4_heavy"]["speedup_mc"],
            "loss_gap_n4": summary["n4_heavy"]["loss_gap"],
            "speedup_n64_mc": summary["n64_heavy"]["speedup_mc"],
            "speedup_n64_authors_mc": summary["n64_authors"]["speedup_mc"],
            "speedup_n64_authors_model": summary["n64_authors"]["speedup_model"],
            "details": summary,
        }
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
