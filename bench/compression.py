"""Compression under packet loss: final quality and bytes per step, dense vs each compressor.

Why: compressing gradients is only worth it if the model still learns and the
bytes really shrink, including under loss, where a lost compressed packet must
cost only its own values (ALGORITHMS.md section 6).  Quality part (this file):
4 peers in one process (``gossipnet.testing.run_peers``: joined peers, each with
its own loop thread, on a memory network), a DDP-style loop per peer
(``loss.backward(); net.all_reduce(grads, compress=...); AdamW.step()``: both
phases of the round compressed), same model, data and fault seeds for every
row, at 0% and 10% seeded random loss.  Two tasks: the demo's character-level
transformer (``gossipnet.demo``; quality = held-out perplexity) and a synthetic
teacher-student regression (quality = held-out MSE).  Bytes per step: every
byte the peers' transports sent during training (data, ENDs, heartbeats),
summed over peers, divided by the steps.

Rows: ``dense``, ``bf16``, ``int8``, ``arctopk`` (density ``--density``),
``dct`` (same density), ``accordion`` (ArcTopK, low 10x the density, high the
density) and the static ArcTopK settings Accordion is compared with
(``arctopk@d`` for d in the low and middle densities).  The rows that decide a
target (``dense``, ``arctopk``, ``accordion``, ``arctopk@d``) run ``--seeds`` seeds
(default 3) and report the median and spread; the others one.  A ``-plain``
suffix (``arctopk-plain``) runs ArcTopK with ``catch_up=False``: stock AdamW on
the sparse sums.  Every row steps AdamW through ``net.all_reduce(..., step=opt)``.
``--values fp32|bf16|int8`` sets how every sparse row (ArcTopK, DCT, Accordion)
sends its values (``values=``; the JSON's ``values``); the ``--testbed`` part's
gossipnet methods use it too.

The last stdout line is one JSON object with ``bytes_ratio`` (dense bytes per
step / ARC-Top-K bytes per step, demo task, 0% loss), ``rel_quality_10pct``
(ARC-Top-K at 10% loss / dense at 0%, demo perplexity, seed medians),
``accordion_bytes_ratio`` (bytes of the cheapest static ArcTopK setting whose
final quality is within 1% of Accordion's, / Accordion's bytes; null if none),
``values`` and ``rows``.  The time-to-target part on the namespace testbed (capped links,
gloo and DDP+PowerSGD baselines) is ``--testbed`` (``_compression_testbed.py``).

    .venv/bin/python bench/compression.py --quick        # the regression task, 60 steps, ~1 min
    .venv/bin/python bench/compression.py                # both tasks, longer runs
    .venv/bin/python bench/compression.py --rows dense arctopk --losses 0.1 --seeds 5
    .venv/bin/python bench/compression.py --quick --rows dense arctopk --values int8
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, when imported from elsewhere

from _common import bench_parser, emit_json
from _compression_testbed import add_testbed_args

import gossipnet
from gossipnet.demo.harness import (
    CharLM,
    DemoConfig,
    eval_windows,
    evaluate,
    load_corpus,
    lr_at,
    sample_windows,
    shard_stream,
)
from gossipnet.testing import run_peers

PEERS = 4


@dataclass(frozen=True)
class Setting:
    """One run: task, compressor row, loss rate, seed, steps."""

    task: str
    row: str
    loss: float
    seed: int
    steps: int
    density: float
    chunk_bytes: int
    block: int = 16
    eta: float = 1.0
    values: str = "fp32"


@dataclass
class Result:
    setting: Setting
    quality: float  # perplexity (demo) or MSE (regress), mean over peers
    bytes_per_step: float
    wall_s: float
    cpu_s: float
    extra: dict[str, float] = field(default_factory=dict)


def compressor(
    row: str, density: float, block: int = 16, eta: float = 1.0, values: str = "fp32"
) -> Any:
    """The ``compress=`` value of a row name (``arctopk@0.05``: a static density;
    a ``-plain`` suffix: ``catch_up=False``, stock AdamW on the sparse sums);
    ``values``: the sparse rows' value codec."""
    catch_up = not row.endswith("-plain")
    row = row.removesuffix("-plain")
    if row == "dense":
        return None
    if row in ("bf16", "fp16"):
        return row
    if row == "int8":
        return gossipnet.Int8()
    if row.startswith("arctopk"):
        d = float(row.split("@", 1)[1]) if "@" in row else density
        return gossipnet.ArcTopK(density=d, block=block, eta=eta, values=values, catch_up=catch_up)
    if row == "dct":
        return gossipnet.DCT(density=density, refresh_every=50, values=values)
    if row == "accordion":
        kw = {"block": block, "eta": eta, "values": values, "catch_up": catch_up}
        low = gossipnet.ArcTopK(density=min(1.0, 10 * density), **kw)
        high = gossipnet.ArcTopK(density=density, **kw)
        return gossipnet.Accordion(low=low, high=high, interval=10)
    raise SystemExit(f"unknown row {row!r}")


# ---------------------------------------------------------------------- tasks
Task = Callable[[int, int], tuple[torch.nn.Module, Callable[[], torch.Tensor], Callable[[], float]]]


def demo_task(seed: int, steps: int) -> Task:
    """The demo's CharLM, small: (model, next batch loss, held-out perplexity) per rank."""
    cfg = DemoConfig(peers=PEERS, steps=steps, batch=16, context=64, d_model=64, layers=2,
                     heads=4, lr=3e-3, warmup_steps=10, corpus_bytes=1_000_000,
                     data_seed=seed, model_seed=0)  # fmt: skip
    train, held = load_corpus(cfg.corpus_bytes)
    windows = eval_windows(held, 64, cfg.context)

    def make(rank: int, _: int) -> Any:
        shard = shard_stream(train, rank, cfg)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        torch.manual_seed(cfg.model_seed)
        model = CharLM(cfg)
        return (
            model,
            lambda: model.loss(sample_windows(shard, cfg.batch, cfg.context, gen)),
            lambda: math.exp(evaluate(model, windows)),
        )

    return make


def regress_task(seed: int, steps: int) -> Task:
    """Teacher-student regression: a random 2-layer teacher, a wider student MLP."""
    dim = 32
    teacher = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    torch.manual_seed(1234)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.5)
    xt = torch.randn(1024, dim, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        yt = teacher(xt)

    def make(rank: int, _: int) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(dim, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
            torch.nn.ReLU(), torch.nn.Linear(256, 4),
        )  # fmt: skip
        gen = torch.Generator().manual_seed(seed * 1000 + rank)

        def batch_loss() -> torch.Tensor:
            x = torch.randn(64, dim, generator=gen)
            with torch.no_grad():
                y = teacher(x) + 0.05 * torch.randn(64, 4, generator=gen)
            return torch.nn.functional.mse_loss(model(x), y)

        @torch.no_grad()
        def quality() -> float:
            return float(torch.nn.functional.mse_loss(model(xt), yt))

        return model, batch_loss, quality

    return make


TASKS: dict[str, Callable[[int, int], Task]] = {"demo": demo_task, "regress": regress_task}


# ---------------------------------------------------------------------- one row
def run_setting(s: Setting) -> Result:
    """Train ``s`` on 4 in-process peers; quality is the mean over peers at the end."""
    make = TASKS[s.task](s.seed, s.steps)
    spec = compressor(s.row, s.density, s.block, s.eta, s.values)
    lr = 3e-3 if s.task == "demo" else 1e-3
    warm = DemoConfig(steps=s.steps, lr=lr, warmup_steps=10)

    def body(rank: int, net: gossipnet.Peer) -> tuple[float, int, dict[str, float]]:
        torch.set_num_threads(1)
        model, batch_loss, quality = make(rank, s.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        params = [p for p in model.parameters() if p.requires_grad]
        sent0 = net.stats()["transport"]["sent_bytes"]
        ratios: list[float] = []
        for step in range(s.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(warm, step)
            opt.zero_grad(set_to_none=False)
            batch_loss().backward()
            # step=opt: Adam's catch-up step on the sparse sums (README, compression)
            rep = net.all_reduce([p.grad for p in params], compress=spec, step=opt)  # type: ignore[misc]
            ratios.append(rep.extra.get("compression_ratio", 1.0))
        sent = net.stats()["transport"]["sent_bytes"] - sent0
        return quality(), sent, {"compression_ratio": statistics.median(ratios)}

    t0, c0 = time.perf_counter(), time.process_time()
    faults = gossipnet.FaultPlan(loss=s.loss, seed=s.seed) if s.loss else None
    out = run_peers(PEERS, body, timeout_s=600, faults=faults, chunk_bytes=s.chunk_bytes,
                    collective_timeout_s=2.0, heartbeat_interval_s=0.5)  # fmt: skip
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    quality = statistics.fmean(o[0] for o in out)
    per_step = sum(o[1] for o in out) / s.steps
    extra = {"compression_ratio": statistics.median(o[2]["compression_ratio"] for o in out)}
    return Result(s, quality, per_step, wall, cpu, extra)


def run_testbed(args: Any) -> dict[str, Any]:
    """Hook for the time-to-target part on the namespace testbed (another part of #22)."""
    from _compression_testbed import run_testbed as run_capped

    return run_capped(args)


# ---------------------------------------------------------------------- summary
def summarise(results: list[Result], density: float, values: str = "fp32") -> dict[str, Any]:
    """Rows (median and spread over seeds) and the headline keys."""
    groups: dict[tuple[str, str, float], list[Result]] = {}
    for r in results:
        groups.setdefault((r.setting.task, r.setting.row, r.setting.loss), []).append(r)
    rows: dict[str, dict[str, Any]] = {}
    for (task, row, loss), rs in groups.items():
        q = [r.quality for r in rs]
        rows[f"{task}/{row}/{loss:g}"] = {
            "quality_median": statistics.median(q),
            "quality_min": min(q),
            "quality_max": max(q),
            "seeds": len(rs),
            "bytes_per_step": statistics.median(r.bytes_per_step for r in rs),
            "compression_ratio": statistics.median(r.extra["compression_ratio"] for r in rs),
            "wall_s": statistics.median(r.wall_s for r in rs),
            "cpu_s": statistics.median(r.cpu_s for r in rs),
        }

    def get(task: str, row: str, loss: float, key: str) -> float | None:
        hit = rows.get(f"{task}/{row}/{loss:g}")
        return None if hit is None else float(hit[key])

    task = "demo" if any(k.startswith("demo/") for k in rows) else "regress"
    dense_b, topk_b = (
        get(task, "dense", 0.0, "bytes_per_step"),
        get(task, "arctopk", 0.0, "bytes_per_step"),
    )
    dense_q, topk_q = (
        get(task, "dense", 0.0, "quality_median"),
        get(task, "arctopk", 0.1, "quality_median"),
    )
    out: dict[str, Any] = {
        "task": task,
        "bytes_ratio": dense_b / topk_b if dense_b and topk_b else None,
        "rel_quality_10pct": topk_q / dense_q if dense_q and topk_q else None,
        "accordion_bytes_ratio": None,
    }
    acc_q, acc_b = (
        get(task, "accordion", 0.0, "quality_median"),
        get(task, "accordion", 0.0, "bytes_per_step"),
    )
    if acc_q is not None and acc_b:
        static = [k for k in rows if k.startswith(f"{task}/arctopk") and k.endswith("/0")]
        equal = [
            (float(rows[k]["bytes_per_step"]), k)
            for k in static
            if rows[k]["quality_median"] <= acc_q * 1.01
        ]
        if equal:
            out["accordion_bytes_ratio"] = min(equal)[0] / acc_b
            out["accordion_vs"] = min(equal)[1]
    out["rows"] = rows
    out["density"] = density
    out["values"] = values
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--tasks", nargs="+", default=None, choices=sorted(TASKS))
    parser.add_argument("--rows", nargs="+", default=None)
    parser.add_argument("--losses", nargs="+", type=float, default=[0.0, 0.1])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the dense and arctopk rows")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    parser.add_argument("--block", type=int, default=16, help="ArcTopK block (elements)")
    parser.add_argument("--eta", type=float, default=1.0, help="ArcTopK EF21M momentum")
    parser.add_argument(
        "--values",
        default="fp32",
        choices=("fp32", "bf16", "int8"),
        help="how the sparse rows (ArcTopK, DCT, Accordion; testbed: gn_*) send values",
    )
    parser.add_argument(
        "--testbed",
        action="store_true",
        help="time to target on the namespace testbed (root; bench/_compression_testbed.py)",
    )
    add_testbed_args(parser)
    args = parser.parse_args()
    if args.testbed:
        emit_json(run_testbed(args))
        return
    tasks = args.tasks or (["regress", "demo"] if not args.quick else ["regress"])
    d = args.density
    rows = args.rows or [
        "dense", "bf16", "int8", "arctopk", "dct", "accordion",
        f"arctopk@{10 * d:g}", f"arctopk@{3 * d:g}",
    ]  # fmt: skip
    steps = args.steps or (60 if args.quick else 300)
    settings = []
    for task in tasks:
        for row in rows:
            for loss in args.losses:
                if (row.startswith("arctopk@") or row == "accordion") and loss:
                    continue  # Accordion is compared at 0% loss
                # every row that decides a target: --seeds (Accordion and its static peers too)
                decides = row in ("dense", "arctopk", "accordion") or row.startswith("arctopk@")
                seeds = args.seeds if decides else 1
                for seed in range(seeds):
                    settings.append(
                        Setting(
                            task,
                            row,
                            loss,
                            seed,
                            steps,
                            d,
                            args.chunk_bytes,
                            args.block,
                            args.eta,
                            args.values,
                        )
                    )
    results = []
    for s in settings:
        r = run_setting(s)
        results.append(r)
        print(f"{s.task:8s} {s.row:14s} loss={s.loss:<4g} seed={s.seed} quality={r.quality:.4f}"
              f" bytes/step={r.bytes_per_step:,.0f} ratio={r.extra['compression_ratio']:.1f}"
              f" wall={r.wall_s:.1f}s cpu={r.cpu_s:.1f}s", flush=True)  # fmt: skip
    emit_json(summarise(results, d, args.values))


if __name__ == "__main__":
    main()
