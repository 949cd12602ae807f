"""A plain DDP training script; ``--backend gossipnet`` is the only change from gloo.

Run it (offline, CPU, ~10 s)::

    python -m torch.distributed.run --nproc-per-node 4 examples/ddp_backend.py
    python -m torch.distributed.run --nproc-per-node 4 examples/ddp_backend.py --backend gloo
    GOSSIPNET_LOSS=0.1 python -m torch.distributed.run --nproc-per-node 4 examples/ddp_backend.py

The model learns a fixed random "teacher" network from generated data; every rank
draws its own batches (seeded by rank), DDP averages the gradients.  With gossipnet
the gradient buckets go through the loss-tolerant all-reduce; the start-up
parameter broadcast and the final ``all_gather_object`` are exact.  Rank 0 prints
the held-out loss and, with ``--json``, one JSON line (used by ``bench/backend.py``
and the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gossipnet  # noqa: F401  (registers the "gossipnet" backend)
import gossipnet.distributed as gdist

DIM = 16


def teacher_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of the fixed teacher (seed 1234) with noise, drawn with ``seed``."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(DIM, 32, generator=teacher) / DIM**0.5
    w2 = torch.randn(32, 1, generator=teacher) / 32**0.5
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=gen)
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(n, 1, generator=gen)
    return x, y


def model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(DIM, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gossipnet")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.1, help="SGD rate (lower it for wide models)")
    ap.add_argument("--json", action="store_true", help="rank 0 prints one JSON line")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)  # ranks start different: the broadcast must fix it
    net = DDP(model(args.hidden))
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    x_all, y_all = teacher_data(args.steps * args.batch, seed=args.seed * 1000 + rank)
    x_test, y_test = teacher_data(2048, seed=99_999)

    step_s, cpu0, wall0 = [], time.process_time(), time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        x = x_all[step * args.batch : (step + 1) * args.batch]
        y = y_all[step * args.batch : (step + 1) * args.batch]
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        sched.step()
        step_s.append(time.perf_counter() - t0)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0

    with torch.no_grad():
        test_loss = nn.functional.mse_loss(net.module(x_test), y_test).item()
    losses: list[float] = [0.0] * world
    dist.all_gather_object(losses, test_loss)  # exact: every rank's held-out loss
    totals = gdist.totals() if args.backend == "gossipnet" else {}
    if rank == 0:
        result = {
            "backend": args.backend,
            "world": world,
            "steps": args.steps,
            "test_loss": test_loss,
            "test_loss_ranks": losses,
            "step_ms_median": 1e3 * statistics.median(step_s[5:] or step_s),
            "wall_s": wall,
            "cpu_s": cpu,
            "lossy_rounds": totals.get("lossy_rounds", 0),
            "packets_lost": totals.get("packets_lost", 0),
            "chunks_stale": totals.get("chunks_stale", 0),
            "chunks_total": totals.get("chunks_total", 0),
        }
        print(json.dumps(result) if args.json else f"held-out loss {test_loss:.5f} ({result})")
    dist.barrier()  # every rank done before any tears down (gloo aborts otherwise, rarely)
    dist.destroy_process_group()
    if args.backend == "gloo":
        # torch 2.13's gloo can still abort at interpreter exit ("terminate called
        # without an active exception": a joinable thread met by a static destructor;
        # seen in CI under load, after the run had reported).  All is done and the
        # group destroyed: leave without the destructors.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
