"""A training step and a bare all-reduce over UDP loopback: wall, CPU and packets lost.

Why: the namespace testbed (``bench/testbed.py``) is the figure that counts, but it
needs root and several minutes; this is the same model and optimizer (the
testbed's 17.1 MB teacher-student MLP, ``peer.optimizer(SGD momentum)``, 8 KiB
chunks, UDP) on 127.0.0.1 in about 30 s, to compare two builds of the packet path
back to back: run it once per checkout (``PYTHONPATH`` picks the build).

Four spawned processes each join over ``udp://127.0.0.1``; per op (``grads``:
forward and backward only; ``step``: grads + ``opt.step()``; ``allreduce``:
``net.all_reduce`` of a tensor of the model's size) 2 warm-up calls, then
``--reps`` timed ones.  Wall: the slowest process's mean seconds per call; CPU:
the processes' mean ``process_time`` per call (all threads); lost: the reports'
``packets_lost`` summed over processes and reps (on loopback at 0% loss anything
above 0 is the protocol cutting phases early, or kernel buffer drops).

    .venv/bin/python bench/step_loopback.py              # 15 reps
    PYTHONPATH=/tmp/before .venv/bin/python bench/step_loopback.py   # another build
    .venv/bin/python bench/step_loopback.py --ops step --profile /tmp/prof   # cProfile

``--ops`` times only the ops named (a sampling profiler such as py-spy, run over
the bench, then sees only those); ``--profile DIR`` writes cProfile files of rank
0's calling thread and event-loop thread per op (thread CPU time; the profiler
itself slows the packet path several times, so read them for shares, not times).

The last stdout line is one JSON object: per op ``wall_s``, ``cpu_s``, ``lost``.
"""

from __future__ import annotations

import cProfile
import multiprocessing as mp
import os
import time
from typing import Any

from _common import bench_parser, emit_json, free_ports

WORLD = 4
OPS = ("grads", "step", "allreduce")


def _worker(
    rank: int, ports: list[int], reps: int, names: list[str], profile: str | None, q: Any
) -> None:
    import torch

    import gossipnet
    from gossipnet.testbed.train import batch_for, make_model, make_teacher

    torch.set_num_threads(1)
    addrs = [f"udp://127.0.0.1:{p}" for p in ports]
    net = gossipnet.join(addrs, addrs[rank], secret=b"bench-step", peer_id=f"h{rank}",
                         chunk_bytes=8192, wait_for=WORLD, resync_every_steps=0,
                         collective_timeout_s=10)  # fmt: skip
    model, teacher = make_model(2048, 0), make_teacher(0)
    opt = net.optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    step_no = [0]

    def grads() -> None:
        model.zero_grad(set_to_none=True)
        step_no[0] += 1
        x, y = batch_for(teacher, 0, rank, step_no[0], 64)
        torch.nn.functional.cross_entropy(model(x), y).backward()

    def step() -> Any:
        grads()
        report = opt.step()
        opt.zero_grad()
        return report

    ops = {"grads": grads, "step": step, "allreduce": lambda: net.all_reduce([flat], timeout=10)}
    out: dict[str, tuple[float, float, int]] = {}
    try:
        for name in names:
            op = ops[name]
            op()
            op()
            lost = 0
            stem = f"{profile}/{name}" if profile and rank == 0 else None
            prof = _Profiles(net, stem)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(reps):
                report = prof.caller.runcall(op) if prof.caller else op()
                lost += getattr(report, "packets_lost", 0) or 0
            out[name] = ((time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps, lost)
            prof.dump()
    finally:
        net.close()
    q.put((rank, out))


class _Profiles:
    """cProfile in thread CPU time of the caller and the peer's event-loop thread.

    One profiler per thread, since cProfile sees only the thread that enabled it;
    ``time.thread_time`` so waiting for peers and other programs' load are not
    counted as cost.  Off (``caller`` None) where ``stem`` is None.
    """

    def __init__(self, net: Any, stem: str | None) -> None:
        self.net, self.stem = net, stem
        self.caller = cProfile.Profile(time.thread_time) if stem else None
        self.loop = cProfile.Profile(time.thread_time) if stem else None
        if self.loop is not None:
            net._loop.loop.call_soon_threadsafe(self.loop.enable)  # runs on the loop thread

    def dump(self) -> None:
        if self.caller is None or self.loop is None:
            return

        async def disable(p: cProfile.Profile) -> None:
            p.disable()

        self.net._loop.call(disable(self.loop), timeout_s=10)
        self.caller.dump_stats(f"{self.stem}.caller.prof")
        self.loop.dump_stats(f"{self.stem}.loop.prof")


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS),
                        help="which ops to time (a profiler then sees only those)")  # fmt: skip
    parser.add_argument("--profile", metavar="DIR",
                        help="cProfile rank 0 (caller, event loop) per op into DIR")  # fmt: skip
    args = parser.parse_args()
    reps = 5 if args.quick else args.reps
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = free_ports(WORLD)
    procs = [
        ctx.Process(target=_worker, args=(r, ports, reps, args.ops, args.profile, q))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    summary = {
        name: {
            "wall_s": round(max(r[name][0] for r in res.values()), 4),
            "cpu_s": round(sum(r[name][1] for r in res.values()) / WORLD, 4),
            "lost": sum(r[name][2] for r in res.values()),
        }
        for name in args.ops
    }
    for name, row in summary.items():
        wall, cpu, lost = row["wall_s"], row["cpu_s"], row["lost"]
        print(f"{name:10s} wall {wall:.4f} s  cpu {cpu:.4f} s  lost {lost}")
    emit_json({"reps": reps, **summary})


if __name__ == "__main__":
    main()
