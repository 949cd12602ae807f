"""Part 3 of ``bench/backend.py``: the DDP script on the namespace testbed at 5% kernel loss.

Why apart: it needs root and builds a network (``gossipnet.testbed``: 4 hosts, a
switch whose nftables rule drops 5% of the forwarded frames at random, MTU 9000,
torn down however the run ends); the loopback parts run anywhere.  Each host runs
one rank of ``examples/ddp_backend.py`` with torchrun's variables set by hand
(``MASTER_ADDR`` = h0), gloo over TCP (``GLOO_SOCKET_IFNAME=eth0``) and gossipnet over
UDP with 8 KiB chunks (one jumbo frame each, as ``bench/testbed.py`` does).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gossipnet.testbed import Testbed, measure_loss, unavailable_reason

LOSS = 0.05
#: One run's bound (a hang): a gloo step at 5% loss can take seconds.
RUN_S = 600.0


def _run(
    tb: Testbed, backend: str, port: int, argv: list[str], env: dict[str, str]
) -> dict[str, Any]:
    procs = []
    for rank, host in enumerate(tb.hosts):
        extra = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(len(tb.hosts)),
            "MASTER_ADDR": tb.hosts[0].ip,
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "eth0",
            "GOSSIPNET_TRANSPORT": "udp",
            "GOSSIPNET_CONFIG": json.dumps({"chunk_bytes": 8192}),
        }
        cmd = [sys.executable, argv[0], "--backend", backend, "--json", *argv[1:]]
        procs.append(host.popen(cmd, label=f"{backend}-{port}-r{rank}", env=extra))
    codes = [p.wait(RUN_S) for p in procs]
    if any(codes):
        err = procs[codes.index(next(c for c in codes if c))].stderr_path.read_text()
        raise RuntimeError(f"testbed {backend} run failed ({codes}):\n{err[-3000:]}")
    lines = [ln for ln in procs[0].stdout_path.read_text().splitlines() if ln.startswith("{")]
    return dict(json.loads(lines[-1]))


def testbed_rows(a: Any, script: Path, env_fn: Callable[..., dict[str, str]]) -> dict[str, Any]:
    """gloo and gossipnet step times at 5% kernel loss; the ratio, or why skipped."""
    reason = unavailable_reason()
    if reason:
        return {"skipped": f"testbed unavailable: {reason}", "ddp_speedup_vs_gloo_5pct": None}
    env = {k: v for k, v in env_fn().items() if k in ("PYTHONPATH", "OMP_NUM_THREADS")}
    argv = [str(script), "--hidden", str(a.testbed_hidden), "--steps", str(a.testbed_steps)]
    argv += ["--lr", "0.01"]  # a 2048-wide MLP diverges at the script's 0.1
    runs: dict[str, list[dict[str, Any]]] = {"gloo": [], "gossipnet": []}
    with Testbed(hosts=4, mtu=9000) as tb:
        tb.set_loss(None, LOSS)
        check = measure_loss(tb, 0, 1, count=2000)
        print(f"  loss check: {check}", flush=True)
        if not check.ok:
            raise RuntimeError(f"the testbed's loss is not {LOSS}: {check}")
        port = 29500
        for i in range(a.testbed_runs):
            for backend in ("gloo", "gossipnet") if i % 2 == 0 else ("gossipnet", "gloo"):
                port += 1
                r = _run(tb, backend, port, argv, env)
                if not math.isfinite(r["test_loss"]):  # non-finite gradients change the path
                    raise RuntimeError(f"testbed {backend} run diverged: {r}")
                runs[backend].append(r)
                print(
                    f"  testbed {backend:9s} run {i}: step {r['step_ms_median']:.1f} ms,"
                    f" wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s,"
                    f" loss {r['test_loss']:.4f}",
                    flush=True,
                )
    cells = {}
    for b, rs in runs.items():
        steps = [r["step_ms_median"] for r in rs]
        cpus = [r["cpu_s"] for r in rs]
        cells[b] = {
            "step_ms": {"median": statistics.median(steps), "min": min(steps), "max": max(steps)},
            "cpu_s": {"median": statistics.median(cpus), "min": min(cpus), "max": max(cpus)},
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "runs": rs,
        }
    speedup = cells["gloo"]["step_ms"]["median"] / cells["gossipnet"]["step_ms"]["median"]
    return {
        "loss": LOSS,
        "loss_check": {"measured": check.rate, "ok": check.ok},
        "hidden": a.testbed_hidden,
        "steps": a.testbed_steps,
        "cells": cells,
        "ddp_speedup_vs_gloo_5pct": speedup,
    }
