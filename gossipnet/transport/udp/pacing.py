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
as a shaper does.  With UDP GSO an item is a batch of datagrams that leaves in
one system call: the bucket takes the batch's bytes at once (``wire_bytes``)
and the queue bound counts its datagrams (``packets``), so pacing costs one
decision per batch, not per packet.  Pure logic over an injected clock and send function, so it
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
        emit: sends one item (a datagram or a batch) now (``emit(dst, data)``); its
            own drops are its own.
    """

    def __init__(
        self,
        rate_bytes_s: float,
        burst_bytes: int,
        queue_packets: int,
        clock: Clock,
        emit: Callable[[Any, Any], object],
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
        # per destination: FIFO of (item, wire bytes, datagrams), and its datagram count
        self._queues: OrderedDict[Hashable, deque[tuple[Any, int, int]]] = OrderedDict()
        self._counts: dict[Hashable, int] = {}
        self._timer: TimerHandle | None = None
        self.queued = 0  # packets waiting now
        self.max_queued = 0  # high-water mark, for diagnostics

    def _refill(self) -> None:
        now = self.clock.now()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def submit(
        self,
        dst: Hashable,
        data: Any,
        *,
        urgent: bool = False,
        wire_bytes: int | None = None,
        packets: int = 1,
    ) -> bool:
        """Send ``data`` now if the bucket allows and nothing waits, else queue it.

        ``urgent`` (small control packets: heartbeats, membership) goes now in any
        case and is charged to the bucket, which may go into debt: the queued data
        waits that much longer, so the long-run rate still holds.

        ``wire_bytes``: what the item costs the link (default: one datagram,
        ``len(data)`` + :data:`WIRE_OVERHEAD_BYTES`); ``packets``: datagrams in it.

        Returns False (nothing queued) when ``dst``'s queue would exceed its bound.
        """
        wire = len(data) + WIRE_OVERHEAD_BYTES if wire_bytes is None else wire_bytes
        if urgent:
            self._refill()
            self._tokens -= wire
            self._emit(dst, data)
            return True
        if not self._queues:
            self._refill()
            if self._tokens > 0:
                self._tokens -= wire
                self._emit(dst, data)
                return True
        count = self._counts.get(dst, 0)
        if count and count + packets > self.queue_packets:
            return False
        queue = self._queues.get(dst)
        if queue is None:
            queue = self._queues[dst] = deque()
        queue.append((data, wire, packets))
        self._counts[dst] = count + packets
        self.queued += packets
        self.max_queued = max(self.max_queued, self.queued)
        self._arm()
        return True

    def queued_for(self, dst: Hashable) -> int:
        """Datagrams waiting for ``dst`` now."""
        return self._counts.get(dst, 0)

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
            data, wire, packets = queue.popleft()
            self.queued -= packets
            if queue:
                queues.move_to_end(dst)
                self._counts[dst] -= packets
            else:
                del queues[dst]
                del self._counts[dst]
            self._tokens -= wire
            self._emit(dst, data)
        self._arm()

    def close(self) -> int:
        """Cancel the timer and discard what waits; returns how many packets were discarded."""
        dropped = self.queued
        self.discard()
        return dropped

    def discard(self) -> list[Any]:
        """Cancel the timer and empty every queue; returns the items that waited."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items = [entry[0] for queue in self._queues.values() for entry in queue]
        self._queues.clear()
        self._counts.clear()
        self.queued = 0
        return items
