"""CPU per all_reduce call, user and system, for gloo and gossipnet run apart.

Why a second all-reduce bench: ``allreduce.py`` interleaves every case in the
same four processes, which is right for comparing wall times but leaves a
system-wide profiler (``perf record -a``) unable to tell the backends apart.
Here one backend at a time runs alone in four fresh processes, so a profile
taken while it runs is that backend's, and the user/system split shows where
the CPU goes: on a machine with fewer cores than processes, wall time follows
CPU time.

    .venv/bin/python bench/allreduce_cpu.py --quick              # 4M float32, ~20 s
    .venv/bin/python bench/allreduce_cpu.py                      # 25M, both backends
    .venv/bin/python bench/allreduce_cpu.py --backend gossipnet --reps 80 &
    sleep 12; perf record -a -o /tmp/ar.data -- sleep 8          # then perf report --sort comm,dso

Each process runs ``torch.set_num_threads(1)`` (``--threads``), as in ``allreduce.py``:
four processes share the cores.  ``--threads 0`` leaves torch's default, which is
what a training process without that call runs with.

Per backend, each process reports ``getrusage`` (all its threads) over the timed
calls; the table sums the four processes per call.  Wall is the median over
calls of the slowest process's time from a shared barrier's release.  The last
stdout line is one JSON object with ``cpu_s``, ``user_s``, ``sys_s``, ``wall_s``
per backend and ``cpu_vs_gloo`` / ``wall_vs_gloo`` for gossipnet.
"""

from __future__ import annotations

import resource
import time
from typing import Any

from _common import SPAWN, bench_parser, emit_json, free_ports, median, run_workers

WORLD = 4
BACKENDS = ("gloo", "gossipnet")


def worker(
    rank: int,
    backend: str,
    n: int,
    warmup: int,
    reps: int,
    ports: list[int],
    bar: Any,
    threads: int,
) -> Any:
    import torch

    if threads:
        torch.set_num_threads(threads)
    buf = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    if backend == "gloo":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=WORLD
        )

        def call() -> None:
            dist.all_reduce(buf)
            buf.div_(WORLD)

        close = dist.destroy_process_group
    else:
        import gossipnet

        addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
        net = gossipnet.join(
            addresses, addresses[rank], secret=b"bench-cpu", wait_for=WORLD, peer_id=f"r{rank}"
        )

        def call() -> None:
            net.all_reduce([buf])

        close = net.close
    try:
        for _ in range(warmup):
            bar.wait()
            call()
        walls = []
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(reps):
            bar.wait()
            t = time.perf_counter()
            call()
            walls.append(time.perf_counter() - t)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        bar.wait()  # nobody closes while a peer still needs it
    finally:
        close()
    return {
        "user_s": (r1.ru_utime - r0.ru_utime) / reps,
        "sys_s": (r1.ru_stime - r0.ru_stime) / reps,
        "walls": walls,
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--size", type=int, help="float32 elements (default 25M; --quick 4M)")
    parser.add_argument("--reps", type=int, help="timed calls per backend")
    parser.add_argument("--backend", choices=BACKENDS, help="run only this one (for a profile)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads in each process, as allreduce.py does (0: torch's default)",
    )
    args = parser.parse_args()
    n = args.size or (4 << 20 if args.quick else 25 << 20)
    reps = args.reps or (10 if args.quick else 20)
    print(
        f"all_reduce of {n} float32, {WORLD} processes on 127.0.0.1, each backend alone,"
        f" torch threads {args.threads or 'default'}"
    )
    print(f"{'backend':10s} {'wall s':>8s} {'cpu s':>8s} {'user s':>8s} {'sys s':>8s}")
    out: dict[str, dict[str, float]] = {}
    for backend in (args.backend,) if args.backend else BACKENDS:
        plan = (backend, n, 2, reps, free_ports(WORLD), SPAWN.Barrier(WORLD), args.threads)
        rows = run_workers(worker, WORLD, plan, timeout_s=600)
        user = sum(r["user_s"] for r in rows)
        sys_ = sum(r["sys_s"] for r in rows)
        wall = median([max(r["walls"][i] for r in rows) for i in range(reps)])
        out[backend] = {"wall_s": wall, "cpu_s": user + sys_, "user_s": user, "sys_s": sys_}
        print(f"{backend:10s} {wall:8.4f} {user + sys_:8.3f} {user:8.3f} {sys_:8.3f}")
    summary: dict[str, Any] = {"elements": n, "reps": reps, "threads": args.threads, **out}
    if len(out) == 2:
        g, x = out["gloo"], out["gossipnet"]
        summary["cpu_vs_gloo"] = round(x["cpu_s"] / g["cpu_s"], 3)
        summary["wall_vs_gloo"] = round(x["wall_s"] / g["wall_s"], 3)
        print(f"gossipnet / gloo: CPU {summary['cpu_vs_gloo']}x, wall {summary['wall_vs_gloo']}x")
    emit_json(summary)


if __name__ == "__main__":
    main()
