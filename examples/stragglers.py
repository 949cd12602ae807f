"""Stragglers: keep synchronous training fast when some peers run slow.

In synchronous data-parallel training every step waits for the slowest peer.
``net.microbatches`` (DropCompute, Giladi et al. 2023) lets each peer stop
accumulating micro-batches once its compute time passes a threshold tau and
contribute what it has; ``opt.step()`` then averages over the micro-batches
actually done on every peer.  With ``tau="auto"`` tau is learned from the
measured micro-batch times.

Four peers (threads here; processes or machines in real life) train the
same small model twice: once waiting for everyone (``tau=None``), once with
an automatic tau.  Compute time is simulated: after each micro-batch a peer
sleeps for the time a seeded noise plan says it took, with heavy-tailed slow
steps, like a noisy neighbour or a GC pause.

    .venv/bin/python examples/stragglers.py              # about 30 s
    .venv/bin/python examples/stragglers.py --steps 30   # shorter
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import torch

import gossipnet
from gossipnet.testing.noise import LogNormalDelay, NoisePlan
from gossipnet.training.autotau import AutoTau, AutoTauConfig

PEERS = 4
STEPS = 60  # per run (--steps)
K = 8  # micro-batches per step
# 5 ms per micro-batch, +50% heavy-tailed noise on each, and each peer's whole step
# slowed by a log-normal factor (median 1, sigma 0.5): some steps run 2-3x slower
# peers are threads here: seeding and building a model must not interleave between them
INIT_LOCK = threading.Lock()
PLAN = NoisePlan(base_s=0.005, lognormal=LogNormalDelay(delay_factor=1.0), step_sigma=0.5)


def train(rank: int, addresses: list[str], auto: bool, out: dict[str, float], steps: int) -> None:
    # tau="auto" times 5 warm-up + 45 steps first; a shorter window suits this short demo
    # (one AutoTau per peer: it keeps that peer's timings)
    window = AutoTauConfig(warmup_steps=2, window_steps=10, reestimate_every_steps=10)
    tau = AutoTau(window) if auto else None
    with gossipnet.join(addresses, listen=addresses[rank], peer_id=f"peer{rank}") as net:
        with INIT_LOCK:  # the same initial model on every peer (the seed is process-global)
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
            )
        opt = net.optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        data = torch.Generator().manual_seed(rank)  # each peer its own data
        done, start = 0, time.perf_counter()
        for step in range(steps):
            x = torch.randn(K * 16, 8, generator=data)
            y = x.sum(dim=1, keepdim=True).sin()
            micro = zip(x.chunk(K), y.chunk(K), strict=True)
            for i, (xb, yb) in enumerate(net.microbatches(micro, max_microbatches=K, tau=tau)):
                loss = torch.nn.functional.mse_loss(model(xb), yb)  # this micro-batch's mean
                loss.backward()  # gradients add up; opt.step() divides by the count done
                time.sleep(PLAN.times(rank, step, K)[i])  # pretend the compute took this long
            report = opt.step()  # weighted by micro-batches done; tau and drop in .extra
            opt.zero_grad()
            done += int(report.extra["mb_completed"])
            if rank == 0 and step % 10 == 9:
                print(
                    f"  step {step + 1:3d}  loss {loss.item():.4f}  "
                    f"tau {report.extra['tau_s'] * 1e3:6.1f} ms  "
                    f"dropped {report.extra['mb_drop_rate']:.0%} of this peer's micro-batches"
                )
        if rank == 0:
            out["seconds"] = time.perf_counter() - start
            out["loss"] = loss.item()
        out[f"done{rank}"] = done


def run(auto: bool, label: str, steps: int) -> dict[str, float]:
    ports = []
    for _ in range(PEERS):  # free ports on 127.0.0.1
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
    out: dict[str, float] = {}
    print(f"{label}:")
    threads = [
        threading.Thread(target=train, args=(r, addresses, auto, out, steps)) for r in range(PEERS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    steps = ap.parse_args().steps
    torch.set_num_threads(1)
    sync = run(False, "waiting for every peer (tau=None)", steps)
    cut = run(True, "DropCompute (automatic tau)", steps)
    total = steps * K * PEERS
    for label, r in (("tau=None", sync), ("tau=auto", cut)):
        done = sum(v for k, v in r.items() if k.startswith("done"))
        print(
            f"{label:9s} {steps / r['seconds']:5.1f} steps/s  "
            f"{done / total:5.1%} of micro-batches done  last loss {r['loss']:.4f}"
        )
    print(f"speed-up: {sync['seconds'] / cut['seconds']:.2f}x steps/s")


if __name__ == "__main__":
    main()
