"""Many datagrams per system call: UDP GSO on send, UDP GRO on receive.

Why: a collective sends thousands of datagrams per round, and one ``sendto``
and one ``recv`` per datagram cost the kernel's per-call work plus a Python
call each (the README's analysis: about 50 us per packet sent or received).
Linux can take a buffer of equal-size segments in one ``sendmsg`` with
``UDP_SEGMENT`` (generic segmentation offload, 4.18+) and hand a receiver
several datagrams of one flow coalesced in one read with ``UDP_GRO`` (5.0+).

Each segment stays one complete datagram in the backend's framing, carrying
one packet the wire codec MAC'd on its own, so a lost segment loses one
packet, as before.  The kernel demands equal segment sizes (the last one may
be shorter), at most :data:`MAX_SEGMENTS` of them and one IP datagram's worth
of bytes per call: :func:`runs` groups a destination's queued datagrams
accordingly, keeping their order.

A device without checksum offload (or a kernel without GSO) refuses the
first ``sendmsg`` with EIO/EINVAL/EOPNOTSUPP; the backend then sends that
batch and every later one a datagram at a time (``GSO_REFUSED``).  A
segment above the device's MTU is refused too (GSO cannot fragment; EMSGSIZE
on Linux 6.x, EINVAL before): that disables GSO for that size and larger only,
and those datagrams go one per call, fragmented by IP as before (``GsoState``;
measured on the testbed's veth at MTU 1500: 8000-byte datagrams were all lost
as EMSGSIZE until this rule).
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = (
    "GSO_REFUSED",
    "MAX_SEGMENTS",
    "SOL_UDP",
    "UDP_GRO",
    "UDP_SEGMENT",
    "GsoState",
    "PathStats",
    "enable_gro",
    "gro_segment_size",
    "runs",
    "segment_cmsg",
    "split_segments",
)

#: ``linux/udp.h``: absent from Python 3.11's socket module.
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
#: Segments per ``sendmsg`` (``UDP_MAX_SEGMENTS``; 128 since Linux 6.9, 64 before).
MAX_SEGMENTS = 64
#: Errors by which a socket or device refuses to segment (at all, or at that size).
GSO_REFUSED = frozenset({errno.EINVAL, errno.EIO, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMSGSIZE})
#: Largest segment that fits a 1500-byte MTU (IPv4 20 + UDP 8): an EINVAL for a
#: segment above it is read as "above the path MTU", not "no GSO here".
_ETHERNET_SEGMENT = 1472
#: The UDP_GRO control message: one native int, the coalesced segments' size.
_GRO_CMSG = struct.Struct("=i")
_SEGMENT_CMSG = struct.Struct("=H")
#: Receive-side ancillary buffer: room for the UDP_GRO int.
GRO_ANCILLARY_BYTES = socket.CMSG_SPACE(_GRO_CMSG.size)


@dataclass(slots=True)
class PathStats:
    """Which UDP path a socket uses, and its system calls (for benches and tests).

    ``gso``/``gro``: batching is live on send/receive.  ``send_calls``: datagram
    system calls made (``sendto`` or one ``sendmsg`` per batch); ``gso_batches``:
    of those, ``sendmsg`` calls of two or more segments.  ``recv_calls``: reads
    that returned data; ``gro_reads``: of those, reads of coalesced datagrams.
    """

    gso: bool = False
    gro: bool = False
    send_calls: int = 0
    gso_batches: int = 0
    recv_calls: int = 0
    gro_reads: int = 0

    @property
    def path(self) -> str:
        """``"gso+gro"``, ``"gso"``, ``"gro"`` or ``"plain"``."""
        return "+".join(n for n, on in (("gso", self.gso), ("gro", self.gro)) if on) or "plain"


@dataclass(slots=True)
class GsoState:
    """One socket's GSO verdict: on until the kernel refuses it.

    ``max_segment``: the largest segment size still sent segmented (lowered
    when a size above an Ethernet MTU is refused; 0 = GSO off for the socket).
    """

    max_segment: int

    def refused(self, segment: int, err: int) -> bool:
        """Record that ``sendmsg`` failed with ``err`` for ``segment``-byte segments.

        Returns True when the batch should be resent a datagram at a time
        (GSO was refused, not the packets), False for an ordinary send error.
        """
        if err not in GSO_REFUSED:
            return False
        if err == errno.EMSGSIZE or (err == errno.EINVAL and segment > _ETHERNET_SEGMENT):
            # above the MTU: smaller segments may still go batched
            self.max_segment = min(self.max_segment, segment - 1)
        else:
            self.max_segment = 0
        return True


def segment_cmsg(segment: int) -> list[tuple[int, int, bytes]]:
    """The ``sendmsg`` ancillary data that asks the kernel to cut ``segment``-byte datagrams."""
    return [(SOL_UDP, UDP_SEGMENT, _SEGMENT_CMSG.pack(segment))]


def enable_gro(sock: socket.socket) -> bool:
    """Ask for coalesced reads on ``sock``; False when the kernel says no."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


def gro_segment_size(ancdata: Sequence[tuple[int, int, bytes]]) -> int:
    """The segment size of a coalesced read, or 0 for a single datagram."""
    for level, kind, data in ancdata:
        if level == SOL_UDP and kind == UDP_GRO and len(data) >= _GRO_CMSG.size:
            return int(_GRO_CMSG.unpack_from(data)[0])
    return 0


def split_segments(data: bytes, segment: int) -> list[memoryview]:
    """Views of ``data`` cut every ``segment`` bytes (the last may be shorter); no copy."""
    view = memoryview(data)
    if segment <= 0 or segment >= len(data):
        return [view]
    return [view[i : i + segment] for i in range(0, len(data), segment)]


def runs(datagrams: Sequence[bytes], max_segment: int, max_bytes: int) -> Iterator[list[bytes]]:
    """Consecutive datagrams grouped as one ``sendmsg`` each may carry, in order.

    A run holds datagrams of one size, optionally ended by one shorter
    datagram; at most :data:`MAX_SEGMENTS` and ``max_bytes`` in all.  A
    datagram above ``max_segment`` (GSO refused at that size) goes alone.
    """
    run: list[bytes] = []
    size = total = 0
    for data in datagrams:
        n = len(data)
        if run and (
            n > size
            or len(run) >= MAX_SEGMENTS
            or total + n > max_bytes
            or len(run[-1]) < size  # the shorter one already closed this run
        ):
            yield run
            run = []
        if not run:
            if n > max_segment:
                yield [data]
                continue
            size = n
            total = 0
        run.append(data)
        total += n
    if run:
        yield run
