"""Training on preemptible peers: 8 local processes, killed and restarted at random.

    .venv/bin/python examples/preemptible.py                   # 8 peers, ~90 s, plot at the end
    .venv/bin/python examples/preemptible.py --duration 40 --peers 6

A supervisor starts the peers, then every few seconds SIGKILLs one at random
(no goodbye: the others notice by silence) or, now and then, SIGTERMs one
(it announces its departure and leaves within a second), and restarts it a
little later under the same name.  A restarted peer downloads the current
parameters, Adam state and step count from a live peer before it trains
(``strategy="moshpit"`` does this on its own), so the loss keeps falling
while peers come and go.  The plot (``runs/preemptible/preemptible.png``)
shows every peer's loss and the number of live peers over time.

Under torchrun each worker is one peer, and ``join()`` with no peers reads
torchrun's variables; ``--chaos P`` makes each worker SIGKILL itself with
probability P per second, and ``--checkpoint-dir`` keeps a per-rank atomic
checkpoint for restarts of the whole group (torchrun restarts all local
workers together, so no live peer may be left to download from):

    torchrun --nproc-per-node 4 --max-restarts 10 examples/preemptible.py \\
        --worker --chaos 0.02 --max-steps 1500 --checkpoint-dir runs/preemptible/ckpt

Compared with a plain PyTorch loop the new lines are ``gossipnet.join(...)``
and ``net.optimizer(..., strategy="moshpit", average_every=4)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gossipnet

NET = {"heartbeat_interval_s": 0.2, "failure_timeout_s": 1.5, "collective_timeout_s": 3.0}


# ----------------------------------------------------------------------------- one peer
def teacher_batch(gen: torch.Generator, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random teacher network labels random inputs: a task with a known floor."""
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(16, 32, generator=teacher)
    w2 = torch.randn(32, 1, generator=teacher) / 4
    x = torch.randn(size, 16, generator=gen)
    return x, torch.tanh(x @ w1) @ w2


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the peers share the machine's cores
    if args.rank is None:  # torchrun: join() reads RANK, WORLD_SIZE, MASTER_ADDR/PORT
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # a preemptible fleet goes on without ranks that are down, as long as one other
        # peer is there to copy the state from; join() names the missing ones
        net = gossipnet.join(**NET, join_timeout_s=20.0, min_peers=min(2, world))
        rank = int(os.environ.get("RANK", "0"))
    else:
        rank = args.rank
        addresses = [f"tcp://127.0.0.1:{p}" for p in args.ports]
        net = gossipnet.join(
            addresses,
            listen=addresses[rank],
            peer_id=f"rank{rank}",
            wait_for=args.wait_for,
            join_timeout_s=30.0,
            **NET,
        )
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    checkpoint = None
    if args.checkpoint_dir:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        checkpoint = str(Path(args.checkpoint_dir) / f"rank{rank}.pt")
    opt = net.optimizer(
        torch.optim.Adam(model.parameters(), lr=3e-3),
        strategy="moshpit",
        average_every=4,  # local steps between averagings
        average_state=True,  # Adam's moments too
        group_size=4,
        checkpoint=checkpoint,
        checkpoint_every=50 if checkpoint else 0,
    )
    sync = opt.last_sync  # what the join downloaded
    log = open(args.log_dir / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
    log.write(json.dumps({"t": time.time(), "event": "start", "step": opt.step_count,
                          "synced_from": sync.source if sync else None}) + "\n")  # fmt: skip
    gen = torch.Generator().manual_seed(int(time.time_ns()) % 2**31)  # fresh data per life
    end = time.time() + args.duration
    stop = args.log_dir / "STOP"  # the supervisor ends the run for everyone
    while time.time() < end and not stop.exists():
        if args.max_steps is not None and opt.step_count >= args.max_steps:
            break
        x, y = teacher_batch(gen)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        rep = opt.step()
        opt.zero_grad()
        record = {"t": time.time(), "step": opt.step_count, "loss": loss.item()}
        record["alive"] = len(net.alive_peers())
        if rep.method == "moshpit":
            record["group"] = rep.extra.get("mean_group_size", 1.0)
        log.write(json.dumps(record) + "\n")
        time.sleep(args.step_s)  # stands in for the rest of a real step's compute
        if args.chaos and random.random() < args.chaos * args.step_s:
            os.kill(os.getpid(), signal.SIGKILL)  # preempted, for torchrun to restart
    net.leave()


# ----------------------------------------------------------------------------- supervisor
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


#: How long peers may take to start (import torch, join, download state): a bound on a
#: hang, not a measure of speed (~5 s on 2 idle cores, ~60 s on 2 cores at a load of 12).
START_BOUND_S = 180.0


def wait_restarts(
    procs: dict[int, subprocess.Popen[bytes]], logs: list[Path], starting: dict[int, int]
) -> None:
    """Wait until every restarted peer has started training (or died), at most
    ``START_BOUND_S``: ending the run under a peer that is still starting leaves it
    no live peer to download the state from (on a busy machine a restart took 50 s)."""
    t0 = time.time()
    while time.time() - t0 < START_BOUND_S:
        pending = [
            r
            for r, size in starting.items()
            if procs[r].poll() is None and b'"event": "start"' not in logs[r].read_bytes()[size:]
        ]
        if not pending:
            return
        time.sleep(0.2)
    print(f"restarted peers {pending} did not start within {START_BOUND_S:.0f} s")


def supervise(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    ports = free_ports(args.peers)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    for f in [*args.log_dir.glob("rank*.jsonl"), args.log_dir / "STOP"]:
        f.unlink(missing_ok=True)

    def spawn(rank: int, wait_for: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, __file__, "--worker", "--rank", str(rank)]
        cmd += ["--ports", *map(str, ports), "--log-dir", str(args.log_dir)]
        cmd += ["--step-s", str(args.step_s), "--wait-for", str(wait_for)]
        cmd += ["--duration", str(args.duration + 300)]  # the STOP file ends it
        return subprocess.Popen(cmd)

    t_spawn = time.time()
    procs = {r: spawn(r, args.peers) for r in range(args.peers)}
    logs = [args.log_dir / f"rank{r}.jsonl" for r in range(args.peers)]
    while not all(f.exists() for f in logs):  # every peer joined and started training
        if time.time() - t_spawn > START_BOUND_S or any(
            p.poll() is not None for p in procs.values()
        ):
            print("the peers did not all start")
            for p in procs.values():
                p.kill()
            return 1
        time.sleep(0.2)
    print(f"{args.peers} peers training after {time.time() - t_spawn:.1f} s of start-up")
    start = time.time()
    deadline = start + args.duration
    events: list[dict[str, Any]] = []
    live: list[tuple[float, int]] = []
    down: dict[int, float] = {}  # rank -> when to restart it
    next_kill = start + args.warmup + rng.uniform(0, args.kill_every)
    starting: dict[int, int] = {}  # restarted rank -> its log's size when restarted
    while time.time() < deadline:
        now = time.time()
        for r, at in list(down.items()):
            if now >= at and deadline - now > 8:
                procs[r] = spawn(r, 2)  # a restart needs one live peer to copy, not all
                starting[r] = logs[r].stat().st_size if logs[r].exists() else 0
                del down[r]
                events.append({"t": now, "event": "restart", "rank": r})
        if now >= next_kill and deadline - now > 12 and len(down) < args.peers // 2:
            r = rng.choice([r for r in procs if r not in down])
            how = signal.SIGTERM if rng.random() < 0.25 else signal.SIGKILL
            procs[r].send_signal(how)
            procs[r].wait()
            down[r] = now + rng.uniform(1.0, 4.0)
            events.append({"t": now, "event": how.name, "rank": r})
            print(f"[{now - start:5.1f} s] {how.name} rank{r}", flush=True)
            next_kill = now + rng.uniform(0.5, 1.5) * args.kill_every
        live.append((now, sum(p.poll() is None for r, p in procs.items() if r not in down)))
        time.sleep(0.1)
    wait_restarts(procs, logs, starting)
    (args.log_dir / "STOP").touch()  # everyone leaves, gracefully, after its current step
    for p in procs.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.terminate()  # SIGTERM: leaves gracefully
            p.wait(timeout=10)
    return report(args, events, live, start)


def report(
    args: argparse.Namespace,
    events: list[dict[str, Any]],
    live: list[tuple[float, int]],
    t0: float,
) -> int:
    rows = []
    for f in sorted(args.log_dir.glob("rank*.jsonl")):
        rank = int(f.stem[4:])
        for line in f.read_text().splitlines():
            rows.append({**json.loads(line), "rank": rank})
    losses = sorted((r["t"] - t0, r["loss"]) for r in rows if "loss" in r and r["t"] >= t0)
    span = losses[-1][0]
    first = [v for t, v in losses if t < span * 0.2]
    last = [v for t, v in losses if t > span * 0.8]

    def med(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]

    # restarts: a "start" after the run began; each must have copied a live peer's state
    starts = [r for r in rows if r.get("event") == "start" and r["t"] > t0]
    back = []
    for k in (e for e in events if e["event"] in ("SIGKILL", "SIGTERM")):
        later = [r["t"] for r in starts if r["rank"] == k["rank"] and r["t"] > k["t"]]
        if later:
            back.append(round(min(later) - k["t"], 1))
    summary = {
        "peers": args.peers,
        "kills": sum(e["event"] == "SIGKILL" for e in events),
        "sigterms": sum(e["event"] == "SIGTERM" for e in events),
        "restarts": len(starts),
        "restarts_synced": sum(bool(r.get("synced_from")) for r in starts),
        "restart_steps": [r["step"] for r in starts],
        "seconds_from_kill_to_training_again": back,
        "loss_first_20pct": round(med(first), 4),
        "loss_last_20pct": round(med(last), 4),
        "steps": len(losses),
    }
    plot(args, losses, events, live, t0)
    print(json.dumps(summary))
    failed = []
    if not summary["loss_last_20pct"] < 0.5 * summary["loss_first_20pct"]:
        failed.append(
            f"the loss did not halve ({summary['loss_first_20pct']} -> "
            f"{summary['loss_last_20pct']}; a longer --duration trains further)"
        )
    if summary["restarts_synced"] != summary["restarts"]:
        failed.append(
            f"{summary['restarts'] - summary['restarts_synced']} of {summary['restarts']}"
            " restarts did not resume from a live peer's state"
        )
    print("FAILED: " + "; ".join(failed) if failed else
          "loss kept falling; every restart resumed from a live peer's state")  # fmt: skip
    return 1 if failed else 0


def plot(args: argparse.Namespace, losses: list[tuple[float, float]], events: list[dict[str, Any]],
         live: list[tuple[float, int]], t0: float) -> None:  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.scatter(
        [t for t, _ in losses], [v for _, v in losses], s=2, alpha=0.25, label="a peer's step"
    )
    bins: dict[int, list[float]] = {}
    for t, v in losses:
        bins.setdefault(int(t // 2), []).append(v)
    xs = sorted(bins)
    ax1.plot([2 * b + 1 for b in xs], [sorted(bins[b])[len(bins[b]) // 2] for b in xs], "k-",
             label="median over 2 s")  # fmt: skip
    ax1.set_yscale("log")
    ax1.set_ylabel("training loss")
    ax1.legend(loc="upper right")
    ax2.step([t - t0 for t, _ in live], [n for _, n in live], where="post")
    ax2.set_xlim(left=0)
    for e in events:
        color = {"SIGKILL": "red", "SIGTERM": "orange", "restart": "green"}[e["event"]]
        for ax in (ax1, ax2):
            ax.axvline(e["t"] - t0, color=color, alpha=0.3, lw=1)
    ax2.set_ylabel("live peers")
    ax2.set_xlabel("seconds (red: SIGKILL, orange: SIGTERM, green: restart)")
    ax2.set_ylim(0, args.peers + 0.5)
    fig.tight_layout()
    out = args.log_dir / "preemptible.png"
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of training")
    p.add_argument("--kill-every", type=float, default=6.0, help="mean seconds between kills")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds before the first kill")
    p.add_argument("--step-s", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("runs/preemptible"))
    p.add_argument("--worker", action="store_true", help="run one peer (supervisor/torchrun)")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--ports", type=int, nargs="*", default=[])
    p.add_argument("--chaos", type=float, default=0.0, help="self-SIGKILL rate per second")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--wait-for", type=int, default=None, help="peers join() waits for")
    p.add_argument("--max-steps", type=int, default=None, help="stop at this step (torchrun)")
    args = p.parse_args()
    if args.worker:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        worker(args)
    else:
        sys.exit(supervise(args))


if __name__ == "__main__":
    main()
