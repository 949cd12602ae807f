"""When a phase of an all-reduce round ends: END markers, or per-sender cut times.

Split from :mod:`gossipnet.collectives.lossy.engine` because both phases (the
reduce-scatter and the all-gather of :mod:`.gather`) end the same way and
the policy is subtle enough to read on its own: a phase ends the moment every
expected sender is complete (all its data, or its END marker, arrived); a
sender that is not is cut at a time learned from recent phases, or shortly
after we learn it moved on, or at the call's deadline.  Why this matters: the
time of a round must not grow with the loss rate, yet a slow-but-alive peer
must not be cut.  Runs on the loop thread, once per wake-up, not per packet.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable

from gossipnet.collectives.lossy.round import Phase
from gossipnet.config import Config
from gossipnet.runtime.node import Node

__all__ = ("ReorderWindow", "StallWindow", "cut_time", "wait_phase")

#: How long after a sender is known to have moved past a phase we still wait for its
#: packets of that phase (in flight, or reordered behind its later packets).
MOVED_ON_GRACE_S = 0.02
#: While a phase waits, our own END is re-sent after this long, then at doubling intervals.
END_REPEAT_S = 0.02
END_REPEAT_MAX_S = 0.1


class _LearnedWait:
    """Delays observed in recent rounds and the wait they justify: ``1.5 x`` the
    longest seen within the last ``memory_rounds`` rounds, at most ``cap_s``, 0 when
    none was.  The two windows below differ only in what they observe."""

    def __init__(self, cap_s: float, memory_rounds: int) -> None:
        if cap_s < 0 or memory_rounds < 1:
            raise ValueError(f"cap_s must be >= 0 and memory_rounds >= 1: {cap_s}, {memory_rounds}")
        self.cap_s = cap_s
        self.memory_rounds = memory_rounds
        self._seen: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)

    def _note(self, delay_s: float, round_: int) -> None:
        self._seen.append((round_, max(0.0, delay_s)))

    def _longest(self, round_: int) -> float:
        return max((d for r, d in self._seen if r > round_ - self.memory_rounds), default=0.0)

    def _wait(self, longest: float) -> float:
        return min(self.cap_s, 1.5 * longest) if longest > 0 else 0.0


class ReorderWindow(_LearnedWait):
    """How long after a sender's END its reordered data still arrives, learned.

    Why: an END marker can overtake data sent before it (a reordering network, a
    delayed packet); ending the sender's phase on its END then makes that data
    stale although nothing was lost.  Waiting for every missing packet instead
    would cost each lossy round a wait for packets that never come.  So the wait
    is learned from arrival times: each packet that arrives after its sender's
    END teaches its lag; while some were seen within the last ``memory_rounds``
    rounds, an END with data missing holds its sender ``1.5 x`` the largest such
    lag (at most ``cap_s``); when none was, it holds nothing.  Pure loss teaches
    nothing, so lossy rounds stay as short as before.

    Args:
        cap_s: the longest hold; a packet later than this is an outage, not a reorder.
        memory_rounds: how many rounds an observed lag keeps counting.
    """

    def __init__(self, cap_s: float = 0.05, memory_rounds: int = 32) -> None:
        super().__init__(cap_s, memory_rounds)

    def observe(self, lag_s: float, round_: int) -> None:
        """A packet of round ``round_`` arrived ``lag_s`` after its sender's END."""
        self._note(lag_s, round_)

    def allowance(self, round_: int) -> float:
        """Seconds to hold a sender whose END (of round ``round_``) left data missing."""
        return self._wait(self._longest(round_))


class StallWindow(_LearnedWait):
    """How long a sender that went quiet mid-stream may still resume, learned.

    Why: a phase cuts a sender whose packets stopped once nobody has delivered for
    ``Config.phase_min_wait_s`` (its remaining packets are taken as lost).  On a
    crowded machine a live peer's process can stop sending for longer than that
    (descheduled, or its loop busy with a large drain): cutting it then leaves its
    chunks out of the round at 0% loss, and its packets arrive late.  Each such
    late packet from a sender that was cut mid-stream teaches how long it really
    was quiet; while some were seen within the last ``memory_rounds`` rounds,
    phases wait ``1.5 x`` the longest such stall (at most ``cap_s``) before
    cutting.  Each engine announces the longest stall it saw itself in its
    heartbeats (:meth:`own`), and its peers wait as long (:meth:`heard`): the
    hosts of one job tend to be alike, and every owner would otherwise pay one cut
    before it learns.  Lost packets never arrive, so pure loss teaches nothing
    and lossy rounds stay as short as before.

    Args:
        cap_s: the longest wait; a stall longer than this is an outage.
        memory_rounds: how many rounds an observed stall keeps counting.
    """

    def __init__(self, cap_s: float = 0.5, memory_rounds: int = 32) -> None:
        super().__init__(cap_s, memory_rounds)
        # what each peer announced it observed itself (heartbeat beacon), seconds
        self._peers: dict[str, float] = {}

    def observe(self, stall_s: float, round_: int) -> None:
        """A sender cut in round ``round_`` resumed after ``stall_s`` of silence."""
        self._note(stall_s, round_)

    def own(self, round_: int) -> float:
        """The longest stall we observed ourselves within the memory (0: none): what we
        announce, so our peers wait before their own first cut (never an echo of theirs)."""
        return self._longest(round_)

    def heard(self, peer: str, stall_s: float) -> None:
        """``peer`` announced the longest stall it observed recently (0: none)."""
        if stall_s > 0:
            self._peers[peer] = min(self.cap_s, stall_s)
        else:
            self._peers.pop(peer, None)

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def allowance(self, round_: int) -> float:
        """Seconds of silence before a phase of round ``round_`` cuts (0: the default)."""
        return self._wait(max(self.own(round_), max(self._peers.values(), default=0.0)))


async def wait_phase(
    node: Node,
    phase: Phase,
    history: collections.deque[float],
    deadline: float,
    expected: Callable[[str], int],
    announce: Callable[[], None] | None = None,
    quiet: Callable[[], float] | None = None,
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
        quiet: the learned silence before a cut (:class:`StallWindow`), if longer
            than ``Config.phase_min_wait_s``.
    """
    clock = node.clock
    interval = END_REPEAT_S
    next_announce = clock.now() + interval
    while not phase.complete:
        # re-read each pass: senders finishing this very phase teach a cold engine
        per_packet = statistics.median(history) if history else float("inf")
        silence = max(node.config.phase_min_wait_s, quiet() if quiet is not None else 0.0)
        now = clock.now()
        if now >= deadline:
            return False
        pending = phase.expected - phase.done
        for p in [p for p in pending if phase.hold.get(p, deadline) <= now]:
            phase.finish(p, now)  # its held-back data did not come: it was lost
            pending.discard(p)
        if not pending:
            break
        cut_at = deadline
        if all(p in phase.first or p in phase.moved_on for p in pending):
            cut_at = min(
                deadline,
                max(
                    cut_time(node.config, phase, p, per_packet, expected(p), silence)
                    for p in pending
                ),
            )
            if now >= cut_at:
                return False
        if announce is not None and now >= next_announce:
            announce()
            interval = min(2 * interval, END_REPEAT_MAX_S)
            next_announce = now + interval
        wake_at = min(cut_at, next_announce) if announce is not None else cut_at
        wake_at = min([wake_at, *(phase.hold[p] for p in pending if p in phase.hold)])
        phase.wake.clear()
        await phase.wake.wait(clock, wake_at - now)
    return True


def cut_time(
    cfg: Config,
    phase: Phase,
    peer: str,
    per_packet: float,
    expected: int,
    silence: float | None = None,
) -> float:
    """When to stop waiting for ``peer``: ``factor x`` its expected sending time
    (learned seconds per packet x packets expected) after its first packet, and
    never while any sender of the phase delivered within ``silence`` (default
    ``phase_min_wait_s``; longer where :class:`StallWindow` learned stalls).

    Why silence is counted on the whole phase, not on ``peer`` alone: a sender
    that is also an owner receives everyone's chunks while it sends its own, and
    on a crowded machine (2 cores, 4 peers, 400 chunks each) it can spend over
    0.1 s on that before its next packet to us, so a per-sender silence rule cut
    live senders at 0% loss.  While others still deliver to us, they still
    deliver to it, and it has not stalled for good.  Waiting longer costs
    nothing then: the phase cannot end before those other senders complete.
    """
    held = phase.hold.get(peer)
    if held is not None:
        return held
    moved = phase.moved_on.get(peer)
    if moved is not None:
        return max(moved, phase.last.get(peer, moved)) + MOVED_ON_GRACE_S
    allowance = max(cfg.phase_min_wait_s, cfg.phase_deadline_factor * per_packet * max(1, expected))
    quiet = cfg.phase_min_wait_s if silence is None else silence
    return max(phase.first[peer] + allowance, phase.latest + quiet)
