"""When a phase of an all-reduce round ends: END markers, or per-sender cut times.

Split from :mod:`gossipnet.averaging.allreduce` because both phases (the
reduce-scatter and the all-gather of :mod:`.broadcast`) end the same way and
the policy is subtle enough to read on its own: a phase ends the moment every
expected sender is complete (all its data, or its END marker, arrived); a
sender that is not is cut at a time learned from recent phases, or shortly
after we learn it moved on, or at the call's deadline.  Why this matters: the
time of a round must not grow with the loss rate, yet a slow-but-alive peer
must not be cut.  Runs on the loop thread, once per wake-up, not per packet.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
from collections.abc import Callable

from .._node import Node
from ..config import Config
from ._round import Phase

__all__ = ("cut_time", "wait_phase")

#: How long after a sender is known to have moved past a phase we still wait for its
#: packets of that phase (in flight, or reordered behind its later packets).
MOVED_ON_GRACE_S = 0.02
#: While a phase waits, our own END is re-sent after this long, then at doubling intervals.
END_REPEAT_S = 0.02
END_REPEAT_MAX_S = 0.1


async def wait_phase(
    node: Node,
    phase: Phase,
    history: collections.deque[float],
    deadline: float,
    expected: Callable[[str], int],
    announce: Callable[[], None] | None = None,
) -> bool:
    """Wait until every expected END arrived, or give up; True if complete.

    Each sender gets its own learned allowance, counted from its first packet
    of the phase: ``phase_deadline_factor`` x the median first-packet-to-END
    span of recent senders (``history``, seconds per packet), and never while it
    is still sending.  Why per sender: peers start a round at different times
    (compute skew), so a clock started at our own start would cut
    slow-but-alive peers, while one started at their first packet only cuts
    peers whose remaining packets are lost.  A sender known to have moved past
    the phase (its packets of the next phase or round arrived, or its heartbeat
    announced a later round) is cut ``MOVED_ON_GRACE_S`` after we learned it:
    everything it sent here is on the wire, and what has not arrived by then was
    lost.  This bounds the cost of lost END markers under bursty loss, and of a
    sender whose every packet was lost.  A silent sender with no such sign is
    waited for until ``deadline`` (the call's bound) or until membership
    declares it dead: it may simply have started late.

    ``announce`` re-sends our own END marker of the phase while we wait, at
    growing intervals (``END_REPEAT_S`` doubling up to ``END_REPEAT_MAX_S``):
    a tiny control packet, not data.  Why: under bursty loss all back-to-back
    END copies can be lost, and two peers that lost all of each other's
    packets would otherwise each wait for the other until the deadline.

    Args:
        expected: packets a sender sends us in this phase if it shares our view.
    """
    clock = node.clock
    interval = END_REPEAT_S
    next_announce = clock.now() + interval
    while not phase.complete:
        # re-read each pass: senders finishing this very phase teach a cold engine
        per_packet = statistics.median(history) if history else float("inf")
        now = clock.now()
        if now >= deadline:
            return False
        pending = phase.expected - phase.done
        cut_at = deadline
        if all(p in phase.first or p in phase.moved_on for p in pending):
            cut_at = min(
                deadline,
                max(cut_time(node.config, phase, p, per_packet, expected(p)) for p in pending),
            )
            if now >= cut_at:
                return False
        if announce is not None and now >= next_announce:
            announce()
            interval = min(2 * interval, END_REPEAT_MAX_S)
            next_announce = now + interval
        wake_at = min(cut_at, next_announce) if announce is not None else cut_at
        phase.wake.clear()
        waiter = asyncio.ensure_future(phase.wake.wait())
        try:
            await node._wait_future(waiter, max(0.0, wake_at - now))
        except TimeoutError:
            pass
        finally:
            waiter.cancel()
    return True


def cut_time(cfg: Config, phase: Phase, peer: str, per_packet: float, expected: int) -> float:
    """When to stop waiting for ``peer``: ``factor x`` its expected sending time
    (learned seconds per packet x packets expected) after its first packet, and
    never while it sent anything within ``phase_min_wait_s``."""
    moved = phase.moved_on.get(peer)
    if moved is not None:
        return max(moved, phase.last.get(peer, moved)) + MOVED_ON_GRACE_S
    allowance = max(cfg.phase_min_wait_s, cfg.phase_deadline_factor * per_packet * max(1, expected))
    return max(phase.first[peer] + allowance, phase.last[peer] + cfg.phase_min_wait_s)
