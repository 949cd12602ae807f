"""Seconds per training step and per all-reduce on a real lossy network: gossipnet vs gloo.

Why: gossipnet's claim is that kernel-level packet loss, which stalls a TCP
collective on retransmission timeouts, costs it almost nothing.  This bench
measures that on the namespace testbed (``gossipnet.testbed``, needs root):
4 hosts on a switch, random loss dropped by nftables on the switch's
forwarding path (so TCP learns of it only from missing ACKs, as on a wire),
optionally every link capped with ``tc tbf``.

Rows: kernel loss 0, 1, 5 and 10%, without and with a bandwidth cap, and busy
rows (below), in one run; ``--quick`` runs 0, 5 and 10% uncapped and 0 and 5%
capped (the 1% rows and the capped 10% row, ~80 s, make room for the busy row
in its 6 minutes).  Per row and backend, every host times R back-to-back

  step       forward/backward of an MLP (32 -> H -> H -> 10) + gradient averaging
             + SGD step: ``net.optimizer(SGD).step()`` for gossipnet (UDP backend),
             ``dist.all_reduce(flat grads)`` + ``SGD.step()`` for gloo (TCP)
  allreduce  the same number of floats: ``net.all_reduce`` / ``dist.all_reduce``

H = 2048 (4.28 M parameters, 17 MB of float32 gradients) unless ``--hidden``.
A cell is, per rep, the slowest host (a collective ends when its last member
does), then the median over the R reps (the mean is in the JSON).  gloo ops
are bounded by the group's timeout; a row that hit it shows ``>= X s (timed
out)``, where X is the mean over the attempted ops counting the cut one at
its timeout: a lower bound, and ratios built from it are lower bounds too
(marked ``>=``).  gossipnet rows also give the fraction of chunks that kept
stale values (its price for not waiting).

What the kernel does, checked before any timing (printed, and in the JSON):
the loss rule's measured rate at every loss level against binomial bounds,
and that TCP crosses the loss rule one wire frame at a time (the testbed sets
``gso_max_segs 1`` on every veth: with GSO a drop would hit a 64 KB
super-packet, i.e. dozens of frames in one burst, far harsher on TCP than a
wire).  Both backends use the same links, MTU and loss; TCP runs with the
kernel's defaults (printed: congestion control, SACK, RACK), untuned.

Links and chunks: the testbed's MTU defaults to 9000 (jumbo frames) and
gossipnet's ``chunk_bytes`` to the largest multiple of 8 whose datagram fits
one frame (8192 + headers < 9000).  A chunk must never be IP-fragmented: a
datagram of k fragments survives loss p with probability (1-p)^k.  Why jumbo:
the UDP backend spends tens of microseconds of Python per packet and four
peers share two cores here, so 1 KiB chunks would time the CPU, not the
network; and jumbo frames are the kind choice for TCP too (a 20 MB transfer
at 5% loss took 1.5 s at MTU 9000 and 11.6 s at MTU 1500 on this testbed).
``--mtu 1500`` runs it anyway, with 1 KiB chunks.

CPU: each worker's ``process_time`` per op (every thread of the process: the
training loop, gossipnet's event loop, gloo's), the mean over hosts (gossipnet
cells also give its reports' ``extra["cpu_s"]`` and ``["cpu_caller_s"]`` as
``loop_cpu_s`` and ``caller_cpu_s``); the table
and every row's JSON give gossipnet's CPU per step and per all-reduce as a
ratio to gloo's (``cpu_vs_gloo_step``, ``cpu_vs_gloo_allreduce``).  Why it
matters: real training shares the CPU with data loading and the framework.
``loop_cpu_reps`` lists the loop CPU of each timed rep (mean over hosts), where
a transient shows: it found the optimizer's first rounds paying for parity at
0% loss.  ``--profile-dir DIR`` cProfiles each host's event-loop thread (its
own CPU time, so not the other hosts' turns) over every row's timed reps, one
pstats file per op, host and row: ``DIR/<op>-<rank>-<row>.prof``.

Busy rows (``--busy N``, default 1; 0 turns them off): the uncapped rows at
``--busy-losses`` (quick: 5%; full: 0 and 5%) run again with N pure-Python
busy loops on the machine, outside the namespaces (the namespaces do not
partition the CPU, and a data loader belongs to the job, not one emulated
host), started before the row's first op and killed after both backends'
last: a training job's data loading, the same for both backends.  Two cores
here: ``--busy 1`` takes one, so both backends slow; the ratio is the point.

Capped rows: ``tbf`` at ``--cap-mbit`` on both ends of every host's link
(50 ms queues).  gossipnet is told the rate (``Config.udp_pace_mbps`` = the
cap, a token bucket with destinations served in turn) because a sender that
never retransmits must not burst past a slow link; TCP finds the rate by
congestion control.  ``--no-pace`` shows the unpaced behaviour.

    sudo .venv/bin/python bench/testbed.py --quick   # 3 reps per cell, < 6 min
    sudo .venv/bin/python bench/testbed.py           # 7 reps, longer gloo timeouts

Prints the settings, a table, the ratios and a plot (``--plot``, default
runs/testbed.png).  The last stdout line is JSON with ``gloo_vs_gossipnet_5pct``
(gloo step time / gossipnet step time at 5% loss, no cap), ``..._0pct``,
``gossipnet_10pct_vs_0pct``, ``cpu_vs_gloo_0pct`` (gossipnet CPU-s per step /
gloo's, 0% loss, no cap) and ``gloo_vs_gossipnet_5pct_busy`` (5% loss,
``--busy``), the same for all-reduces (``_allreduce``) and capped rows
(``_capped``), and issue #21's targets in ``targets_met`` (cpu <= 2.5;
0%: gossipnet <= 1.3x gloo; 5%: gloo >= 5x slower, busy >= 3x; 10% vs 0% <= 1.2).
Without root or tools it prints why and a JSON line with ``"skipped"``, and exits 0.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, emit_json
from _testbed_busy import Busy, cpu_ratio, ratio, summary
from _testbed_worker import bench_worker, write_json

from gossipnet.config import Config
from gossipnet.testbed import Testbed, check_tcp_frames, measure_loss, unavailable_reason
from gossipnet.testbed._shaping import tbf_burst_bytes

_WIRE_OVERHEAD = 20 + 8 + 13 + 36 + 300  # IP, UDP, framing, MAC frame, msgpack header (generous)


def chunk_for_mtu(mtu: int) -> int:
    """Largest chunk (multiple of 8, at most 8 KiB) whose datagram fits one frame."""
    return min(8192, (mtu - _WIRE_OVERHEAD) // 8 * 8)


def _args() -> Any:
    p = bench_parser(__doc__)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--losses", default=None, help="kernel loss rates (quick: 0,0.05,0.1)")
    p.add_argument(
        "--cap-losses", default=None, help="capped rows' rates (quick: 0,0.05; '' for none)"
    )
    p.add_argument("--busy", type=int, default=1, help="busy-loop processes in the busy rows")
    p.add_argument(
        "--busy-losses", default=None, help="uncapped rows run busy too (0.05; '' for none)"
    )
    p.add_argument("--cap-mbit", type=float, default=100.0, help="the capped rows' link rate")
    p.add_argument("--queue-ms", type=float, default=50.0, help="cap queue (delay bound)")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--chunk-bytes", type=int, default=None, help="default: fits the MTU")
    p.add_argument("--hidden", type=int, default=2048, help="MLP width (2048: 17 MB grads)")
    p.add_argument("--no-pace", action="store_true", help="capped rows: gossipnet unpaced")
    p.add_argument("--reps", type=int, default=None, help="timed gossipnet ops per row")
    p.add_argument("--gloo-reps", type=int, default=None, help="timed gloo ops per row")
    p.add_argument("--gloo-timeout-s", type=float, default=None, help="bound of one gloo op")
    p.add_argument("--probe-packets", type=int, default=None, help="loss check per rate")
    p.add_argument("--plot", default="runs/testbed.png")
    p.add_argument(
        "--profile-dir",
        default=None,
        help="cProfile each host's gossipnet loop thread (thread CPU time) over the timed "
        "reps; writes <op>-<rank>-<phase>.prof there (pstats)",
    )
    a = p.parse_args()
    q = a.quick
    a.reps = a.reps or (3 if q else 7)
    a.gloo_reps = a.gloo_reps or (3 if q else 7)
    a.gloo_timeout_s = a.gloo_timeout_s or (10.0 if q else 60.0)
    a.probe_packets = a.probe_packets or (2000 if q else 5000)
    a.chunk_bytes = a.chunk_bytes or chunk_for_mtu(a.mtu)
    a.losses = a.losses or ("0,0.05,0.1" if q else "0,0.01,0.05,0.1")
    a.loss_list = [float(x) for x in a.losses.split(",")]
    # None: the preset; "" (``--cap-losses ''``): no such rows
    a.cap_losses = ("0,0.05" if q else a.losses) if a.cap_losses is None else a.cap_losses
    a.cap_list = [float(x) for x in a.cap_losses.split(",") if x]
    a.busy_losses = ("0.05" if q else "0,0.05") if a.busy_losses is None else a.busy_losses
    a.busy_list = [float(x) for x in a.busy_losses.split(",") if x] if a.busy > 0 else []
    return a


def _wait_all(tb: Testbed, tasks: list[Any], paths: list[Path], deadline_s: float) -> list[Any]:
    """Wait for every file in ``paths``; fail fast if a worker died."""
    end = time.monotonic() + deadline_s
    while not all(p.exists() for p in paths):
        for t in tasks:
            if t.done():
                t.result(5.0)  # raises the worker's traceback
                raise RuntimeError(f"{t.label} exited before the bench ended")
        if time.monotonic() > end:
            missing = [p.name for p in paths if not p.exists()]
            raise TimeoutError(f"no {missing} within {deadline_s:.0f} s")
        time.sleep(0.02)
    return [json.loads(p.read_text()) for p in paths]


def _merge(name: str, per_rank: list[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """One backend-op cell: the slowest rank, or a lower bound when an op timed out."""
    cells = [r[name] for r in per_rank]
    if all(c.get("times") for c in cells):
        per_rep = [max(ts) for ts in zip(*(c["times"] for c in cells), strict=True)]
        out = {
            "s": statistics.median(per_rep),
            "mean_s": statistics.fmean(per_rep),
            "reps_s": [round(t, 4) for t in per_rep],
            "cpu_s": statistics.fmean(c["cpu_s"] for c in cells),
            "timed_out": False,
        }
        for k in ("stale_frac", "delivered", "loop_cpu_s", "caller_cpu_s"):
            if k in cells[0]:
                out[k] = sum(c[k] for c in cells) / len(cells)
        if "loop_cpu_reps" in cells[0]:  # per rep, the mean over ranks
            reps = zip(*(c["loop_cpu_reps"] for c in cells), strict=True)
            out["loop_cpu_reps"] = [round(statistics.fmean(r), 4) for r in reps]
        return out
    # the cut op counts at the timeout: mean over attempted ops >= elapsed / attempts
    bounds = [
        c.get("elapsed", timeout_s) / (c.get("done", 0) + 1) for c in cells if not c.get("times")
    ]
    return {
        "s": max(max(bounds), timeout_s / (max(c.get("done", 0) for c in cells) + 1)),
        "timed_out": True,
    }


def _kernel_drops(tb: Testbed) -> dict[str, int]:
    """Drops outside the loss rule: UDP socket buffers in the hosts (only gossipnet
    uses UDP) and the machine's per-CPU backlog (``softnet_stat``; shared with
    every other process, so an upper bound for the testbed)."""
    out = {"udp_rcvbuf": 0, "udp_sndbuf": 0}
    for h in tb.hosts:
        udp = h.snmp().get("Udp", {})
        out["udp_rcvbuf"] += udp.get("RcvbufErrors", 0)
        out["udp_sndbuf"] += udp.get("SndbufErrors", 0)
    lines = Path("/proc/net/softnet_stat").read_text().split("\n")
    out["backlog"] = sum(int(line.split()[1], 16) for line in lines if line.strip())
    return out


def _run_phases(tb: Testbed, a: Any, ctrl: Path, tasks: list[Any]) -> list[dict[str, Any]]:
    """Every row in turn: uncapped, uncapped with ``--busy`` processes, capped."""
    plan = [(None, loss, 0) for loss in a.loss_list]
    plan += [(None, loss, a.busy) for loss in a.busy_list]
    plan += [(a.cap_mbit, loss, 0) for loss in a.cap_list]
    rows: list[dict[str, Any]] = []
    per_phase_s = 2 * (a.reps + 1) * 10.0 + (2 * a.gloo_reps + 2) * a.gloo_timeout_s + 60
    for k, (cap, loss, busy) in enumerate(plan):
        tb.set_rate(None, cap, queue_ms=a.queue_ms)
        tb.set_loss(None, loss)
        phase = {
            "gn_reps": a.reps,
            "gloo_reps": a.gloo_reps,
            "new_gloo_group": bool(rows) and rows[-1]["gloo_timed_out"],
            "gn_pace_mbps": None if cap is None or a.no_pace else cap,
        }
        with Busy(busy):  # started before both backends' runs, stopped after them
            write_json(ctrl / f"phase-{k}.json", phase)  # atomic: workers poll for it
            t0 = time.monotonic()
            drops0 = _kernel_drops(tb)
            paths = [ctrl / f"result-{k}-{r}.json" for r in range(a.hosts)]
            results = _wait_all(tb, tasks, paths, per_phase_s)
        row: dict[str, Any] = {"loss": loss, "cap_mbit": cap, "busy": busy}
        row["wall_s"] = time.monotonic() - t0
        row["load_1m"] = os.getloadavg()[0]  # other jobs on the machine: read timings with it
        row["kernel_drops"] = {k2: v - drops0[k2] for k2, v in _kernel_drops(tb).items()}
        for backend in ("gossipnet", "gloo"):
            for op in ("step", "allreduce"):
                cells = [r[backend] for r in results]
                row[f"{backend}_{op}"] = _merge(op, cells, a.gloo_timeout_s)
        for op in ("step", "allreduce"):
            row[f"cpu_vs_gloo_{op}"] = cpu_ratio(row, op)
        row["gloo_timed_out"] = row["gloo_step"]["timed_out"] or row["gloo_allreduce"]["timed_out"]
        rows.append(row)
        print(_row_text(row), flush=True)
    (ctrl / "stop").touch()
    return rows


def _fmt(cell: dict[str, Any]) -> str:
    return f">= {cell['s']:.3f} s (timed out)" if cell["timed_out"] else f"{cell['s']:.3f} s"


def _row_text(row: dict[str, Any]) -> str:
    cap = f"{row['cap_mbit']:g} Mbit/s" if row["cap_mbit"] else "none"
    parts = [f"{cap:>12} {row['loss']:>5.0%} {row['busy']:>4}"]
    for op in ("step", "allreduce"):
        gn, gl = row[f"gossipnet_{op}"], row[f"gloo_{op}"]
        r, lb = ratio(gl, gn)
        parts.append(f"{_fmt(gn):>10} {_fmt(gl):>26} {'>=' if lb else '  '}{r:6.2f}x")
    cpu = (row["cpu_vs_gloo_step"], row["cpu_vs_gloo_allreduce"])
    parts.append(" ".join(f"{'-' if c is None else f'{c:.2f}x':>6}" for c in cpu))
    parts.append(f"{row['gossipnet_step'].get('stale_frac', 0.0):6.1%}")
    drops = row["kernel_drops"]
    parts.append(f"{drops['udp_rcvbuf'] + drops['udp_sndbuf']:>6} {drops['backlog']:>6}")
    return " | ".join(parts)


HEADER = (
    f"{'cap':>12} {'loss':>5} busy | {'gossipnet step':>10} {'gloo step':>26} {'gloo/gn':>8} | "
    f"{'gn all-red.':>10} {'gloo all-reduce':>26} {'gloo/gn':>8} | "
    "CPU gn/gloo step, all-red. | gn stale | udp buf drops, backlog drops"
)


def _plot(rows: list[dict[str, Any]], a: Any) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, op in zip(axes, ("step", "allreduce"), strict=True):
        for backend, color in (("gossipnet", "tab:blue"), ("gloo", "tab:red")):
            for cap, style in ((None, "-"), (a.cap_mbit, "--")):
                sel = [r for r in rows if r["cap_mbit"] == cap and not r["busy"]]
                xs = [100 * r["loss"] for r in sel]
                ys = [r[f"{backend}_{op}"]["s"] for r in sel]
                label = f"{backend} ({'no cap' if cap is None else f'{cap:g} Mbit/s'})"
                ax.plot(xs, ys, style, color=color, marker="o", label=label)
                lb = [
                    (x, y)
                    for x, y, r in zip(xs, ys, sel, strict=True)
                    if r[f"{backend}_{op}"]["timed_out"]
                ]
                if lb:
                    ax.plot(*zip(*lb, strict=True), "^", color=color, markersize=11)
            busy = [r for r in rows if r["busy"]]
            if busy:
                ys = [r[f"{backend}_{op}"]["s"] for r in busy]
                ax.plot([100 * r["loss"] for r in busy], ys, "x", color=color, markersize=10)
        ax.set_yscale("log")
        ax.set_xlabel("kernel packet loss (%)")
        ax.set_ylabel(f"seconds per {'training step' if op == 'step' else 'all-reduce'}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    marks = "^ = timed out (lower bound), x = --busy"
    fig.suptitle(f"{a.hosts} hosts, MTU {a.mtu}, MLP width {a.hidden}; {marks}")
    fig.tight_layout()
    path = Path(a.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _settings(tb: Testbed, a: Any, frames: Any) -> dict[str, Any]:
    """Every setting that shapes the numbers, printed and put in the JSON."""
    keys = ("tcp_congestion_control", "tcp_sack", "tcp_recovery", "tcp_early_retrans")
    sysctl = tb.hosts[0].run(["sysctl", *(f"net.ipv4.{k}" for k in keys)], check=False)
    params = a.hidden * a.hidden + 44 * a.hidden + 10
    cap_text = (
        f"tbf {a.cap_mbit:g} Mbit/s on both ends of every host link, {a.queue_ms:g} ms queue, "
        f"{tbf_burst_bytes(a.cap_mbit, a.mtu)} B burst"
    )
    return {
        "hosts": f"{a.hosts} namespaces on one bridge, 1 torch thread each, {_cores()} CPU cores",
        "loss": "nftables numgen random on the switch's bridge forward hook, each host's "
        "outgoing frames (end-to-end loss = the set rate)",
        "links": f"veth MTU {a.mtu}, gso_max_segs 1 (one wire frame per packet)",
        "tcp_frames": str(frames),
        "tcp": " ".join(sysctl.stdout.split()) + " (kernel defaults, untuned)",
        "payload": f"MLP 32-{a.hidden}-{a.hidden}-10: {params} float32 = {params * 4 / 1e6:.1f} MB",
        "gossipnet": f"UDP backend, chunk {a.chunk_bytes} B, MAC {Config().mac}, "
        f"collective timeout 10 s, {a.reps} reps + 1 warm-up per op",
        "gloo": f"torch.distributed gloo all_reduce over TCP on eth0, {a.gloo_reps} reps, "
        f"op timeout {a.gloo_timeout_s:g} s",
        "cap": cap_text,
        "pacing": "off" if a.no_pace else f"gossipnet capped rows: udp_pace_mbps={a.cap_mbit:g}",
        "statistic": "per rep the slowest host, then the median over reps",
        "busy": f"{a.busy} pure-Python busy loops on the machine (outside the namespaces) "
        f"through both backends' runs of the rows at loss {a.busy_losses}, no cap"
        if a.busy
        else "off",
        "cpu": "process_time of each host's worker per op (all its threads), mean over hosts",
    }


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def main() -> int:
    a = _args()
    reason = unavailable_reason()
    if reason:
        print(f"bench/testbed.py skipped: {reason}")
        emit_json(
            {
                "skipped": reason,
                "gloo_vs_gossipnet_5pct": None,
                "gossipnet_10pct_vs_0pct": None,
                "cpu_vs_gloo_0pct": None,
                "gloo_vs_gossipnet_5pct_busy": None,
            }
        )
        return 0
    t_start = time.monotonic()
    with Testbed(hosts=a.hosts, mtu=a.mtu) as tb:
        checks = []
        for loss in sorted({*a.loss_list, *a.cap_list, *a.busy_list}):
            tb.set_loss(None, loss)
            m = measure_loss(tb, 0, 1, count=a.probe_packets)
            print(f"loss check: {m}", flush=True)
            checks.append({"set": loss, "measured": round(m.rate, 4), "ok": m.ok})
        tb.set_loss(None, 0.0)
        frames = check_tcp_frames(tb, 0, 1)
        settings = _settings(tb, a, frames)
        for key, value in settings.items():
            print(f"setting {key}: {value}", flush=True)
        if not frames.ok or not all(c["ok"] for c in checks):
            raise RuntimeError("the testbed's links are not what they claim; see above")
        ctrl = tb.run_dir / "ctrl"
        ctrl.mkdir()
        plan = {
            "ips": [h.ip for h in tb.hosts],
            "hidden": a.hidden,
            "chunk_bytes": a.chunk_bytes,
            "gloo_timeout_s": a.gloo_timeout_s,
            "gn_timeout_s": 10.0,
            "idle_timeout_s": 600.0,
            "profile_dir": str(Path(a.profile_dir).resolve()) if a.profile_dir else None,
        }
        if a.profile_dir:
            Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
        env = {"GLOO_SOCKET_IFNAME": "eth0"}
        tasks = [
            h.start(bench_worker, i, plan, str(ctrl), env=env, label=f"bench-{h.name}")
            for i, h in enumerate(tb.hosts)
        ]
        _wait_all(tb, tasks, [ctrl / f"ready-{r}.json" for r in range(a.hosts)], 180.0)
        print(HEADER, flush=True)
        rows = _run_phases(tb, a, ctrl, tasks)
        for t in tasks:
            t.result(60.0)
    result = summary(rows, a.cap_mbit, a.busy)
    for key, value in result.items():
        if key != "lower_bounds":
            print(f"{key}: {value}")
    plot = _plot(rows, a)
    print(f"plot: {plot}")
    emit_json(
        {
            **result,
            "plot": plot,
            "loss_check": checks,
            "settings": settings,
            "rows": rows,
            "config": {k: v for k, v in vars(a).items() if not k.endswith("_list")},
            "wall_s": round(time.monotonic() - t_start, 1),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
