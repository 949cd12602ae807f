"""hivemind's DecentralizedAverager on the machine at hand (run by ``bench/moshpit.py``).

Not a bench of its own (``make bench`` runs it and it exits at once): it needs
an interpreter with hivemind installed, which gossipnet's venv does not have.
``bench/moshpit.py --hivemind-python PATH`` runs it as

    PATH bench/_hivemind_avg.py --run NUMEL REPS GROUP

and reads the JSON of its last stdout line: seconds per ``averager.step()``
(matchmaking + butterfly all-reduce) for NUMEL float32 on GROUP processes,
each holding different values, all calling ``step`` together after a barrier.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any


def _worker(
    rank: int, numel: int, reps: int, group: int, q: Any, maddrs: Any, barrier: Any
) -> None:
    mp.set_start_method("fork", force=True)  # hivemind forks its DHT and averager processes
    import hivemind
    import torch

    torch.set_num_threads(1)
    if rank == 0:
        dht = hivemind.DHT(start=True)
        for _ in range(group - 1):
            maddrs.put([str(a) for a in dht.get_visible_maddrs()])
    else:
        dht = hivemind.DHT(initial_peers=maddrs.get(timeout=60), start=True)
    x = torch.full((numel,), float(rank))
    averager = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[x],
        dht=dht,
        prefix="gossipnet_bench",
        target_group_size=group,
        min_group_size=group,
        min_matchmaking_time=1.0,
        request_timeout=1.0,
        start=True,
    )
    times = []
    ok = True
    for i in range(reps + 1):
        with averager.get_tensors() as tensors:
            tensors[0].fill_(float(rank))
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        result = averager.step(timeout=120)
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
        with averager.get_tensors() as tensors:
            want = (group - 1) / 2
            ok = ok and result is not None and abs(float(tensors[0][0]) - want) < 1e-4
    averager.shutdown()
    dht.shutdown()
    q.put((rank, times, ok))


def run(numel: int, reps: int, group: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q, maddrs, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(group)
    procs = [
        ctx.Process(target=_worker, args=(r, numel, reps, group, q, maddrs, barrier))
        for r in range(group)
    ]
    for p in procs:
        p.start()
    out = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    per_rep = [max(t[i] for _, t, _ in out) for i in range(reps)]  # the slowest peer's step
    import hivemind

    return {
        "hivemind_version": hivemind.__version__,
        "numel": numel,
        "peers": group,
        "step_s_median": statistics.median(per_rep),
        "step_s": per_rep,
        "correct": all(ok for _, _, ok in out),
    }


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--run":
        print(json.dumps(run(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))), flush=True)
