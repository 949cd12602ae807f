"""Send pacing for the UDP backend: a token bucket at the link's rate.

Why: a collective hands the transport thousands of datagrams at once (the
all-reduce sends its whole reduce-scatter share in one burst).  On an
uncapped LAN the kernel takes them at memory speed, but behind a slower link
(a NIC, a shaper, a switch port) the burst lands in a queue of a few
milliseconds and the excess is tail-dropped: measured on the namespace
testbed with a 100 Mbit/s ``tbf`` cap, an unpaced 17 MB all-reduce left two
thirds of its chunks stale, all of it self-inflicted loss.  TCP avoids this
with congestion control; a loss-tolerant UDP sender that never retransmits
has to be told the rate instead (``Config.udp_pace_mbps``) and keep to it.

Why one FIFO per destination, served round-robin: the all-reduce sends its
chunks owner by owner (contiguous shards) and every peer starts with the same
owner, so paced in arrival order all senders would hit one receiver's port at
once (incast: k-1 times its rate, dropped at the switch) and then the next.
Interleaving destinations spreads each sender's rate over every receiver,
while each destination still sees its packets in the order they were sent
(an END marker never overtakes the data it counts).

The bucket counts wire bytes (datagram + UDP, IPv4 and Ethernet headers),
as a shaper does.  Pure logic over an injected clock and send function, so it
is tested with ``FakeClock`` and no sockets.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any

from gossipnet.clock import Clock, TimerHandle

__all__ = ("WIRE_OVERHEAD_BYTES", "Pacer", "default_burst_bytes")

#: Bytes a link carries per datagram beyond its payload: Ethernet 14 + IPv4 20 + UDP 8.
WIRE_OVERHEAD_BYTES = 42
#: Shortest timer the pacer arms: below this the loop's own latency dominates.
_MIN_WAIT_S = 1e-4


def default_burst_bytes(rate_bytes_s: float) -> int:
    """Bucket depth: 4 ms at the rate, at least 64 KiB.

    Why not 0: a timer fires late by a fraction of a millisecond, and a
    bucket that cannot absorb that lateness sends below the rate.  Why not
    more: a shaper's queue holds tens of milliseconds; a 4 ms burst at the
    rate fits any sane one.
    """
    return max(65536, int(rate_bytes_s * 0.004))


class Pacer:
    """Token bucket in front of ``emit``, with a bounded FIFO per destination.

    Args:
        rate_bytes_s: long-run wire bytes per second.
        burst_bytes: bucket depth (bytes that may leave back to back).
        queue_packets: per-destination queue limit; a full queue refuses.
        clock: time and timers (the loop's, or a ``FakeClock`` in tests).
        emit: sends one datagram now (``emit(dst, data)``); its own drops are its own.
    """

    def __init__(
        self,
        rate_bytes_s: float,
        burst_bytes: int,
        queue_packets: int,
        clock: Clock,
        emit: Callable[[Any, bytes], object],
    ) -> None:
        if rate_bytes_s <= 0 or burst_bytes <= 0 or queue_packets <= 0:
            raise ValueError("rate_bytes_s, burst_bytes and queue_packets must be > 0")
        self.rate = float(rate_bytes_s)
        self.burst = float(burst_bytes)
        self.queue_packets = queue_packets
        self.clock = clock
        self._emit = emit
        self._tokens = self.burst
        self._stamp = clock.now()
        self._queues: OrderedDict[Hashable, deque[bytes]] = OrderedDict()
        self._timer: TimerHandle | None = None
        self.queued = 0  # packets waiting now
        self.max_queued = 0  # high-water mark, for diagnostics

    def _refill(self) -> None:
        now = self.clock.now()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def submit(self, dst: Hashable, data: bytes, *, urgent: bool = False) -> bool:
        """Send ``data`` now if the bucket allows and nothing waits, else queue it.

        ``urgent`` (small control packets: heartbeats, membership) goes now in any
        case and is charged to the bucket, which may go into debt: the queued data
        waits that much longer, so the long-run rate still holds.

        Returns False (nothing queued) when ``dst``'s queue is full.
        """
        if urgent:
            self._refill()
            self._tokens -= len(data) + WIRE_OVERHEAD_BYTES
            self._emit(dst, data)
            return True
        if not self._queues:
            self._refill()
            if self._tokens > 0:
                self._tokens -= len(data) + WIRE_OVERHEAD_BYTES
                self._emit(dst, data)
                return True
        queue = self._queues.get(dst)
        if queue is None:
            queue = self._queues[dst] = deque()
        elif len(queue) >= self.queue_packets:
            return False
        queue.append(data)
        self.queued += 1
        self.max_queued = max(self.max_queued, self.queued)
        self._arm()
        return True

    def _arm(self) -> None:
        if self._timer is None and self._queues:
            # wake when half the bucket has refilled, not at the first token: one timer
            # then sends several packets (measured: a timer per 8 KB packet at 100 Mbit/s
            # doubled the sender's CPU time), and the rest of the bucket absorbs timer lateness
            wait = max(_MIN_WAIT_S, (self.burst / 2 - self._tokens) / self.rate)
            self._timer = self.clock.call_later(wait, self._drain)

    def _drain(self) -> None:
        """Timer: send while the bucket has tokens, one packet per destination in turn."""
        self._timer = None
        self._refill()
        queues = self._queues
        while queues and self._tokens > 0:
            dst, queue = next(iter(queues.items()))
            data = queue.popleft()
            self.queued -= 1
            if queue:
                queues.move_to_end(dst)
            else:
                del queues[dst]
            self._tokens -= len(data) + WIRE_OVERHEAD_BYTES
            self._emit(dst, data)
        self._arm()

    def close(self) -> int:
        """Cancel the timer and discard what waits; returns how many packets were discarded."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        dropped = self.queued
        self._queues.clear()
        self.queued = 0
        return dropped
