"""``bench/compression.py --testbed``: time to a target loss on capped lossy links.

Why: compression is for links where bandwidth is the bottleneck; the question
a user asks is how much sooner the model gets good, not how many bytes a step
saves.  On the namespace testbed (``gossipnet.testbed``, root): 4 hosts on a
switch, every host link capped with ``tc tbf`` (both ends, 50 ms queue) at
each ``--caps`` rate, kernel random loss (nftables on the switch) at each
``--tb-losses`` rate, and in each such row, one after another on the same
links: gossipnet with ArcTopK (``--density``, UDP backend paced at the cap),
optionally gossipnet with DCT, gloo dense (``dist.all_reduce`` of the flat
gradient) and DDP over gloo with PyTorch's PowerSGD hook (rank 1).

Task: ``gossipnet.testbed.train``'s teacher-student classification, student
MLP 32-H-H-10 (H = ``--tb-hidden``, 512: 285 k parameters, 1.14 MB of float32
gradient, so a dense step moves megabytes per host), batch 64 per host, same
seed, initial model and batches for every method.  Optimizer, the same for
every method (gloo, PowerSGD's DDP, gossipnet): ``--optim adam`` (the default,
lr 1e-3) or ``--optim sgd`` (momentum 0.9, lr 0.1; top-k with error feedback
is designed for SGD with momentum: the PowerSGD, DCT and ARC-Top-K papers
train with it); ``--lr`` overrides the rate; no schedule.  ``--values``
(bench/compression.py's flag: ``fp32``, ``bf16``, ``int8``) is the gossipnet
compressors' value codec.  Target:
the mean over hosts of the exact expected cross-entropy (``eval_loss``) at or
below ``--target`` (1.2: dense reaches it in about 25 steps, ArcTopK(0.01)
in about 160 on the memory network), checked every ``--eval-every`` steps
off the clock.  A run that hits the step or time cap first is a lower bound
(``reached: false``; ratios built on it are marked ``>=``).

Per run: steps and seconds to target (training seconds: per segment between
evaluations the slowest host, summed), seconds per step, bytes on the wire
per step (sum over hosts of each ``eth0``'s transmit counter), CPU seconds
per step (``process_time`` of each host's process, all threads, mean over
hosts), the machine's 1-minute load.  Per cell, the median and spread over
``--tb-reps`` reps.  JSON keys ``speedup_vs_gloo_capped_1pct`` and
``speedup_vs_powersgd_capped_1pct``: their time to target / ArcTopK's, at
20 Mbit/s and 1% loss; ``by_method_capped_1pct`` the same for every gossipnet
method run (e.g. ``gn_dct``); ``optim`` (name, lr, momentum) and ``values`` (also
in every run and on every printed row).

    .venv/bin/python bench/compression.py --testbed --quick
    .venv/bin/python bench/compression.py --testbed --quick --optim sgd --density 0.1 \
        --values int8 --methods gn_arctopk,gloo,powersgd1
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _compression_tb_worker import tb_worker, write_json

from gossipnet.testbed import Testbed, measure_loss, unavailable_reason

CHUNK_BYTES = 8192  # one datagram per 9000-byte frame (bench/testbed.py's chunk_for_mtu)
HEADLINE = (20.0, 0.01)
#: Per optimizer: (default learning rate, momentum); every method trains with it.
OPTIMS = {"adam": (1e-3, 0.0), "sgd": (0.1, 0.9)}


def add_testbed_args(p: Any) -> None:
    """The ``--testbed`` part's flags (on bench/compression.py's parser)."""
    p.add_argument("--caps", default=None, help="link caps, Mbit/s (quick: 20; full: 100,20)")
    p.add_argument("--tb-losses", default=None, help="kernel loss (quick: 0,0.01; 0,0.01,0.05)")
    p.add_argument("--methods", default=None, help="gn_arctopk,gn_dct,gloo,powersgd1 ...")
    p.add_argument("--tb-reps", type=int, default=None, help="reps per cell (quick 1, full 2)")
    p.add_argument("--tb-hidden", type=int, default=512, help="student MLP width")
    p.add_argument("--target", type=float, default=1.2, help="target eval loss")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=400, help="step cap of a run")
    p.add_argument("--max-s", type=float, default=None, help="training-second cap of a run")
    p.add_argument(
        "--optim",
        default="adam",
        choices=sorted(OPTIMS),
        help="every method's optimizer: adam (lr 1e-3) or sgd (momentum 0.9, lr 0.1)",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default per --optim)")


def optim_settings(a: Any) -> dict[str, Any]:
    """``{"name", "lr", "momentum"}`` of the optimizer every method trains with."""
    lr, momentum = OPTIMS[a.optim]
    if a.lr is not None:
        if not a.lr > 0:
            raise SystemExit(f"--lr must be > 0, got {a.lr}")
        lr = a.lr
    return {"name": a.optim, "lr": lr, "momentum": momentum}


def time_to_target(per_rank: list[list[list[float]]], target: float) -> dict[str, Any]:
    """Combine the hosts' segments ``[step, seconds, cpu, loss]`` into one run.

    A segment lasts as long as its slowest host (a collective ends with its
    last member); the loss is the mean over hosts.  Returns the steps and
    seconds at the first evaluation at or below ``target`` (``reached``), or
    at the last one (a lower bound, ``reached: False``), and per-step means.
    """
    if not per_rank or not per_rank[0]:
        raise ValueError("no segments")
    n = min(len(segs) for segs in per_rank)
    total = cpu = 0.0
    steps, loss = 0, float("nan")
    for i in range(n):
        rows = [segs[i] for segs in per_rank]
        steps = int(rows[0][0])
        total += max(r[1] for r in rows)
        cpu += sum(r[2] for r in rows) / len(rows)
        loss = sum(r[3] for r in rows) / len(rows)
        if loss <= target:
            break
    return {
        "reached": loss <= target,
        "steps": steps,
        "seconds": total,
        "s_per_step": total / steps,
        "cpu_per_step": cpu / steps,
        "loss": loss,
    }


def combine(results: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """One run's figures from every host's result file (or its error)."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"reached": False, "error": errors[0]}
    out = time_to_target([r["segments"] for r in results], target)
    steps_run = min(int(r["segments"][-1][0]) for r in results)
    out["wire_bytes_per_step"] = sum(r["tx_bytes"] for r in results) / steps_run
    if "gn_bytes_sent" in results[0]:
        out["gn_bytes_sent_per_step"] = sum(r["gn_bytes_sent"] for r in results) / steps_run
    return out


def cell_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over reps of a (cap, loss, method) cell."""
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {"reps": len(runs), "errors": [r["error"] for r in runs if "error" in r]}
    if not ok:
        return out | {"reached": False, "seconds": None}
    for key in ("seconds", "steps", "s_per_step", "cpu_per_step", "wire_bytes_per_step", "load"):
        vals = [float(r[key]) for r in ok]
        out[key] = statistics.median(vals)
        out[f"{key}_range"] = [min(vals), max(vals)]
    out["reached"] = all(r["reached"] for r in ok)
    out["loss"] = statistics.median(r["loss"] for r in ok)
    if "gn_bytes_sent_per_step" in ok[0]:
        out["gn_bytes_sent_per_step"] = statistics.median(r["gn_bytes_sent_per_step"] for r in ok)
    return out


def speedup(theirs: dict[str, Any] | None, ours: dict[str, Any] | None) -> dict[str, Any]:
    """Their time to target / ours; a bound when either side missed the target.

    Theirs missed (a lower bound on their time): ratio >= value.  Ours missed:
    ratio <= value.  Both missed: no ratio.
    """
    if not theirs or not ours or not theirs.get("seconds") or not ours.get("seconds"):
        return {"value": None, "bound": "no data"}
    value = theirs["seconds"] / ours["seconds"]
    if theirs["reached"] and ours["reached"]:
        return {"value": value, "bound": "exact"}
    if ours["reached"]:
        return {"value": value, "bound": ">="}
    if theirs["reached"]:
        return {"value": value, "bound": "<="}
    return {"value": None, "bound": "neither reached"}


def _plan(a: Any) -> tuple[list[float], list[float], list[str], int]:
    caps = [float(x) for x in (a.caps or ("20" if a.quick else "100,20")).split(",")]
    losses = [
        float(x) for x in (a.tb_losses or ("0,0.01" if a.quick else "0,0.01,0.05")).split(",")
    ]
    methods = (a.methods or "gn_arctopk,gloo,powersgd1").split(",")
    reps = a.tb_reps or (1 if a.quick else 2)
    a.max_s = a.max_s or (40.0 if a.quick else 90.0)
    return caps, losses, methods, reps


def _wait(ctrl: Path, names: list[str], tasks: list[Any], deadline_s: float) -> list[Any]:
    end = time.monotonic() + deadline_s
    paths = [ctrl / n for n in names]
    while not all(p.exists() for p in paths):
        for t in tasks:
            if t.done():
                t.result(5.0)
                raise RuntimeError(f"{t.label} exited early")
        if time.monotonic() > end:
            raise TimeoutError(f"missing {[p.name for p in paths if not p.exists()]}")
        time.sleep(0.02)
    return [json.loads(p.read_text()) for p in paths]


def _values_of(method: str, values: str) -> str | None:
    """The value codec a method's run used: gossipnet's sparse compressors only."""
    return values if method in ("gn_arctopk", "gn_dct") else None


def _line(cap: float, loss: float, method: str, r: dict[str, Any]) -> str:
    head = f"{cap:>6g} Mbit/s {loss:>4.0%} {method:<11} {r['optim']:<4} {r['values'] or '-':<4}"
    if "error" in r:
        return f"{head} error: {r['error'][:120]}"
    mark = "" if r["reached"] else ">="
    return (
        f"{head} {mark}{r['seconds']:7.1f} s {r['steps']:>4} steps {r['s_per_step']:.3f} s/step "
        f"loss {r['loss']:.3f} {r['wire_bytes_per_step'] / 1e3:9.1f} kB/step "
        f"cpu {r['cpu_per_step']:.3f} s/step load {r['load']:.1f}"
    )


def _jobs(tb: Testbed, a: Any, ctrl: Path, tasks: list[Any]) -> list[dict[str, Any]]:
    caps, losses, methods, reps = _plan(a)
    runs: list[dict[str, Any]] = []
    k = 0
    for cap in caps:
        tb.set_rate(None, cap, queue_ms=50.0)
        for loss in losses:
            tb.set_loss(None, loss)
            for rep in range(reps):
                for method in methods:
                    job = {
                        "method": method,
                        "pace_mbps": cap,
                        "eval_every": a.eval_every,
                        "target": a.target,
                        "max_steps": a.max_steps,
                        "max_s": a.max_s,
                    }
                    write_json(ctrl / f"job-{k}.json", job)
                    names = [f"result-{k}-{r}.json" for r in range(len(tb.hosts))]
                    res = combine(_wait(ctrl, names, tasks, 4 * a.max_s + 300), a.target)
                    res |= {"cap": cap, "loss_rate": loss, "method": method, "rep": rep}
                    res |= {"optim": a.optim, "values": _values_of(method, a.values)}
                    res["load"] = os.getloadavg()[0]
                    print(_line(cap, loss, method, res), flush=True)
                    runs.append(res)
                    k += 1
    (ctrl / "stop").touch()
    return runs


def summarise_tb(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Cells (median over reps) and the issue's two headline ratios."""
    keys = sorted({(r["cap"], r["loss_rate"], r["method"]) for r in runs})
    cells = {
        f"{cap:g}/{loss:g}/{m}": cell_summary(
            [r for r in runs if (r["cap"], r["loss_rate"], r["method"]) == (cap, loss, m)]
        )
        for cap, loss, m in keys
    }
    cap, loss = HEADLINE
    ours = cells.get(f"{cap:g}/{loss:g}/gn_arctopk")
    gloo = speedup(cells.get(f"{cap:g}/{loss:g}/gloo"), ours)
    psgd = speedup(cells.get(f"{cap:g}/{loss:g}/powersgd1"), ours)
    return {
        "speedup_vs_gloo_capped_1pct": gloo["value"],
        "speedup_vs_gloo_capped_1pct_bound": gloo["bound"],
        "speedup_vs_powersgd_capped_1pct": psgd["value"],
        "speedup_vs_powersgd_capped_1pct_bound": psgd["bound"],
        "targets": {"speedup_vs_gloo_capped_1pct": 5.0, "speedup_vs_powersgd_capped_1pct": 2.0},
        "by_method_capped_1pct": {
            m: {
                "vs_gloo": speedup(cells.get(f"{cap:g}/{loss:g}/gloo"), cells[k]),
                "vs_powersgd": speedup(cells.get(f"{cap:g}/{loss:g}/powersgd1"), cells[k]),
            }
            for k in cells
            if k.startswith(f"{cap:g}/{loss:g}/gn_") and (m := k.rsplit("/", 1)[1])
        },
        "cells": cells,
    }


def run_testbed(a: Any) -> dict[str, Any]:
    """The whole timing part; a JSON-friendly summary (``skipped`` without root)."""
    reason = unavailable_reason()
    if reason:
        print(f"--testbed skipped: {reason}")
        return {
            "skipped": reason,
            "speedup_vs_gloo_capped_1pct": None,
            "speedup_vs_powersgd_capped_1pct": None,
        }
    t_start = time.monotonic()
    _, losses, _, _ = _plan(a)
    with Testbed(hosts=4, mtu=9000, keep_logs=bool(os.environ.get("CTT_KEEP_LOGS"))) as tb:
        print(f"run dir: {tb.run_dir}", flush=True)
        checks = []
        for loss in losses:
            tb.set_loss(None, loss)
            m = measure_loss(tb, 0, 1, count=1000)
            print(f"loss check: {m}", flush=True)
            checks.append({"set": loss, "measured": round(m.rate, 4), "ok": m.ok})
        tb.set_loss(None, 0.0)
        ctrl = tb.run_dir / "ctrl"
        ctrl.mkdir()
        optim = optim_settings(a)
        copies = getattr(a, "copies", 1)
        print(f"optimizer: {optim}, values: {a.values}, copies: {copies}", flush=True)
        plan = {
            "ips": [h.ip for h in tb.hosts],
            "hidden": a.tb_hidden,
            "seed": 0,
            "batch": 64,
            "optim": optim,
            "values": a.values,
            "density": a.density,
            "chunk_bytes": CHUNK_BYTES,
            "gn_timeout_s": 2.0,
            "gloo_timeout_s": 60.0,
            "copies": copies,  # Config.compressed_copies (--copies)
        }
        env = {"GLOO_SOCKET_IFNAME": "eth0"}
        tasks = [
            h.start(tb_worker, i, plan, str(ctrl), env=env, label=f"ctt-{h.name}")
            for i, h in enumerate(tb.hosts)
        ]
        _wait(ctrl, [f"ready-{r}.json" for r in range(len(tb.hosts))], tasks, 240.0)
        runs = _jobs(tb, a, ctrl, tasks)
        for t in tasks:
            t.result(60.0)
    out = summarise_tb(runs)
    params = a.tb_hidden * a.tb_hidden + 44 * a.tb_hidden + 10
    optim = optim_settings(a)
    out |= {
        "optim": optim,
        "values": a.values,
        "loss_check": checks,
        "runs": runs,
        "wall_s": round(time.monotonic() - t_start, 1),
        "setup": f"4 namespace hosts, MTU 9000, tbf both ends 50 ms queue; MLP 32-{a.tb_hidden}-"
        f"{a.tb_hidden}-10 ({params} params, {4 * params / 1e6:.2f} MB float32 grads); "
        f"{optim['name']} lr {optim['lr']:g} momentum {optim['momentum']:g} for every method; "
        f"gossipnet values {a.values}; target {a.target}; "
        f"machine: {len(os.sched_getaffinity(0))} cores, shared",
    }
    return out
