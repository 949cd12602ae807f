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
byte the peers sent during training (``net.stats()["wire"]["sent_bytes"]``: data,
copies, ENDs, resyncs, heartbeats and other control, the packets the fault plan
lost included), summed over peers, divided by the steps.  Two ratios per row:
``report_ratio``, what the reports say (the sum of their ``bytes_dense`` over the
sum of their ``bytes_sent``, every call and the final resync, summed over peers:
the collectives' own traffic), and ``wire_ratio``, the dense row's bytes per step
(same task and loss) over this row's (the whole run, control included).

Rows: ``dense``, ``bf16``, ``int8``, ``arctopk`` (density ``--density``),
``dct`` (same density), ``accordion`` (ArcTopK, low 10x the density, high the
density, 10 rounds per interval; ``accordion@LOW/HIGH/INTERVAL`` sets all three)
and the static ArcTopK settings Accordion is compared with (``arctopk@d``; by
default the low and middle densities).  Accordion and its static peers run at
0% loss only.  The rows that decide a target (``dense``, ``arctopk``,
``accordion*``, ``arctopk@d``) run ``--seeds`` seeds
(default 3) and report the median and spread; the others one.  A ``-plain``
suffix (``arctopk-plain``) runs ArcTopK with ``catch_up=False``: stock AdamW on
the sparse sums.  Every row steps AdamW through ``net.all_reduce(..., step=opt)``,
which also resyncs the parameters at the first step and, in the lossy rows, every
100 steps (``Config.resync_every_steps``): lossy rounds let replicas drift apart;
and ends with ``net.resync(opt)`` (one model for every peer before the evaluation,
as the demo does); the resyncs' bytes count.  ``--copies 2``: compressed rounds send every
packet twice while loss is seen (``Config.compressed_copies``; default once).  Every peer
builds its model from one seed under a lock (the peers are threads sharing torch's
RNG); each run prints ``spread``, the largest difference of a parameter between two
replicas before the final resync, and ``after_resync``, the same after it (0), and
what loss did to the run (:data:`LOSS_KEYS`: ``stale``, the share of chunks a peer
stepped with its own values; ``lost``, of packets that never arrived; the phases that
timed out and the compressors' own counts); the JSON rows carry ``stale_frac`` and
``lost_frac``.  ``--resync-every N`` gives every row the same resync period.
``--values fp32|bf16|int8`` sets how every sparse row (ArcTopK, DCT, Accordion)
sends its values (``values=``; the JSON's ``values``); the ``--testbed`` part's
gossipnet methods use it too.

The last stdout line is one JSON object with ``bytes_ratio`` (dense bytes per
step / ARC-Top-K bytes per step, demo task, 0% loss), ``rel_quality_10pct``
(ARC-Top-K at 10% loss / dense at 0%, demo perplexity, seed medians),
``accordion_bytes_ratio`` (bytes of the cheapest static ArcTopK setting whose
final quality is within 1% of Accordion's, / Accordion's bytes; null if none),
``accordion_bytes_ratio_interp`` (the static bytes at exactly Accordion's
quality, interpolated between the static rows around it, / Accordion's bytes: a
coarse grid of static rows cannot inflate it), both for the first Accordion row
(``accordion_row``; every Accordion row's in ``accordion_ratios``), Accordion
rows' mean share of the model in critical layers (``critical_share``),
``values`` and ``rows``.  The time-to-target part on the namespace testbed (capped links,
gloo and DDP+PowerSGD baselines) is ``--testbed`` (``_compression_testbed.py``).

    .venv/bin/python bench/compression.py --quick        # the regression task, 60 steps, ~1 min
    .venv/bin/python bench/compression.py                # both tasks, longer runs
    .venv/bin/python bench/compression.py --rows dense arctopk --losses 0.1 --seeds 5
    .venv/bin/python bench/compression.py --quick --rows dense arctopk --values int8
    .venv/bin/python bench/compression.py --tasks demo --losses 0 --seeds 5 --values int8 \
        --rows accordion@0.1/0.015/20 arctopk@0.04 arctopk@0.05 arctopk@0.06 arctopk@0.07

``--every-row`` runs every row at every loss with ``--seeds`` seeds (the figures of
both byte ratios for every compressor in docs/benchmarks.md).  ``--seed-from K`` starts
at seed K, so a second run adds seeds to a first one (each prints one line per seed;
medians over both are the reader's).
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
import threading
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
#: torch's global RNG is one per process and the peers are threads: ``manual_seed``
#: then building a model races between them (each replica would start from different
#: weights, and the gradient all-reduce below never reconciles them), so models are
#: built under this lock.  ``replica_spread`` in each result checks the outcome.
_INIT = threading.Lock()


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
    copies: int = 1  # Config.compressed_copies
    resync_every: int | None = None  # Config.resync_every_steps; None: the rule above


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
    if row == "accordion" or row.startswith("accordion@"):
        # accordion@LOW/HIGH[/INTERVAL]; plain: low 10x the density, high the density
        lo_d, hi_d, every = min(1.0, 10 * density), density, 10
        if "@" in row:
            parts = row.split("@", 1)[1].split("/")
            lo_d, hi_d = float(parts[0]), float(parts[1])
            every = int(parts[2]) if len(parts) > 2 else every
        kw = {"block": block, "eta": eta, "values": values, "catch_up": catch_up}
        low = gossipnet.ArcTopK(density=lo_d, **kw)
        high = gossipnet.ArcTopK(density=hi_d, **kw)
        return gossipnet.Accordion(low=low, high=high, interval=every)
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
        with _INIT:
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
        with _INIT:
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
#: What loss did to a run, summed over its rounds and peers (printed per run): the
#: chunks a peer stepped with its own values (``stale``, of ``chunks``), phases that
#: ended at their deadline, packets lost on the wire (copies and parity may still
#: have stood in), and the compressors' own counts of what loss cost them.
#: The counts a round's ``extra`` carries (the engine's and the compressors').
EXTRA_KEYS = (
    "arrived_behind", "index_mismatch", "missed_announcement", "sketch_only", "ef_unresolved"
)  # fmt: skip
LOSS_KEYS = ("chunks", "stale", "timed_out", "packets_lost", "packets_expected", *EXTRA_KEYS)


def tally(seen: dict[str, float], rep: Any) -> None:
    """Add one round's report to ``seen`` (:data:`LOSS_KEYS`)."""
    seen["chunks"] += rep.chunks_total
    seen["stale"] += rep.chunks_stale
    seen["timed_out"] += bool(rep.timed_out)
    seen["packets_lost"] += rep.packets_lost
    seen["packets_expected"] += rep.packets_received + rep.packets_lost
    for k in EXTRA_KEYS:
        seen[k] += rep.extra.get(k, 0.0)


def add_bytes(reported: dict[str, float], rep: Any) -> None:
    """Add one report's bytes: ``bytes_sent``, and ``bytes_dense`` (a dense call's
    own bytes where it has none)."""
    sent = rep.extra.get("bytes_sent", 0.0)
    reported["sent"] += sent
    reported["dense"] += rep.extra.get("bytes_dense", sent)


def run_setting(s: Setting) -> Result:
    """Train ``s`` on 4 in-process peers; quality is the mean over peers at the end."""
    make = TASKS[s.task](s.seed, s.steps)
    spec = compressor(s.row, s.density, s.block, s.eta, s.values)
    lr = 3e-3 if s.task == "demo" else 1e-3
    warm = DemoConfig(steps=s.steps, lr=lr, warmup_steps=10)

    def body(
        rank: int, net: gossipnet.Peer
    ) -> tuple[float, int, dict[str, float], torch.Tensor, torch.Tensor]:
        torch.set_num_threads(1)
        model, batch_loss, quality = make(rank, s.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        params = [p for p in model.parameters() if p.requires_grad]
        wire0 = net.stats()["wire"]
        ratios: list[float] = []
        reported = {"sent": 0.0, "dense": 0.0}  # the reports' bytes, summed
        critical: list[float] = []
        seen: dict[str, float] = dict.fromkeys(LOSS_KEYS, 0.0)
        for step in range(s.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(warm, step)
            opt.zero_grad(set_to_none=False)
            batch_loss().backward()
            # step=opt: Adam's catch-up step on the sparse sums (README, compression)
            rep = net.all_reduce([p.grad for p in params], compress=spec, step=opt)  # type: ignore[misc]
            ratios.append(rep.extra.get("compression_ratio", 1.0))
            add_bytes(reported, rep)
            tally(seen, rep)
            if "accordion_critical" in rep.extra:
                critical.append(rep.extra["accordion_critical"])
        # the end of training: one model for every peer (README, all_reduce), as the
        # demo evaluates; its dense round's bytes count in the bytes per step
        drifted = torch.cat([p.detach().reshape(-1) for p in params])
        add_bytes(reported, net.resync(opt))
        wire = net.stats()["wire"]
        sent = wire["sent_bytes"] - wire0["sent_bytes"]
        ours = sum(wire["collective_bytes"].values()) - sum(wire0["collective_bytes"].values())
        extra = {"compression_ratio": statistics.median(ratios), **seen}
        extra.update(report_sent=reported["sent"], report_dense=reported["dense"])
        extra["collective_share"] = ours / max(1, sent)
        if critical:  # Accordion: the share of the model in critical layers, mean over rounds
            extra["critical"] = statistics.fmean(critical)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        return quality(), sent, extra, drifted, flat

    t0, c0 = time.perf_counter(), time.process_time()
    faults = gossipnet.FaultPlan(loss=s.loss, seed=s.seed) if s.loss else None
    # all_reduce(step=opt) resyncs the parameters at the first step and after every
    # resync_every_steps (100) after it: lossy rows keep that default (it repairs the
    # replicas' drift); lossless rounds cause no drift, so those rows resync only once
    resync = {} if s.loss else {"resync_every_steps": 0}
    if s.resync_every is not None:  # --resync-every: the same period for every row
        resync = {"resync_every_steps": s.resync_every}
    out = run_peers(PEERS, body, timeout_s=600, faults=faults, chunk_bytes=s.chunk_bytes,
                    collective_timeout_s=2.0, heartbeat_interval_s=0.5,
                    compressed_copies=s.copies, **resync)  # fmt: skip
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    quality = statistics.fmean(o[0] for o in out)
    per_step = sum(o[1] for o in out) / s.steps
    extra = {"compression_ratio": statistics.median(o[2]["compression_ratio"] for o in out)}
    extra["report_ratio"] = sum(o[2]["report_dense"] for o in out) / max(
        1.0, sum(o[2]["report_sent"] for o in out)
    )
    extra["collective_share"] = statistics.fmean(o[2]["collective_share"] for o in out)
    for k in LOSS_KEYS:  # summed over peers
        extra[k] = sum(o[2][k] for o in out)
    if all("critical" in o[2] for o in out):
        extra["critical"] = statistics.fmean(o[2]["critical"] for o in out)
    # how far the replicas ended apart (largest |difference| of a parameter from
    # rank 0's): 0 where every round gave every peer the same sums
    extra["replica_spread"] = max(float((o[3] - out[0][3]).abs().max()) for o in out)
    # after the final resync: 0, or it did not make one model (printed, never hidden)
    extra["replica_spread_after"] = max(float((o[4] - out[0][4]).abs().max()) for o in out)
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
            "report_ratio": statistics.median(r.extra["report_ratio"] for r in rs),
            "report_ratio_min": min(r.extra["report_ratio"] for r in rs),
            "report_ratio_max": max(r.extra["report_ratio"] for r in rs),
            "collective_share": statistics.median(r.extra["collective_share"] for r in rs),
            "wall_s": statistics.median(r.wall_s for r in rs),
            "cpu_s": statistics.median(r.cpu_s for r in rs),
            "replica_spread_max": max(r.extra["replica_spread"] for r in rs),
            # what loss did: chunks stepped with a peer's own values, packets never arrived
            "stale_frac": statistics.median(
                r.extra["stale"] / max(1.0, r.extra["chunks"]) for r in rs
            ),
            "lost_frac": statistics.median(
                r.extra["packets_lost"] / max(1.0, r.extra["packets_expected"]) for r in rs
            ),
        }
        if all("critical" in r.extra for r in rs):
            rows[f"{task}/{row}/{loss:g}"]["critical_share"] = statistics.median(
                r.extra["critical"] for r in rs
            )

    # the whole run's bytes against the dense row's of the same task and loss, per seed
    # pair where both ran it (else medians), control traffic included on both sides
    for (task, row, loss), rs in groups.items():
        dense = {r.setting.seed: r.bytes_per_step for r in groups.get((task, "dense", loss), [])}
        if not dense:
            continue
        pairs = [dense[r.setting.seed] / r.bytes_per_step for r in rs if r.setting.seed in dense]
        if not pairs:
            pairs = [statistics.median(dense.values()) / r.bytes_per_step for r in rs]
        hit = rows[f"{task}/{row}/{loss:g}"]
        hit["wire_ratio"] = statistics.median(pairs)
        hit["wire_ratio_min"], hit["wire_ratio_max"] = min(pairs), max(pairs)

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
    ratios = accordion_ratios(rows, task)
    if ratios:
        first = next(iter(ratios))  # the first Accordion row run is the headline
        out["accordion_bytes_ratio"] = ratios[first]["ratio"]
        out["accordion_vs"] = ratios[first]["vs"]
        out["accordion_bytes_ratio_interp"] = ratios[first]["ratio_interp"]
        out["accordion_row"] = first
        out["accordion_ratios"] = ratios
    out["rows"] = rows
    out["density"] = density
    out["values"] = values
    return out


def accordion_ratios(rows: dict[str, dict[str, Any]], task: str) -> dict[str, dict[str, Any]]:
    """Per Accordion row (0% loss), against the static ArcTopK rows of the same run:

    - ``ratio``: bytes of the cheapest static row whose median quality is within
      1% of Accordion's (or better), / Accordion's bytes; ``vs``: that row (None
      where no static row is that good);
    - ``ratio_interp``: the static bytes at exactly Accordion's quality,
      interpolated (log bytes, linear in quality) between the two static rows
      around it, / Accordion's bytes: the figure that does not depend on how fine
      the static grid is (None outside the static rows' range).
    """
    out: dict[str, dict[str, Any]] = {}
    static = sorted(
        (float(rows[k]["bytes_per_step"]), float(rows[k]["quality_median"]), k)
        for k in rows
        if k.startswith(f"{task}/arctopk") and k.endswith("/0") and "-plain" not in k
    )
    for key, acc in rows.items():
        if not (key.startswith(f"{task}/accordion") and key.endswith("/0")):
            continue
        row = key.split("/", 1)[1].rsplit("/", 1)[0]
        acc_q, acc_b = float(acc["quality_median"]), float(acc["bytes_per_step"])
        equal = [(b, k) for b, q, k in static if q <= acc_q * 1.01]
        hit: dict[str, Any] = {"ratio": None, "vs": None, "ratio_interp": None}
        if equal and acc_b:
            hit["ratio"], hit["vs"] = min(equal)[0] / acc_b, min(equal)[1]
        for (b0, q0, _), (b1, q1, _) in itertools.pairwise(static):
            if min(q0, q1) <= acc_q <= max(q0, q1) and q0 != q1 and acc_b:
                t = (acc_q - q0) / (q1 - q0)
                hit["ratio_interp"] = math.exp(math.log(b0) + t * math.log(b1 / b0)) / acc_b
                break
        out[row] = hit
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--tasks", nargs="+", default=None, choices=sorted(TASKS))
    parser.add_argument("--rows", nargs="+", default=None)
    parser.add_argument("--losses", nargs="+", type=float, default=[0.0, 0.1])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the dense and arctopk rows")
    parser.add_argument(
        "--seed-from", type=int, default=0, help="first seed (more seeds in a second run)"
    )
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
        "--copies",
        type=int,
        default=1,
        help="Config.compressed_copies: copies of compressed packets while loss is seen",
    )
    parser.add_argument(
        "--resync-every",
        type=int,
        default=None,
        help="Config.resync_every_steps for every row (default: 100 lossy, 0 lossless)",
    )
    parser.add_argument(
        "--every-row",
        action="store_true",
        help="every row at every loss with --seeds seeds (default: the rules above)",
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
                if row.startswith(("arctopk@", "accordion")) and loss and not args.every_row:
                    continue  # Accordion is compared at 0% loss
                # every row that decides a target: --seeds (Accordion and its static peers too)
                decides = row in ("dense", "arctopk") or row.startswith(("arctopk@", "accordion"))
                decides = decides or args.every_row
                seeds = args.seeds if decides else 1
                for seed in range(args.seed_from, args.seed_from + seeds):
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
                            args.copies,
                            args.resync_every,
                        )
                    )
    results = []
    for s in settings:
        r = run_setting(s)
        results.append(r)
        print(f"{s.task:8s} {s.row:14s} loss={s.loss:<4g} seed={s.seed} quality={r.quality:.4f}"
              f" bytes/step={r.bytes_per_step:,.0f} ratio={r.extra['compression_ratio']:.1f}"
              f" report_ratio={r.extra['report_ratio']:.2f}"
              f" collective_share={r.extra['collective_share']:.3f}"
              f" wall={r.wall_s:.1f}s cpu={r.cpu_s:.1f}s"
              + f" spread={r.extra['replica_spread']:.2g}"
              + f" after_resync={r.extra['replica_spread_after']:.2g}"
              + (f" critical={r.extra['critical']:.3f}" if "critical" in r.extra else "")
              + f" stale={r.extra['stale'] / max(1.0, r.extra['chunks']):.2%}"
              + f" lost={r.extra['packets_lost'] / max(1.0, r.extra['packets_expected']):.2%}"
              + "".join(f" {k}={r.extra[k]:g}" for k in ("timed_out", *EXTRA_KEYS)),
              flush=True)  # fmt: skip
    emit_json(summarise(results, d, args.values))


if __name__ == "__main__":
    main()
