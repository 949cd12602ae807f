"""CPU seconds per collective: what the network costs the machine it runs on.

Why: gossipnet's advantage under loss holds only while the CPU it burns is
free, and real training shares the CPU with data loading and the framework.
A collective's wall time says nothing about that; its CPU time does.  So
every collective's report carries ``extra["cpu_s"]`` (the event-loop
thread's CPU seconds over the collective) and ``extra["cpu_caller_s"]`` (the
calling thread's, where it does real work: flattening, staging copies,
writing results back).

How, and why that cheaply: :func:`time.thread_time` read twice per
collective on each thread, never per packet.  The loop thread's figure is a
delta over the collective's lifetime on that thread, so it also counts
whatever else the loop did meanwhile (heartbeats, membership, another
collective running concurrently, packets of other rounds): it is the
loop's cost while the collective ran, not an exact attribution, and for a
tiny collective the heartbeats can be most of it.  Work that the loop
hands to other threads (``asyncio.to_thread``, e.g. a resync's parameter
digest) is on neither figure.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gossipnet.reports import CollectiveReport

__all__ = ("CPU_CALLER_KEY", "CPU_LOOP_KEY", "loop_cpu", "stamp_cpu")

T = TypeVar("T")

CPU_LOOP_KEY = "cpu_s"
CPU_CALLER_KEY = "cpu_caller_s"


async def loop_cpu(make: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    """Run ``make()`` on the loop thread; return its result and the loop thread's
    CPU seconds meanwhile (``time.thread_time`` at start and end, so >= 0).

    Why a factory, not an awaitable: a call refused before it runs (the peer was
    closed) closes this coroutine unstarted; an inner coroutine made by the caller
    would then be collected never awaited (a ``RuntimeWarning``).
    """
    t0 = time.thread_time()
    out = await make()
    return out, max(0.0, time.thread_time() - t0)


def stamp_cpu(
    report: CollectiveReport, loop_s: float, caller_s: float | None = None
) -> CollectiveReport:
    """Put the CPU figures into ``report.extra`` (see the module doc); returns ``report``.

    Args:
        report: the collective's report, changed in place.
        loop_s: the loop thread's CPU seconds over the collective.
        caller_s: the calling thread's CPU seconds for it, or None where the caller
            only waited (the key is then absent).
    """
    report.extra[CPU_LOOP_KEY] = max(0.0, loop_s)
    if caller_s is not None:
        report.extra[CPU_CALLER_KEY] = max(0.0, caller_s)
    return report
