"""The UDP backend's batched send path: queue per destination, flush per loop turn.

Why a queue at all, when ``Transport.send`` is one synchronous packet: the
layers above send a phase's chunks in a loop without yielding, so every
packet of such a burst is known before the loop turns.  Packets accepted by
``send`` wait in a list per destination; one ``loop.call_soon`` callback (or
a full batch: :data:`~.gso.MAX_SEGMENTS` datagrams or 64 KiB) hands each
list to the kernel as few ``sendmsg`` calls with ``UDP_SEGMENT`` as its sizes
allow (:func:`~.gso.runs`).  Latency added: one loop iteration.

Counting (the transport contract: every ``send`` counted exactly once, at
once): an accepted packet counts as sent when ``send`` returns True; if the
kernel later refuses its batch (a full socket buffer, an unreachable
route), it moves from ``sent_packets`` to the drop counter the error names,
as the pacer's accepted packets are already dropped after ``send`` returned.
When GSO is refused the same batch goes out a datagram at a time, so that
refusal loses nothing.

Order: per destination, packets leave in the order sent; an ``urgent``
packet first flushes its destination's queue, then leaves at once (through
the pacer's urgent lane where pacing is on).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Hashable
from typing import Any

from gossipnet.transport.base import TransportStats
from gossipnet.transport.udp.gso import GsoState, PathStats, runs, segment_cmsg
from gossipnet.transport.udp.pacing import WIRE_OVERHEAD_BYTES, Pacer

__all__ = ("BatchSender", "count_send_error", "payload_bytes")

_log = logging.getLogger(__name__)

_QUEUE_FULL_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS})
_UNREACHABLE_ERRNOS = frozenset({errno.EAFNOSUPPORT, errno.ENETUNREACH, errno.EHOSTUNREACH})


def payload_bytes(data: bytes) -> int:
    """Frame bytes of one framed datagram (its ``[count][lengths]`` prefix excluded)."""
    return len(data) - 1 - 4 * data[0]


def count_send_error(stats: TransportStats, err: int, packets: int = 1) -> None:
    """Count ``packets`` refused by the kernel with ``err`` in the matching drop counter."""
    if err in _QUEUE_FULL_ERRNOS:
        stats.dropped_queue_full += packets
    elif err == errno.EMSGSIZE:
        stats.dropped_oversize += packets
    elif err in _UNREACHABLE_ERRNOS:
        stats.dropped_unreachable += packets
    else:
        stats.send_errors += packets


class BatchSender:
    """Per-destination queues flushed as GSO batches, with a plain fallback.

    Args:
        sock: the transport's bound, non-blocking socket.
        loop: schedules the end-of-iteration flush.
        stats: the transport's counters (sent at acceptance, moved on refusal).
        path: the socket's path counters; ``path.gso`` goes False on refusal.
        pacer: the token bucket when ``udp_pace_mbps`` is set (may be set after
            construction, as the pacer's emit is :meth:`emit`); it takes whole batches.
        max_bytes: the largest datagram the socket may send (one batch's limit too).
        name: the endpoint's address, for the log line.
    """

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        stats: TransportStats,
        path: PathStats,
        pacer: Pacer | None,
        max_bytes: int,
        name: str,
    ) -> None:
        self._sock: socket.socket | None = sock
        self._loop = loop
        self._stats = stats
        self._path = path
        self.pacer = pacer
        self._max_bytes = max_bytes
        self._name = name
        self._gso = GsoState(max_segment=max_bytes if path.gso else 0)
        self._pending: dict[Hashable, list[bytes]] = {}
        self._scheduled = False

    def submit(self, addr: Hashable, data: bytes, nbytes: int, *, urgent: bool = False) -> bool:
        """Accept one framed datagram of ``nbytes`` frame bytes for ``addr`` (counted
        sent now); False = dropped.

        Refuses (``dropped_queue_full``) only when pacing and ``addr``'s pacing
        queue plus what waits here reach the pacer's bound.
        """
        stats, pacer = self._stats, self.pacer
        pending = self._pending.get(addr)
        if pacer is not None and not urgent:
            waiting = pacer.queued_for(addr) + (len(pending) if pending else 0)
            if waiting >= pacer.queue_packets:
                stats.dropped_queue_full += 1
                return False
        stats.sent_packets += 1
        stats.sent_bytes += nbytes
        if urgent:
            if pending:
                self._flush(addr)
            self._dispatch(addr, [data], urgent=True)
            return True
        if pending is None:
            pending = self._pending[addr] = []
        pending.append(data)
        if len(pending) >= min(64, self._max_bytes // len(data)):
            self._flush(addr)  # a full batch: no reason to wait, and the list stays bounded
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush_all)
        return True

    def flush_all(self) -> None:
        """Hand every queued datagram to the kernel (or the pacer); the loop's callback."""
        self._scheduled = False
        for addr in list(self._pending):
            self._flush(addr)

    def close(self) -> None:
        """Flush what was accepted (it counts as sent), then stop using the socket."""
        self.flush_all()
        self._sock = None

    def _flush(self, addr: Hashable) -> None:
        datagrams = self._pending.pop(addr, None)
        if not datagrams:
            return
        for run in runs(datagrams, self._gso.max_segment, self._max_bytes):
            self._dispatch(addr, run, urgent=False)

    def _dispatch(self, addr: Hashable, run: list[bytes], *, urgent: bool) -> None:
        pacer = self.pacer
        if pacer is None:
            self.emit(addr, run)
            return
        wire = sum(len(d) for d in run) + WIRE_OVERHEAD_BYTES * len(run)
        if not pacer.submit(addr, run, urgent=urgent, wire_bytes=wire, packets=len(run)):
            self.uncount(run, errno.ENOBUFS)  # the pacer's bound, as a full queue

    def emit(self, addr: Any, run: list[bytes]) -> None:
        """Send ``run`` now: one ``sendmsg`` when it has several segments and GSO is on."""
        sock = self._sock
        if sock is None:
            self.uncount(run, errno.EBADF)
            return
        path = self._path
        if len(run) > 1 and self._gso.max_segment >= len(run[0]):
            try:
                sock.sendmsg(run, segment_cmsg(len(run[0])), 0, addr)
            except OSError as err:
                path.send_calls += 1
                if not self._gso.refused(len(run[0]), err.errno or 0):
                    self.uncount(run, err.errno or 0)
                    return
                self._log_refusal(len(run[0]), err)
            else:
                path.send_calls += 1
                path.gso_batches += 1
                return
        for data in run:
            path.send_calls += 1
            try:
                sock.sendto(data, addr)
            except OSError as err:
                self.uncount([data], err.errno or 0)

    def uncount(self, run: list[bytes], err: int) -> None:
        """Move ``run`` from the sent counters to the drop ``err`` names."""
        stats = self._stats
        stats.sent_packets -= len(run)
        stats.sent_bytes -= sum(payload_bytes(d) for d in run)
        count_send_error(stats, err, len(run))

    def discarded(self, items: list[Any]) -> None:
        """The pacer's queue was discarded at close: those batches count as dropped."""
        for run in items:
            self.uncount(run, errno.ENOBUFS)

    def _log_refusal(self, segment: int, err: OSError) -> None:
        if self._gso.max_segment == 0:
            self._path.gso = False
            _log.info(
                "%s: the kernel refused UDP GSO (%s); sending one datagram per call",
                self._name,
                err,
            )
        else:
            _log.info(
                "%s: UDP GSO refused for %d-byte segments (%s: above the MTU); "
                "datagrams that large go one per call",
                self._name,
                segment,
                err,
            )
