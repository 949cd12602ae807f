"""SPARQ-SGD with Moshpit: bytes on the wire and final loss against uncompressed Moshpit.

Why: SPARQ-SGD (Singh et al., arXiv 1910.14280) claims the convergence rate of
uncompressed decentralised SGD while sending only compressed, event-triggered
differences.  This bench trains the demo's character-level transformer
(``gossipnet.demo``, a smaller shape so that four replicas train in one process)
on N in-memory peers (``gossipnet.testing.run_peers``: one event-loop thread per
peer, ``MemoryNetwork``, seeded ``FaultPlan`` loss on every link) with
``strategy="moshpit"`` dense and with ``compress=gossipnet.SparQ(...)``, same
model, data and fault seeds, at 0% and 10% packet loss (``--strategy route``: the
same with route gossip between four vehicles parked 30 m apart), and reports:

- bytes: every byte the peers' transports sent from the first training step to
  the last (heartbeats, matchmaking, state downloads, repairs: all traffic), summed
  over peers; ``sparq_bytes_ratio`` = dense bytes / SparQ bytes (median over seeds);
- quality: each peer's final held-out loss (its own replica), averaged over peers;
  ``sparq_quality_change`` = SparQ loss / dense loss - 1 at the same loss rate, paired
  by seed (median over seeds); negative is better.

    .venv/bin/python bench/sparq.py --quick         # 2 seeds x {0, 10%} x 2, ~1-2 min
    .venv/bin/python bench/sparq.py --seeds 5 --rerun   # the rows docs/benchmarks.md reports
    .venv/bin/python bench/sparq.py --strategy route    # route gossip, 4 parked vehicles

``--rerun`` trains dense a second time per seed: the same seeds do not give the same
final loss twice (the group all-reduce adds in arrival order, and 300 steps of AdamW
amplify the last bits), so the dense re-run's change is the noise floor of
``sparq_quality_change``.

The last stdout line is one JSON object with ``sparq_bytes_ratio``,
``sparq_quality_change`` (0% loss), their ``_10pct`` twins, and every run's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, emit_json

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

#: In-process peers: the default heartbeats, collective bound as the demo's.
NET = {"collective_timeout_s": 2.0, "handle_sigterm": False}


def train_row(
    cfg: DemoConfig, sparq: gossipnet.SparQ | None, average_every: int, strategy: str = "moshpit"
) -> dict[str, Any]:
    """One run: N peers train ``cfg.steps`` steps; bytes, losses, SparQ counters."""
    train, held = load_corpus(cfg.corpus_bytes)
    held_out = eval_windows(held, cfg.eval_windows, cfg.context)
    torch.manual_seed(cfg.model_seed)  # here, once: torch's global RNG races between threads
    start = CharLM(cfg).state_dict()

    def body(rank: int, net: gossipnet.Peer) -> dict[str, Any]:
        torch.set_num_threads(1)
        shard = shard_stream(train, rank, cfg)
        gen = torch.Generator().manual_seed(cfg.data_seed * 1000 + rank)
        model = CharLM(cfg)
        model.load_state_dict(start)  # the same initial weights on every peer
        base = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        kw: dict[str, Any] = {"average_every": average_every}
        if strategy == "moshpit":
            kw["sync_state"] = False
        else:  # parked 30 m apart on a line: every pair in radio range
            net.set_route(gossipnet.Route(np.array([0.0]), np.array([[30.0 * rank, 0.0]])))
        if sparq is not None:
            kw["compress"] = sparq
        opt = net.optimizer(base, strategy=strategy, **kw)
        net.wait_for_peers(cfg.peers, 30.0)
        sent0 = net.stats()["transport"]["sent_bytes"]
        counted, triggered, syncs = 0.0, 0, 0
        for step in range(cfg.steps):
            for g in base.param_groups:
                g["lr"] = lr_at(cfg, step)
            batch = sample_windows(shard, cfg.batch, cfg.context, gen)
            opt.zero_grad()
            model.loss(batch).backward()
            rep = opt.step()
            if rep.method == "sparq":
                counted += rep.extra["bytes_sent"]
                triggered += int(rep.extra["triggered"])
                syncs += 1
        sent = net.stats()["transport"]["sent_bytes"] - sent0
        return {
            "eval_loss": evaluate(model, held_out),
            "sent_bytes": sent,
            "sparq_counted_bytes": counted,
            "triggered": triggered,
            "syncs": syncs,
            "params": sum(p.numel() for p in model.parameters()),
        }

    faults = gossipnet.FaultPlan(seed=cfg.seed, loss=cfg.loss) if cfg.loss else None
    t0, c0 = time.monotonic(), time.process_time()
    out = run_peers(cfg.peers, body, timeout_s=600, faults=faults, **NET)
    return {
        "eval_loss": statistics.fmean(o["eval_loss"] for o in out),
        "eval_spread": max(o["eval_loss"] for o in out) - min(o["eval_loss"] for o in out),
        "sent_bytes": sum(o["sent_bytes"] for o in out),
        "sparq_counted_bytes": sum(o["sparq_counted_bytes"] for o in out),
        "trigger_rate": sum(o["triggered"] for o in out) / max(1, sum(o["syncs"] for o in out)),
        "params": out[0]["params"],
        "wall_s": time.monotonic() - t0,
        "cpu_s": time.process_time() - c0,
    }


def summarise(runs: list[dict[str, Any]], loss: float) -> dict[str, Any]:
    """Paired (by seed) ratios and quality changes at one loss rate: median, min, max."""
    by = {(r["variant"], r["seed"]): r for r in runs if r["loss"] == loss}
    seeds = sorted({r["seed"] for r in runs if r["loss"] == loss})
    ratios = [by["dense", s]["sent_bytes"] / by["sparq", s]["sent_bytes"] for s in seeds]
    changes = [by["sparq", s]["eval_loss"] / by["dense", s]["eval_loss"] - 1.0 for s in seeds]
    floor = [
        by["dense2", s]["eval_loss"] / by["dense", s]["eval_loss"] - 1.0
        for s in seeds
        if ("dense2", s) in by
    ]
    return {
        "dense_rerun_change": [round(f, 5) for f in floor],
        "bytes_ratio": statistics.median(ratios),
        "bytes_ratio_range": [min(ratios), max(ratios)],
        "quality_change": statistics.median(changes),
        "quality_change_range": [min(changes), max(changes)],
        "seeds": seeds,
    }


def parse_args() -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--average-every", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--c0", type=float, default=0.0, help="SparQ.threshold_c0")
    parser.add_argument("--losses", default="0,0.1")
    parser.add_argument("--strategy", choices=("moshpit", "route"), default="moshpit")
    parser.add_argument(
        "--rerun", action="store_true",
        help="run dense twice per seed: the run-to-run change of dense itself (noise floor)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps = 2, min(args.steps, 80)
    return args


def run_all(
    args: argparse.Namespace, sparq: gossipnet.SparQ, shape: dict[str, int]
) -> list[dict[str, Any]]:
    """Every (loss, seed, variant) run, printed as it ends."""
    runs: list[dict[str, Any]] = []
    for loss in [float(x) for x in args.losses.split(",")]:
        for seed in range(args.seeds):
            cfg = DemoConfig(
                peers=args.peers, steps=args.steps, loss=loss, seed=100 + seed,
                data_seed=seed, model_seed=seed, warmup_steps=10, **shape,
            )  # fmt: skip
            variants: list[tuple[str, gossipnet.SparQ | None]] = [("dense", None), ("sparq", sparq)]
            if args.rerun:
                variants.append(("dense2", None))
            for variant, comp in variants:
                row = train_row(cfg, comp, args.average_every, args.strategy)
                row.update(variant=variant, loss=loss, seed=seed)
                runs.append(row)
                print(
                    f"loss {loss:4.0%} seed {seed} {variant:5s}: eval {row['eval_loss']:.4f}"
                    f" (spread {row['eval_spread']:.4f}), {row['sent_bytes'] / 1e6:8.2f} MB sent,"
                    f" trigger {row['trigger_rate']:.2f}, {row['wall_s']:.1f} s wall,"
                    f" {row['cpu_s']:.1f} s CPU",
                    flush=True,
                )
    return runs


def main() -> None:
    args = parse_args()
    sparq = gossipnet.SparQ(density=args.density, gamma=args.gamma, threshold_c0=args.c0)
    shape = {"d_model": 48, "layers": 1, "heads": 4, "context": 32, "batch": 16}
    runs = run_all(args, sparq, shape)
    summary: dict[str, Any] = {"settings": {**vars(args), "sparq": repr(sparq), **shape}}
    for loss in sorted({r["loss"] for r in runs}):
        s = summarise(runs, loss)
        tag = "" if loss == 0 else f"_{round(loss * 100)}pct"
        summary[f"sparq_bytes_ratio{tag}"] = s["bytes_ratio"]
        summary[f"sparq_quality_change{tag}"] = s["quality_change"]
        summary[f"detail{tag or '_0pct'}"] = s
        rerun = s["dense_rerun_change"]
        print(
            f"loss {loss:4.0%}: dense/SparQ bytes {s['bytes_ratio']:.1f}x"
            f" (range {s['bytes_ratio_range'][0]:.1f}-{s['bytes_ratio_range'][1]:.1f}),"
            f" final loss change {s['quality_change']:+.2%}"
            f" (range {s['quality_change_range'][0]:+.2%} to {s['quality_change_range'][1]:+.2%})"
            + (f"; dense re-run changes {rerun}" if rerun else "")
        )
    summary["runs"] = runs
    emit_json(summary)


if __name__ == "__main__":
    main()
