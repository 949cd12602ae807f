"""Helpers shared by the bench scripts (not a bench itself: running it does nothing).

Why a module: every bench needs the same four things and they should behave
the same everywhere: a ``--quick`` preset CI can afford, a machine-readable
last stdout line, free loopback ports, and N spawned worker processes whose
failure stops the bench loudly instead of hanging it at a barrier.

    from _common import bench_parser, emit_json, free_ports, run_workers

(``bench/`` is ``sys.path[0]`` when a script there runs, and spawned children
inherit the parent's ``sys.path``.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import queue
import random
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ("SPAWN", "bench_parser", "emit_json", "free_ports", "median", "run_workers")

#: The start method of every bench: ``fork`` would copy a parent's threads and
#: sockets (and torch's thread pools) into the children; ``spawn`` starts clean.
SPAWN = mp.get_context("spawn")


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with ``--quick``; its description is the doc's first line."""
    first = (doc or "").strip().split("\n", 1)[0]
    parser = argparse.ArgumentParser(description=first)
    parser.add_argument("--quick", action="store_true", help="small preset, finishes in < 60 s")
    return parser


def emit_json(summary: dict[str, Any]) -> None:
    """Print ``summary`` as one JSON line; call it last, as CI reads the last stdout line."""
    print(json.dumps(summary, default=str), flush=True)


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values (a bench row without data, not a crash)."""
    return statistics.median(values) if values else float("nan")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago, outside the ephemeral range.

    Why outside it: between picking a port and binding it, a bench opens
    connections (gloo's pairs, ZeroMQ's dials), and the kernel gives each an
    ephemeral source port, which once took a port picked here ("Address
    already in use", about one bench run in thirty).  Ports below
    ``ip_local_port_range`` are never handed out that way.  All ``n`` sockets
    stay bound until every port is picked, so the ports differ; where the
    range is unknown (not Linux) the kernel picks, as before.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        tries = 0
        while len(ports) < n:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            tries += 1
            port = rng.randrange(_LOWEST_PORT, low) if low and tries < 50 * n else 0
            try:
                sock.bind((host, port))
            except OSError:
                continue  # taken: draw again
            ports.append(sock.getsockname()[1])
        return ports


#: Bench ports are drawn from here up to the ephemeral range's start.
_LOWEST_PORT = 20000


def _ephemeral_low() -> int | None:
    """The first ephemeral port (Linux), if it leaves room above ``_LOWEST_PORT``."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return low if low > _LOWEST_PORT + 1000 else None


def _worker_main(target: Callable[..., Any], rank: int, args: tuple[Any, ...], out: Any) -> None:
    try:
        out.put((rank, True, target(rank, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
        raise


def _next_result(
    out: Any, procs: list[Any], results: dict[int, Any], deadline: float, timeout_s: float
) -> tuple[int, bool, Any]:
    """The next (rank, ok, value) from ``out``; RuntimeError if a worker died silently."""
    while True:
        try:
            return out.get(timeout=0.5)  # type: ignore[no-any-return]
        except queue.Empty:
            pass
        silent = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
        if silent:
            try:  # its last words may still be in the pipe
                return out.get(timeout=2.0)  # type: ignore[no-any-return]
            except queue.Empty:
                codes = {r: procs[r].exitcode for r in silent}
                raise RuntimeError(f"worker(s) died without a result: exit codes {codes}") from None
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers still running after {timeout_s:.0f} s")


def run_workers(
    target: Callable[..., Any], n: int, args: Sequence[Any] = (), *, timeout_s: float = 300.0
) -> list[Any]:
    """Run ``target(rank, *args)`` in ``n`` spawned processes; their results by rank.

    ``target`` must be a module-level function and ``args`` picklable (for
    barriers, events and queues use :data:`SPAWN`'s factories).  The first
    worker that raises, or dies without a result, ends the run: the others
    are killed (they may be waiting for it at a barrier) and RuntimeError
    carries its traceback.  So does ``timeout_s`` passing.

    Raises:
        RuntimeError: a worker failed, died, or the run took longer than ``timeout_s``.
    """
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_worker_main, args=(target, r, tuple(args), out), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < n:
            rank, ok, value = _next_result(out, procs, results, deadline, timeout_s)
            if not ok:
                raise RuntimeError(f"worker {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(results) == n else 0.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [results[r] for r in range(n)]


if __name__ == "__main__":  # `make bench` runs every bench/*.py with --quick
    pass
