"""Training over a thin, lossy link with compressed gradients: bytes and loss, offline.

    .venv/bin/python examples/compressed_wan.py                 # 4 peers, 10% loss, ~15 s
    .venv/bin/python examples/compressed_wan.py --loss 0 --steps 200 --density 0.01
    .venv/bin/python examples/compressed_wan.py --values fp32  # float32 values (default int8)

Four peers run in this process (each with its own network thread, on an
in-memory network that drops ``--loss`` of the packets, seeded), and train the
same small regression model three times:

- ``dense``: ``net.optimizer(base)`` (sharded step, parameter broadcast);
- ``opt+arctopk``: ``net.optimizer(base, compress=gossipnet.ArcTopK(density=...))``:
  only the gradients are compressed, the parameter broadcast stays float32, so
  at most about 2x fewer bytes;
- ``ddp+arctopk``: ``net.all_reduce(grads, compress=gossipnet.ArcTopK(...), step=base)``:
  both directions compressed, the big saving; ``step=`` steps the local AdamW
  with the catch-up rule (each sparse value as the rounds it stands for),
  which a plain ``base.step()`` after the call cannot.

Between hosts the only change is ``gossipnet.join(peers=[...], listen=...)``
instead of the in-memory helper.  Each run prints its bytes sent per step
(every peer's transport, all packets, summed) and its final held-out loss; the
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
from typing import Any

import torch

import gossipnet
from gossipnet.testing import run_peers

DIM = 32
INIT_LOCK = threading.Lock()


def train(mode: str, compress: Any, args: argparse.Namespace) -> dict[str, float]:
    """One run on ``args.peers`` peers; held-out MSE (mean over peers) and bytes per step."""
    teacher_gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(DIM, 64, generator=teacher_gen) / DIM**0.5
    w2 = torch.randn(64, 4, generator=teacher_gen) / 8
    x_test = torch.randn(512, DIM, generator=torch.Generator().manual_seed(2))

    def teacher(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1) @ w2

    def body(rank: int, net: gossipnet.Peer) -> tuple[float, int, float]:
        torch.set_num_threads(1)
        # one init everywhere: torch's seed is process-global and the peers are threads,
        # so seeding then building races between them without the lock (the optimizer's
        # first resync would hide it; the DDP-style loop would train replicas apart)
        with INIT_LOCK:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)
            )
        base = torch.optim.AdamW(model.parameters(), lr=3e-3)
        opt = net.optimizer(base, compress=compress) if mode == "opt" else base
        gen = torch.Generator().manual_seed(100 + rank)
        sent0 = net.stats()["transport"]["sent_bytes"]
        ratios = []
        for _ in range(args.steps):
            x = torch.randn(64, DIM, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), teacher(x))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            if mode == "opt":
                rep = opt.step()
            else:  # DDP-style: average the gradients (compressed both ways), step locally
                grads = [p.grad for p in model.parameters()]
                rep = net.all_reduce(grads, compress=compress, step=base)  # type: ignore[arg-type]
            ratios.append(rep.extra.get("compression_ratio", 1.0))
        # the end of training: one model on every peer (lost broadcasts let replicas drift)
        if mode == "opt":
            opt.resync()
        else:
            net.resync(base)
        sent = net.stats()["transport"]["sent_bytes"] - sent0
        with torch.no_grad():
            test = float(torch.nn.functional.mse_loss(model(x_test), teacher(x_test)))
        return test, sent, statistics.median(ratios)

    faults = gossipnet.FaultPlan(loss=args.loss, seed=7) if args.loss else None
    out = run_peers(args.peers, body, faults=faults, chunk_bytes=4096, collective_timeout_s=2.0)
    return {
        "test_mse": statistics.fmean(o[0] for o in out),
        "bytes_per_step": sum(o[1] for o in out) / args.steps,
        "round_ratio": statistics.median(o[2] for o in out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--loss", type=float, default=0.1, help="packet loss rate, 0..1")
    parser.add_argument("--density", type=float, default=0.05, help="ArcTopK density")
    parser.add_argument(
        "--values", default="int8", choices=["fp32", "bf16", "int8"], help="ArcTopK value codec"
    )
    args = parser.parse_args()
    topk = gossipnet.ArcTopK(density=args.density, values=args.values)
    runs = {"dense": ("opt", None), "opt+arctopk": ("opt", topk), "ddp+arctopk": ("ddp", topk)}
    summary: dict[str, Any] = {}
    for name, (mode, compress) in runs.items():
        res = train(mode, compress, args)
        summary[name] = res
        print(
            f"{name:12s} held-out MSE {res['test_mse']:.4f}"
            f"  bytes/step {res['bytes_per_step']:,.0f}  round ratio {res['round_ratio']:.1f}x",
            flush=True,
        )
    dense = summary["dense"]["bytes_per_step"]
    summary["bytes_saved"] = {
        k: dense / v["bytes_per_step"] for k, v in summary.items() if k != "dense"
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
