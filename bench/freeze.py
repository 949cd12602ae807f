"""Peers frozen past the failure timeout, then thawed: do the replicas end as one model?

The scenario of the trust issue: the demo's model (a small character LM) on N peer
processes over lossy loopback ZeroMQ (10% seeded loss), a resync every 20 steps;
each peer in turn is frozen with SIGSTOP for ``--freeze-s`` seconds (longer than
``failure_timeout_s``, as an overloaded or swapping host) and thawed.  At the end
every peer runs one resync and evaluates on the same held-out text.  Reported:
each replica's relative L2 distance from the replicas' mean (and whether they are
bit-identical), the held-out losses
(min, max), how many peers realigned (downloaded state), and whether the replica
digests agree.  Before the round-identity change replicas ended 1.2-3.4% apart.

    .venv/bin/python bench/freeze.py            # 4 peers, 300 steps
    .venv/bin/python bench/freeze.py --quick    # 3 peers, 150 steps

Each freeze lasts 2.5 failure timeouts (2.5 s; the issue's was 5 s with the default
3 s timeout); the others run on meanwhile, about 40 steps of this model here.
``--plan PEER:STEP,...`` freezes instead those peers, each once another peer passes
that step; ``--plan 1:30,1:138 --quick`` freezes peer 1 twice, the second time so
close to the end that the others finish (and run their final resync) before it thaws.

The last stdout line is JSON with ``max_rel_l2``, ``eval_min``, ``eval_max``,
``realigned`` and ``digests_agree``, and wall and CPU seconds.
"""

from __future__ import annotations

import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import bench_parser, emit_json, free_ports

ROOT = Path(__file__).resolve().parents[1]
NET = {
    "heartbeat_interval_s": 0.1,
    "failure_timeout_s": 1.0,
    "collective_timeout_s": 2.0,
    "join_timeout_s": 60.0,
    "resync_every_steps": 20,
}


def worker(rank: int, addrs: list[str], out: Path, steps: int) -> None:
    """One peer: the demo's model, data and schedule; prints ``step N``; saves results."""
    import gossipnet
    from gossipnet.demo.harness import DemoConfig, _setup, evaluate, lr_at, sample_windows

    torch.set_num_threads(1)
    cfg = DemoConfig(peers=len(addrs), steps=steps, loss=0.1)
    shard, held_out, gen, model, base = _setup(rank, cfg)
    net = gossipnet.join(
        addrs, listen=addrs[rank], peer_id=f"peer{rank}", secret=b"freeze-bench",
        faults=cfg.fault_plan(None), handle_sigterm=False, **NET,
    )  # fmt: skip
    opt = net.optimizer(base)
    realigned = 0.0
    while opt.step_count < steps:
        for group in base.param_groups:
            group["lr"] = lr_at(cfg, opt.step_count)
        loss = model.loss(sample_windows(shard, cfg.batch, cfg.context, gen))
        opt.zero_grad()
        loss.backward()
        rep = opt.step()
        realigned += rep.extra.get("realigned", 0.0)
        print(f"step {opt.step_count}", flush=True)
    opt.resync()
    agree = bool(net.replicas_agree(timeout=5.0)) if hasattr(net, "replicas_agree") else None
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    result = {"params": flat, "eval": evaluate(model, held_out), "realigned": realigned}
    torch.save(result | {"agree": agree, "steps": opt.step_count}, out / f"rank{rank}.pt")
    print("done", flush=True)
    sys.stdin.readline()
    net.leave()


def _reader(proc: subprocess.Popen[str], rank: int, lines: queue.Queue[tuple[int, str]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put((rank, line.strip()))


def run(
    peers: int,
    steps: int,
    freeze_s: float,
    out: Path,
    plan: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    addrs = [f"tcp://127.0.0.1:{p}" for p in free_ports(peers)]
    cmd = [sys.executable, __file__, "--worker"]
    procs = [
        subprocess.Popen(
            [*cmd, str(r), ",".join(addrs), str(out), str(steps)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT / "bench",
        )
        for r in range(peers)
    ]
    lines: queue.Queue[tuple[int, str]] = queue.Queue()
    for r, p in enumerate(procs):
        threading.Thread(target=_reader, args=(p, r, lines), daemon=True).start()
    # peer k is frozen once another peer passes step 20 + k * gap: the others have
    # time to run on without it, and to finish only after its thaw
    gap = (steps - 40) // peers
    plan = list(plan) if plan else [(k, 20 + k * gap) for k in range(peers)]
    step, done, thaw_at = [0] * peers, set(), 0.0
    freezes: list[tuple[int, list[int]]] = []  # (peer, every peer's step when it froze)
    frozen: int | None = None
    try:
        while len(done) < peers:
            try:
                rank, line = lines.get(timeout=0.2)
            except queue.Empty:
                rank, line = -1, ""
            if line == "done":
                done.add(rank)
            elif line.startswith("step "):
                step[rank] = int(line.split()[1])
            if frozen is not None and time.monotonic() >= thaw_at:
                procs[frozen].send_signal(signal.SIGCONT)
                frozen = None
            watch = max((s for r, s in enumerate(step) if r != (plan[0][0] if plan else -1)))
            if frozen is None and plan and watch >= plan[0][1]:
                frozen = plan.pop(0)[0]
                procs[frozen].send_signal(signal.SIGSTOP)
                thaw_at = time.monotonic() + freeze_s
                freezes.append((frozen, list(step)))
        results = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(peers)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                assert p.stdin is not None
                p.stdin.write("bye\n")
                p.stdin.flush()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    stack = torch.stack([res["params"] for res in results])
    mean = stack.mean(0)
    rel = [float((x - mean).norm() / mean.norm()) for x in stack]
    evals = [res["eval"] for res in results]
    return {
        "peers": peers,
        "steps": [res["steps"] for res in results],
        "rel_l2": rel,
        "max_rel_l2": max(rel),
        "eval_min": min(evals),
        "eval_max": max(evals),
        "identical": all(torch.equal(stack[0], x) for x in stack[1:]),
        "freezes": freezes,
        "realigned": [res["realigned"] for res in results],
        "digests_agree": [res["agree"] for res in results],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, addrs, out, steps = sys.argv[2:6]
        worker(int(rank), addrs.split(","), Path(out), int(steps))
        return
    parser = bench_parser(__doc__)
    parser.add_argument("--peers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--freeze-s", type=float, default=None)
    parser.add_argument("--plan", default=None, help="PEER:STEP,... (default: each peer once)")
    args = parser.parse_args()
    plan = (
        [(int(p), int(s)) for p, s in (x.split(":") for x in args.plan.split(","))]
        if args.plan
        else None
    )
    peers = args.peers or (3 if args.quick else 4)
    steps = args.steps or (150 if args.quick else 300)
    freeze_s = args.freeze_s or 2.5 * NET["failure_timeout_s"]
    t_wall = time.perf_counter()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        summary = run(peers, steps, freeze_s, Path(tmp), plan)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"{peers} peers, {steps} steps, frozen {freeze_s:.1f} s at a time"
        f" ({[p for p, _ in summary['freezes']]}): replicas' relative"
        f" L2 from their mean max {summary['max_rel_l2']:.2e}; held-out loss"
        f" {summary['eval_min']:.4f}-{summary['eval_max']:.4f}; realigned"
        f" {summary['realigned']}; digests agree {summary['digests_agree']}"
    )
    summary |= {
        "freeze_s": freeze_s,
        "wall_s": round(time.perf_counter() - t_wall, 1),
        "cpu_s": round(children.ru_utime + children.ru_stime, 1),
        "load": os.getloadavg()[0],
    }
    emit_json(summary)


if __name__ == "__main__":
    main()
