"""Seconds per all_reduce: gossipnet (0% and 10% loss) against torch.distributed gloo.

Why: gossipnet's promise is that tolerating loss costs little when there is
none (``lossless_vs_gloo``, target <= 1.5) and that loss does not slow a round
down (``loss10_vs_lossless``, target <= 1.1), because phases end on END
markers instead of waiting for retransmissions.

Setup: 4 spawned processes on 127.0.0.1, one float32 tensor per size, each
process holds different random values.  Rows:
  gloo            ``dist.all_reduce`` (sum) then ``div_(world)``: the same mean
  gossipnet       ``Peer.all_reduce([t])`` over ZeroMQ tcp, default Config
  gossipnet ...   the same with a Config knob changed (chunk_bytes)
  ... loss 10%    ``FaultPlan(loss=0.1)`` on every packet each peer sends

Timing: before every repetition all 4 processes meet at a
``multiprocessing.Barrier``; each times its own call from the barrier's
release to the call's return, and a repetition's time is the slowest
process's (the collective is done when the last peer has its result).
The table shows the median over repetitions, warm-up repetitions excluded;
the inputs are reset between repetitions, outside the timed part.

Correctness (lossless rows): every process compares its result with the
true mean (computed in float64 from all four inputs) and the bench exits 1,
without the JSON line, if ``max|out - mean| > 1e-5 * max|mean|``.

    .venv/bin/python bench/allreduce.py --quick      # 1M and 4M elements, < 60 s
    .venv/bin/python bench/allreduce.py              # 1M and 25M elements

The last stdout line is one JSON object; its ``lossless_vs_gloo`` and
``loss10_vs_lossless`` are for the largest size, with the default Config.
"""

from __future__ import annotations

import cProfile
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from _common import SPAWN, bench_parser, emit_json, free_ports, median, run_workers

WORLD = 4
SECRET = b"bench-allreduce"
REL_TOL = 1e-5
LOSS = 0.1


@dataclass(frozen=True)
class Case:
    """One row group: a backend and its settings, measured at every size."""

    name: str
    backend: str  # "gloo" | "gossipnet"
    loss: float = 0.0
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """What every worker runs; the same object goes to all of them."""

    sizes: tuple[int, ...]
    warmup: int
    reps: int
    timeout_s: float
    cases: tuple[Case, ...]
    profile_dir: str | None = None  # rank 0 profiles its gossipnet rows here


@dataclass
class Row:
    """One (case, size) cell as one worker saw it."""

    times_s: list[float] = field(default_factory=list)  # timed reps, in order
    max_rel_err: float = 0.0  # worst over timed reps (lossless rows only)
    delivered: list[float] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    chunks_total: int = 0
    timed_out: int = 0


# ---------------------------------------------------------------------- worker side
def _inputs(n: int, rank: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1000 * n + rank)
    return torch.randn(n, generator=gen)


def _true_mean(n: int) -> Any:
    """The float64 mean of every rank's input (each worker rebuilds them: no transfers)."""
    import torch

    acc = torch.zeros(n, dtype=torch.float64)
    for r in range(WORLD):
        acc += _inputs(n, r)
    return acc.div_(WORLD)


def _rel_err(out: Any, ref: Any) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _measure(
    plan: Plan, barrier: Any, call: Any, src: Any, ref: Any | None, row: Row
) -> None:
    """Warm up, then time ``plan.reps`` calls of ``call(buf)``; fill ``row``."""
    buf = src.clone()
    for i in range(plan.warmup + plan.reps):
        buf.copy_(src)
        barrier.wait()
        t0 = time.perf_counter()
        report = call(buf)
        dt = time.perf_counter() - t0
        if i < plan.warmup:
            continue
        row.times_s.append(dt)
        if ref is not None:
            row.max_rel_err = max(row.max_rel_err, _rel_err(buf, ref))
        if report is not None:
            row.delivered.append(report.delivered_fraction)
            row.stale.append(report.chunks_stale)
            row.chunks_total = report.chunks_total
            row.timed_out += int(report.timed_out)


def _run_gloo(rank: int, plan: Plan, port: int, barrier: Any, data: dict[int, Any]) -> list[Row]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )

    def call(buf: Any) -> None:
        dist.all_reduce(buf)
        buf.div_(WORLD)

    rows = []
    try:
        for n in plan.sizes:
            rows.append(Row())
            _measure(plan, barrier, call, data[n][0], data[n][1], rows[-1])
    finally:
        dist.destroy_process_group()
    return rows


def _run_gossipnet(
    rank: int, plan: Plan, case: Case, ports: list[int], barrier: Any, data: dict[int, Any]
) -> list[Row]:
    import gossipnet

    addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
    faults = gossipnet.FaultPlan(loss=case.loss, seed=7) if case.loss else None
    net = gossipnet.join(
        addresses, addresses[rank], secret=SECRET, faults=faults, wait_for=WORLD,
        run=f"bench-{case.name}".replace(" ", "-")[:64], peer_id=f"rank{rank}",
        **case.overrides,
    )  # fmt: skip
    profiler = cProfile.Profile() if plan.profile_dir and rank == 0 else None
    rows = []
    try:
        if len(net.alive_peers()) != WORLD:
            raise RuntimeError(f"rank {rank}: only {net.alive_peers()} joined")

        def call(buf: Any) -> Any:
            return net.all_reduce([buf], timeout=plan.timeout_s)

        if profiler is not None:  # the loop thread does the network work: profile it
            net._loop.loop.call_soon_threadsafe(profiler.enable)
        for n in plan.sizes:
            rows.append(Row())
            ref = data[n][1] if case.loss == 0 else None
            _measure(plan, barrier, call, data[n][0], ref, rows[-1])
        if profiler is not None:
            net._loop.call(_disable(profiler), timeout_s=10)
            assert plan.profile_dir is not None
            name = f"{case.name.replace(' ', '_')}.prof"
            profiler.dump_stats(os.path.join(plan.profile_dir, name))
        barrier.wait()  # nobody leaves while another still waits for its packets
    finally:
        net.close()
    return rows


async def _disable(profiler: cProfile.Profile) -> None:
    profiler.disable()


def worker(rank: int, plan: Plan, ports: list[list[int]], barrier: Any) -> list[list[Row]]:
    """One process: every case in order, every size within a case; rows by case."""
    import torch

    torch.set_num_threads(1)
    data = {}
    for n in plan.sizes:
        data[n] = (_inputs(n, rank), _true_mean(n).float())
    out = []
    for i, case in enumerate(plan.cases):
        barrier.wait()
        if case.backend == "gloo":
            out.append(_run_gloo(rank, plan, ports[i][0], barrier, data))
        else:
            out.append(_run_gossipnet(rank, plan, case, ports[i], barrier, data))
    return out


# ---------------------------------------------------------------------- parent side
def build_plan(quick: bool, chunk_sizes: list[int], profile_dir: str | None) -> Plan:
    cases = [Case("gloo", "gloo"), Case("gossipnet", "gossipnet")]
    for kib in chunk_sizes:
        cases.append(Case(f"gossipnet chunk {kib}K", "gossipnet",
                          overrides={"chunk_bytes": kib * 1024}))  # fmt: skip
    cases.append(Case("gossipnet loss 10%", "gossipnet", loss=LOSS))
    for kib in chunk_sizes:
        cases.append(Case(f"gossipnet chunk {kib}K loss 10%", "gossipnet", loss=LOSS,
                          overrides={"chunk_bytes": kib * 1024}))  # fmt: skip
    if quick:
        return Plan((1 << 20, 4 << 20), warmup=2, reps=5, timeout_s=10.0, cases=tuple(cases),
                    profile_dir=profile_dir)  # fmt: skip
    return Plan((1 << 20, 25 << 20), warmup=2, reps=10, timeout_s=30.0, cases=tuple(cases),
                profile_dir=profile_dir)  # fmt: skip


def _cell(rows: list[Row]) -> dict[str, Any]:
    """Combine one (case, size) over ranks: per rep the slowest rank, then the median."""
    per_rep = [max(ts) for ts in zip(*(r.times_s for r in rows), strict=True)]
    delivered = [d for r in rows for d in r.delivered]
    stale = [s for r in rows for s in r.stale]
    return {
        "median_s": median(per_rep),
        "min_s": min(per_rep),
        "max_rel_err": max(r.max_rel_err for r in rows),
        "delivered_fraction": sum(delivered) / len(delivered) if delivered else None,
        "stale_chunks": sum(stale) / len(stale) if stale else None,
        "chunks_total": rows[0].chunks_total,
        "timed_out": sum(r.timed_out for r in rows),
    }


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--set wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--chunk-kib", type=int, nargs="*", default=[256],
                        help="extra chunk_bytes rows, in KiB (the default Config is 64 KiB)")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="N",
                        help="element counts instead of the preset's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a gossipnet.Config override for every gossipnet row (repeatable)")
    parser.add_argument("--profile", metavar="DIR",
                        help="cProfile rank 0's event-loop thread per gossipnet row into DIR")
    args = parser.parse_args(argv)  # fmt: skip
    plan = build_plan(args.quick, args.chunk_kib, args.profile)
    if args.set:
        extra = dict(_parse_override(kv) for kv in args.set)
        plan = dataclasses.replace(plan, cases=tuple(
            dataclasses.replace(c, overrides={**extra, **c.overrides})
            if c.backend == "gossipnet" else c for c in plan.cases))
    if args.sizes:
        plan = dataclasses.replace(plan, sizes=tuple(args.sizes))
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    started = time.perf_counter()
    flat = free_ports(WORLD * len(plan.cases))
    ports = [flat[i * WORLD : (i + 1) * WORLD] for i in range(len(plan.cases))]
    barrier = SPAWN.Barrier(WORLD)
    results = run_workers(worker, WORLD, (plan, ports, barrier), timeout_s=1200)
    cells = {
        (case.name, n): _cell([results[r][i][j] for r in range(WORLD)])
        for i, case in enumerate(plan.cases)
        for j, n in enumerate(plan.sizes)
    }
    summary = report(plan, cells)
    summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    bad = [
        f"{name} at {n} elements: max rel error {c['max_rel_err']:.2e}"
        for (name, n), c in cells.items()
        if "loss" not in name and not c["max_rel_err"] <= REL_TOL
    ]
    if bad:
        print("CORRECTNESS FAILED (results differ from the true mean):", *bad, sep="\n  ")
        sys.exit(1)
    emit_json(summary)


def report(plan: Plan, cells: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Print the table; return the summary for the JSON line."""
    print(f"{WORLD} processes on 127.0.0.1, float32, {plan.warmup} warm-up + {plan.reps} timed "
          "reps; time = median over reps of the slowest process (barrier release -> return)")
    print(f"{'case':32} {'elements':>10} {'median s':>9} {'min s':>8} {'vs gloo':>8} "
          f"{'deliv':>6} {'stale':>10} {'cut':>4} {'rel err':>8}")  # fmt: skip
    for (name, n), c in cells.items():
        gloo = cells[("gloo", n)]["median_s"]
        deliv = "" if c["delivered_fraction"] is None else f"{c['delivered_fraction']:.3f}"
        stale = "" if c["stale_chunks"] is None else f"{c['stale_chunks']:.1f}/{c['chunks_total']}"
        err = "" if "loss" in name else f"{c['max_rel_err']:.1e}"
        print(f"{name:32} {n:>10} {c['median_s']:9.4f} {c['min_s']:8.4f} "
              f"{c['median_s'] / gloo:8.2f} {deliv:>6} {stale:>10} {c['timed_out']:>4} {err:>8}")  # fmt: skip
    summary: dict[str, Any] = {"world": WORLD, "sizes": list(plan.sizes), "per_size": {}}
    for n in plan.sizes:
        gloo = cells[("gloo", n)]["median_s"]
        lossless = cells[("gossipnet", n)]["median_s"]
        lossy = cells[("gossipnet loss 10%", n)]
        entry = {
            "gloo_s": round(gloo, 5),
            "gossipnet_s": round(lossless, 5),
            "gossipnet_loss10_s": round(lossy["median_s"], 5),
            "lossless_vs_gloo": round(lossless / gloo, 3),
            "loss10_vs_lossless": round(lossy["median_s"] / lossless, 3),
            "loss10_delivered_fraction": round(lossy["delivered_fraction"], 4),
            "loss10_stale_chunks": lossy["stale_chunks"],
            "loss10_chunks_total": lossy["chunks_total"],
        }
        summary["per_size"][str(n)] = entry
    largest = summary["per_size"][str(plan.sizes[-1])]
    summary["lossless_vs_gloo"] = largest["lossless_vs_gloo"]
    summary["loss10_vs_lossless"] = largest["loss10_vs_lossless"]
    return summary


if __name__ == "__main__":
    main()
