"""Top-k with error feedback, simulated without a network: what sparsity itself costs.

Why: `bench/compression.py` measures ARC-Top-K through the library, where packet
loss, the owners' one-round-old index sets and the codec all play a part.  This
takes them away one at a time: 4 workers in one process, the same tasks, seeds
and learning-rate schedule as `bench/compression.py`, each step the global top
blocks (16 elements, chosen by the summed block norms of every worker's
error-fed gradient), error feedback per worker, the average of what was sent
applied by one optimizer that every worker shares.  ``--lag`` chooses each
step's blocks one step early, from the residuals and gradients of the step
before, as the library's owners do (they announce the next set with their
broadcast).

Rows: ``<optimizer>:<density>`` with density 1 for dense and optimizer

- ``adam``: stock AdamW on the sparse sums (``ArcTopK(catch_up=False)``);
- ``catchup``: Adam's catch-up step, each value stepped as the rounds it
  stands for (``gossipnet.training._catch_up``, the library's own function);
- ``select``: catch-up, and the blocks chosen by the step they would take (block
  energy times the block's mean ``1 / v``; ``ArcTopK``'s default with Adam);
- ``sgd``: SGD with momentum 0.9 (``--sgd-lr``) on the sparse sums;
- ``acc``: ``select`` under Accordion's per-layer rule (the library's
  ``AccordionState``; density ``LOW/HIGH``, ``--acc-interval``,
  ``--acc-threshold``, ``--acc-observe own|mean``: each decision from worker 0's
  own gradient, as each owner decides in the library, or from the mean); prints
  the mean density of every 10 steps.

A density may be a schedule, ``0.1@30>0.01``: 0.1 before step 30, then 0.01
(``d0@s1>d1@s2>d2`` ...): what a switch at a known step would buy, the bound an
Accordion rule can approach.  Every row prints its mean density (bytes are
proportional to it here).

    .venv/bin/python bench/topk_sim.py --task demo --lag adam:1 adam:0.1 catchup:0.1 select:0.1
    .venv/bin/python bench/topk_sim.py --task regress adam:1 adam:0.01 sgd:1 sgd:0.01
    .venv/bin/python bench/topk_sim.py --task demo --lag select:0.03 "select:0.1@30>0.01" \
        --acc-interval 20 acc:0.1/0.02

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

from gossipnet.collectives.compress.accordion import AccordionState
from gossipnet.collectives.compress.staleness import MAX_AGE
from gossipnet.collectives.compress.topk import block_indices, block_mean, sketch
from gossipnet.demo.harness import DemoConfig, lr_at
from gossipnet.training._catch_up import catch_up_step, selection_weights

WORKERS = 4
BLOCK = 16


def _top_blocks(
    srcs: list[torch.Tensor], density: float | torch.Tensor, weight: torch.Tensor | None
) -> torch.Tensor:
    """Element indices of the ``density`` share of blocks of largest summed energy
    (times ``weight`` per block, if given); ``density`` per block: the top share of
    each group of blocks of one density (Accordion's layers)."""
    n = srcs[0].numel()
    energy = sum(sketch(s, BLOCK).square() for s in srcs)
    if weight is not None:
        energy = energy * weight
    if not isinstance(density, torch.Tensor):
        top = torch.topk(energy, max(1, round(density * n / BLOCK))).indices  # type: ignore[arg-type]
        return block_indices(top, BLOCK, n)
    parts = []
    for d in torch.unique(density):
        ids = torch.nonzero(density == d).flatten()
        k = max(1, round(float(d) * ids.numel()))
        parts.append(ids[torch.topk(energy[ids], k).indices])  # type: ignore[index]
    return block_indices(torch.sort(torch.cat(parts)).values, BLOCK, n)


class _Shared:
    """The one model every worker holds, and its optimizer (stock or catch-up)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        opt: torch.optim.Optimizer,
        catch_up: bool,
        max_age: int = MAX_AGE,
    ) -> None:
        self.params, self.opt, self.catch_up = params, opt, catch_up
        self.max_age = max_age
        self.n = sum(p.numel() for p in params)
        self.last = torch.zeros(self.n, dtype=torch.int64)

    def step(self, g: torch.Tensor, idx: torch.Tensor, step: int) -> None:
        """Apply the averaged sparse sum ``g`` (nonzero at ``idx``) as step ``step``."""
        if not self.catch_up:
            off = 0
            for p in self.params:
                p.grad = g[off : off + p.numel()].view_as(p).clone()
                off += p.numel()
            self.opt.step()
            return
        age = torch.zeros(self.n)
        age[idx] = (step + 1 - self.last[idx]).clamp(1, self.max_age).to(torch.float32)
        self.last[idx] = step + 1
        off, group = 0, self.opt.param_groups[0]
        for p in self.params:
            k = p.numel()
            catch_up_step(
                p,
                g[off : off + k].view_as(p),
                age[off : off + k].view_as(p),
                self.opt.state[p],
                group,
            )
            off += k

    def block_weights(self) -> torch.Tensor | None:
        """Per block, the mean ``1 / v`` (None before the first step)."""
        group = self.opt.param_groups[0]
        parts = [selection_weights(self.opt.state[p], group) for p in self.params]
        if any(w is None for w in parts):
            return None
        return block_mean(torch.cat([w.flatten() for w in parts if w is not None]), BLOCK)


def schedule(spec: str) -> list[tuple[int, float]]:
    """``0.1@30>0.01``: density 0.1 before step 30, then 0.01 (``d0@s1>d1@s2>d2`` ...)."""
    out: list[tuple[int, float]] = []
    for part in spec.split(">"):
        d, _, until = part.partition("@")
        out.append((int(until) if until else 1 << 30, float(d)))
    return out


def density_at(plan: list[tuple[int, float]], step: int) -> float:
    return next(d for until, d in plan if step < until)


def run(
    task: str,
    name: str,
    density: str,
    steps: int,
    seed: int,
    sgd_lr: float,
    lag: bool,
    acc_args: Any = None,
    max_age: int = MAX_AGE,
) -> tuple[float, float]:
    """Train one row; the final quality."""
    make = TASKS[task](seed, steps)
    workers = [make(r, seed) for r in range(WORKERS)]
    model = workers[0][0]
    params = list(model.parameters())
    for other, _, _ in workers[1:]:
        other.load_state_dict(model.state_dict())
    lr = (3e-3 if task == "demo" else 1e-3) if name != "sgd" else sgd_lr
    warm = DemoConfig(steps=steps, lr=lr, warmup_steps=10)
    opt: Any = (
        torch.optim.SGD(params, lr=lr, momentum=0.9)
        if name == "sgd"
        else torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    )
    shared = _Shared(params, opt, catch_up=name in ("catchup", "select", "acc"), max_age=max_age)
    errors = [torch.zeros(shared.n) for _ in range(WORKERS)]
    ahead: torch.Tensor | None = None  # --lag: the set chosen one step early
    acc = _accordion(name, density, params, acc_args)
    plan = schedule(density) if acc is None else []
    sent_total = 0.0
    trace: list[float] = []
    for step in range(steps):
        if acc is None:
            d_now: float | torch.Tensor = density_at(plan, step)
            d_next: float | torch.Tensor = density_at(plan, step + 1)
        else:
            d_now = acc.densities()
        mean_now = float(d_now.mean()) if isinstance(d_now, torch.Tensor) else d_now
        sent_total += mean_now
        trace.append(mean_now)
        grads = []
        for w, (m, batch_loss, _) in enumerate(workers):
            if w:
                m.load_state_dict(model.state_dict())  # every worker holds the same model
            m.zero_grad()
            batch_loss().backward()
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))  # type: ignore[union-attr]
        weight = shared.block_weights() if name in ("select", "acc") else None
        if acc is not None:
            acc.observe(grads)
            d_next = acc.densities()
        if not isinstance(d_now, torch.Tensor) and d_now >= 1:
            idx = torch.arange(shared.n)
            g = torch.stack(grads).mean(0)
        else:
            srcs = [e + gr for e, gr in zip(errors, grads, strict=True)]
            idx = ahead if lag and ahead is not None else _top_blocks(srcs, d_now, weight)
            g = torch.zeros(shared.n)
            for w, src in enumerate(srcs):
                sent = torch.zeros(shared.n)
                sent[idx] = src[idx]
                errors[w] = src - sent
                g += sent / WORKERS
            if lag:  # the library's owners: from the residuals and this step's gradients
                ahead = _top_blocks(
                    [e + gr for e, gr in zip(errors, grads, strict=True)], d_next, weight
                )
        for group in opt.param_groups:
            group["lr"] = lr_at(warm, step)
        shared.step(g, idx, step)
    for m, _, _ in workers[1:]:
        m.load_state_dict(model.state_dict())
    if acc is not None:
        print(
            "  density per 10 steps:",
            " ".join(f"{sum(trace[i : i + 10]) / 10:.3f}" for i in range(0, steps, 10)),
        )
    return float(sum(q() for _, _, q in workers) / WORKERS), sent_total / steps


class _Acc:
    """Accordion's per-layer rule (the library's ``AccordionState``) over the sim's
    one flat vector: per block, the density its layer's decision puts in force."""

    def __init__(self, low: float, high: float, params: list[torch.Tensor], args: Any) -> None:
        self.low, self.high, self.observe_mean = low, high, args.acc_observe == "mean"
        self.state = AccordionState(args.acc_interval, args.acc_threshold)
        sizes = [p.numel() for p in params]
        starts = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
        self.state.set_segments(0, starts)
        self.n = sum(sizes)
        first = torch.arange(-(-self.n // BLOCK), dtype=torch.int64) * BLOCK
        self.layer = torch.searchsorted(starts, first, right=True) - 1

    def observe(self, grads: list[torch.Tensor]) -> None:
        g = torch.stack(grads).mean(0) if self.observe_mean else grads[0]
        self.state.observe(0, g)

    def densities(self) -> torch.Tensor:
        held = self.state.layers(0)
        if held is None:
            return torch.full((self.layer.numel(),), self.low)
        crit = held[1]
        return torch.where(crit[self.layer], self.low, self.high)


def _accordion(name: str, density: str, params: list[torch.Tensor], args: Any) -> _Acc | None:
    if name != "acc":
        return None
    low, high = (float(x) for x in density.split("/"))
    return _Acc(low, high, params, args)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("rows", nargs="*", default=["adam:1", "adam:0.1", "select:0.1"])
    parser.add_argument("--task", choices=sorted(TASKS), default="demo")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sgd-lr", type=float, default=0.01)
    parser.add_argument("--lag", action="store_true", help="choose each set one step early")
    parser.add_argument("--acc-interval", type=int, default=10)
    parser.add_argument("--acc-threshold", type=float, default=0.5)
    parser.add_argument("--acc-observe", choices=("own", "mean"), default="own")
    parser.add_argument(
        "--max-age", type=int, default=MAX_AGE, help="the largest age a catch-up step takes"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 60 if args.quick else args.steps
    out: dict[str, float] = {}
    for row in args.rows:
        name, density = row.split(":")
        if name not in ("adam", "catchup", "select", "sgd", "acc"):
            raise SystemExit(f"unknown optimizer {name!r} in row {row!r}")
        out[row], mean_d = run(
            args.task, name, density, steps, args.seed, args.sgd_lr, args.lag, args, args.max_age
        )
        print(f"{row:24s} quality {out[row]:.4f} mean density {mean_d:.4f}", flush=True)
    emit_json(
        {"task": args.task, "steps": steps, "seed": args.seed, "lag": args.lag, "quality": out}
    )


if __name__ == "__main__":
    main()
