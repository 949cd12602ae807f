"""Where one loopback all-reduce call spends its time, per rank: a timeline.

Why: ``bench/allreduce.py`` gives a call's total; this splits it at the
hand-offs between threads, to see which is worth shortening before building
anything.  4 spawned processes on 127.0.0.1 join one gossipnet run, then each
calls ``Peer.all_reduce([t])`` ``--reps`` times (``--warmup`` more untimed),
sleeping 0.2 s and meeting at a barrier before each, as ``bench/allreduce.py``
does.  Per call and rank, on the shared monotonic clock:

  submit   barrier release -> the caller hands the round to its event loop
           (``LoopThread.call``; before it: flatten, finite check)
  start    hand-off -> the loop starts running the round
  loop     the round on the loop thread (sending, receiving, reducing)
  return   the round's end -> the caller has the result

and per call the earliest and latest rank's loop start after the barrier, and
the call's time (barrier to the slowest rank's return).  Medians and 90th
percentiles over calls.  ``--set KEY=VALUE`` passes Config fields (JSON values).

    PYTHONPATH=$PWD .venv/bin/python bench/call_timeline.py --set local_stream=false
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Coroutine
from typing import Any

WORLD = 4


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def _worker(rank: int, ports: list[int], barrier: Any, out: Any, args: argparse.Namespace) -> None:
    import torch

    import gossipnet

    addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
    net = gossipnet.join(
        addresses, addresses[rank], secret=b"timeline", wait_for=WORLD, peer_id=f"r{rank}",
        **args.overrides,
    )  # fmt: skip
    loop_thread = net._runtime.loop_thread
    plain_call = loop_thread.call
    marks: dict[str, float] = {}

    def timed_call(coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        marks["submit"] = time.perf_counter()

        async def timed() -> Any:
            marks["start"] = time.perf_counter()
            try:
                return await coro
            finally:
                marks["end"] = time.perf_counter()

        return plain_call(timed(), timeout_s)

    loop_thread.call = timed_call  # type: ignore[method-assign]
    buf = torch.randn(args.numel, generator=torch.Generator().manual_seed(rank))
    rows = []
    for i in range(args.warmup + args.reps):
        time.sleep(0.2)  # a training step's compute between calls
        barrier.wait()
        t0 = time.perf_counter()
        net.all_reduce([buf], timeout=10.0)
        t1 = time.perf_counter()
        if i >= args.warmup:
            rows.append((t0, marks["submit"], marks["start"], marks["end"], t1))
    out.put((rank, rows))
    barrier.wait()
    net.close()


def _summary(res: dict[int, list[tuple[float, ...]]], reps: int) -> list[str]:
    spans: dict[str, list[float]] = {"submit": [], "start": [], "loop": [], "return": []}
    first, last, total = [], [], []
    for i in range(reps):
        base = min(res[r][i][0] for r in range(WORLD))
        for r in range(WORLD):
            t0, sub, st, end, t1 = res[r][i]
            for name, dt in zip(spans, (sub - t0, st - sub, end - st, t1 - end), strict=True):
                spans[name].append(dt * 1e3)
        starts = [res[r][i][2] - base for r in range(WORLD)]
        first.append(min(starts) * 1e3)
        last.append(max(starts) * 1e3)
        total.append(max(res[r][i][4] - base for r in range(WORLD)) * 1e3)

    def q90(xs: list[float]) -> float:
        return sorted(xs)[int(0.9 * len(xs))]

    lines = [
        f"{name:7s} ms per rank and call: median {statistics.median(v):.2f}  p90 {q90(v):.2f}"
        for name, v in spans.items()
    ]
    lines.append(
        f"loop start after the barrier, first rank {statistics.median(first):.2f} ms, "
        f"last {statistics.median(last):.2f} ms (p90 {q90(last):.2f})"
    )
    lines.append(
        f"call (slowest rank) median {statistics.median(total):.2f} ms  p90 {q90(total):.2f}"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    args.overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    ctx = mp.get_context("spawn")
    ports, barrier, out = _ports(WORLD), ctx.Barrier(WORLD), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ports, barrier, out, args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    res = dict(out.get() for _ in range(WORLD))
    for p in procs:
        p.join()
    print(f"{args.numel} float32, {WORLD} processes, Config overrides {args.overrides}")
    print("\n".join(_summary(res, args.reps)))


if __name__ == "__main__":
    main()
