"""Top-k with error feedback, simulated without a network: what sparsity itself costs.

Why: `bench/compression.py` measures ARC-Top-K through the library, where packet
loss, the owners' one-round-old index sets and the codec all play a part.  This
takes them all away: 4 workers in one process, the same tasks, seeds and
learning-rate schedule as `bench/compression.py`, each step the exact global
top blocks (16 elements, chosen by the summed block norms of every worker's
error-fed gradient), error feedback per worker, the average of what was sent
applied by one optimizer that every worker shares.  If this already misses the
dense run's quality, no network protocol can close the gap: the method (with
this optimizer, at this horizon) does.

Rows: ``<optimizer>:<density>`` with optimizer ``adam`` (AdamW, the demo's lr) or
``sgd`` (momentum 0.9, ``--sgd-lr``) and density 1 for dense, e.g.

    .venv/bin/python bench/topk_sim.py --task demo --steps 300 adam:1 adam:0.1 adam:0.3
    .venv/bin/python bench/topk_sim.py --task regress adam:1 adam:0.01 sgd:1 sgd:0.01

The last stdout line is one JSON object: quality (demo perplexity, regression MSE;
mean over workers, which hold identical models) per row.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, emit_json
from compression import TASKS

from gossipnet.demo.harness import DemoConfig, lr_at

WORKERS = 4


def _top_blocks(srcs: list[torch.Tensor], density: float, block: int) -> torch.Tensor:
    """Element indices of the ``density`` share of blocks with the largest summed norm."""
    n = srcs[0].numel()
    nb = -(-n // block)
    pad = nb * block - n
    energy = sum(torch.nn.functional.pad(s.square(), (0, pad)).view(nb, block).sum(1) for s in srcs)
    top = torch.topk(energy, max(1, round(density * n / block))).indices  # type: ignore[arg-type]
    idx = (top[:, None] * block + torch.arange(block)).flatten()
    return idx[idx < n]


def run(task: str, opt_name: str, density: float, steps: int, seed: int, sgd_lr: float) -> float:
    """Train one row; the final quality."""
    make = TASKS[task](seed, steps)
    workers = [make(r, seed) for r in range(WORKERS)]
    model = workers[0][0]
    params = list(model.parameters())
    for other, _, _ in workers[1:]:
        other.load_state_dict(model.state_dict())
    lr = (3e-3 if task == "demo" else 1e-3) if opt_name == "adam" else sgd_lr
    warm = DemoConfig(steps=steps, lr=lr, warmup_steps=10)
    opt: Any = (
        torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        if opt_name == "adam"
        else torch.optim.SGD(params, lr=lr, momentum=0.9)
    )
    n = sum(p.numel() for p in params)
    errors = [torch.zeros(n) for _ in range(WORKERS)]
    for step in range(steps):
        grads = []
        for w, (m, batch_loss, _) in enumerate(workers):
            if w:
                m.load_state_dict(model.state_dict())  # every worker holds the same model
            m.zero_grad()
            batch_loss().backward()
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))  # type: ignore[union-attr]
        if density >= 1:
            g = torch.stack(grads).mean(0)
        else:
            srcs = [e + gr for e, gr in zip(errors, grads, strict=True)]
            idx = _top_blocks(srcs, density, 16)
            g = torch.zeros(n)
            for w, src in enumerate(srcs):
                sent = torch.zeros(n)
                sent[idx] = src[idx]
                errors[w] = src - sent
                g += sent / WORKERS
        off = 0
        for p in params:
            p.grad = g[off : off + p.numel()].view_as(p).clone()
            off += p.numel()
        for group in opt.param_groups:
            group["lr"] = lr_at(warm, step)
        opt.step()
    for m, _, _ in workers[1:]:
        m.load_state_dict(model.state_dict())
    return float(sum(q() for _, _, q in workers) / WORKERS)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("rows", nargs="*", default=["adam:1", "adam:0.1"])
    parser.add_argument("--task", choices=sorted(TASKS), default="demo")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sgd-lr", type=float, default=0.01)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 60 if args.quick else args.steps
    out: dict[str, float] = {}
    for row in args.rows:
        name, density = row.split(":")
        out[row] = run(args.task, name, float(density), steps, args.seed, args.sgd_lr)
        print(f"{row:12s} quality {out[row]:.4f}", flush=True)
    emit_json({"task": args.task, "steps": steps, "seed": args.seed, "quality": out})


if __name__ == "__main__":
    main()
