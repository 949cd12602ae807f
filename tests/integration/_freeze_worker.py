"""One peer of the freeze test (``test_freeze.py``): trains, reports its steps.

Usage: ``python -m tests.integration._freeze_worker RANK ADDRESSES OUT_DIR STEPS``.
A small least-squares model over lossy loopback ZeroMQ (10% seeded loss), the
all-reduce optimizer with a resync every 10 steps.  Prints ``step N`` after each
step (the parent freezes and thaws peers by them), then a final resync, the
replica verdict and the parameters go to ``OUT_DIR/rank<R>.pt``; it prints
``done`` and leaves when stdin says so, so no departure cuts a round.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import gossipnet

DIM, OUT = 64, 16
NET = {
    "heartbeat_interval_s": 0.1,
    "failure_timeout_s": 1.0,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 20.0,
    "collective_timeout_s": 2.0,
    "resync_every_steps": 10,
}


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    w = torch.randn(DIM, OUT, generator=g)
    x = torch.randn(256, DIM, generator=g)
    return x, x @ w


def main() -> None:
    rank, addresses, out, steps = (
        int(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3]), int(sys.argv[4]),
    )  # fmt: skip
    torch.set_num_threads(1)
    x_eval, y_eval = held_out()
    w_true = torch.linalg.lstsq(x_eval, y_eval).solution
    gen = torch.Generator().manual_seed(1000 + rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, OUT)
    peer = gossipnet.join(
        addresses, listen=addresses[rank], peer_id=f"r{rank}", secret=b"freeze",
        faults=gossipnet.FaultPlan(loss=0.1, seed=rank), handle_sigterm=False, **NET,
    )  # fmt: skip
    opt = peer.optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    realigned = repaired = 0.0
    while opt.step_count < steps:
        x = torch.randn(64, DIM, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
        opt.zero_grad()
        loss.backward()
        rep = opt.step()
        realigned += rep.extra.get("realigned", 0.0)
        repaired += rep.extra.get("replica_repaired", 0.0)
        print(f"step {opt.step_count}", flush=True)
    opt.resync()
    agree = bool(peer.replicas_agree(timeout=5.0))
    with torch.no_grad():
        eval_loss = float(torch.nn.functional.mse_loss(model(x_eval), y_eval))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    result = {"params": params, "agree": agree, "realigned": realigned, "repaired": repaired}
    torch.save(result | {"eval_loss": eval_loss, "steps": opt.step_count}, out / f"rank{rank}.pt")
    print("done", flush=True)
    sys.stdin.readline()
    peer.leave()


if __name__ == "__main__":
    main()
