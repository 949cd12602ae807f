"""The transport contract: fire-and-forget packets of frames.

A packet is a short list of frames (buffers).  ``send`` never blocks and
never retransmits: it hands the packet to the backend or drops it, counts
the outcome and returns.  Delivery is a callback on the event-loop thread,
so no task or queue is created per packet.  Authentication, replay guard
and parsing live above, in :mod:`gossipnet.transport.wire`; a transport
moves opaque frames.

Why callbacks and a synchronous ``send``: the data path pushes tens of
thousands of packets a second from Python, and an ``await`` per packet
(or a task per delayed packet) costs more than the packet itself.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

__all__ = (
    "Buffer",
    "LocalFrames",
    "PacketHandler",
    "Transport",
    "TransportStats",
    "is_frozen",
)

Buffer = bytes | bytearray | memoryview
#: Called on the loop thread with the received frames (valid only during the call
#: unless the handler keeps a reference; backends never reuse a delivered buffer).
PacketHandler = Callable[[list[memoryview]], None]
#: Optional per-drain delivery: every packet one drain read, in order, in one call
#: (a backend with a ``batch_handler`` attribute calls it instead of the per-packet
#: handler when it is set; the node sets it).
BatchHandler = Callable[[list[list[memoryview]]], None]


class LocalFrames(list[memoryview]):
    """Frames that came over a channel only this user's processes can write to.

    A backend hands its handler this type instead of a plain list for packets
    that arrived through a same-host socket in a directory private to this
    user (``transport/zeromq/local_ipc.py``).  Why it matters: such a sender could
    read our memory and key anyway, so a MAC over the payload proves nothing
    the operating system has not already; the wire codec then checks the
    pair's local token instead of hashing every byte (``WireCodec.decode``).
    """

    __slots__ = ()


@dataclass(slots=True)
class TransportStats:
    """Counters a backend keeps; read them, never reset them from outside."""

    sent_packets: int = 0
    sent_bytes: int = 0
    recv_packets: int = 0
    recv_bytes: int = 0
    dropped_queue_full: int = 0  # send queue (HWM / socket buffer) full: dropped, not retried
    dropped_oversize: int = 0  # larger than the backend's packet limit
    dropped_malformed: int = 0  # framing broken below the wire format (e.g. bad UDP framing)
    dropped_unreachable: int = 0  # no route / unknown address scheme
    send_errors: int = 0  # other OS-level send failures

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def is_frozen(frame: Buffer) -> bool:
    """True for a frame the sender promises not to change while it may be queued.

    ``bytes`` (or a view of them) are immutable; a *read-only* memoryview of
    mutable memory (``memoryview(t).toreadonly()``) is the sender's promise.
    Backends may send frozen frames without copying them; every other frame is
    copied inside ``send``, so its buffer may be reused the moment ``send`` returns.

    Why a promise is enough: every packet carries a MAC computed when it was
    encoded, so memory changed while a packet still sat in a queue (a sender
    that broke the promise, e.g. by reusing a buffer for a later round while a
    packet to a cut-off peer was still queued) fails verification at the
    receiver and is dropped and counted there, never used.
    """
    if type(frame) is bytes:
        return True
    return type(frame) is memoryview and (frame.readonly or type(frame.obj) is bytes)


class Transport(abc.ABC):
    """One endpoint: bound to ``address`` after :meth:`start`.

    Implementations must be used from the event-loop thread only.
    """

    #: URL schemes this backend serves, e.g. ("tcp", "ipc", "inproc").
    schemes: ClassVar[tuple[str, ...]] = ()
    #: Default payload bytes per data packet (``Config.chunk_bytes`` overrides).
    default_chunk_bytes: ClassVar[int] = 64 * 1024

    def __init__(self) -> None:
        self.stats = TransportStats()
        self.address: str = ""
        self._handler: PacketHandler | None = None

    @property
    @abc.abstractmethod
    def max_packet_bytes(self) -> int:
        """Largest packet (all frames together) this backend carries."""

    @abc.abstractmethod
    async def start(self, handler: PacketHandler) -> str:
        """Bind, start delivering packets to ``handler``; return the bound address.

        A listen address with port 0 binds a free port; the returned address is
        the one peers must use (never ``0.0.0.0`` when a concrete one is known).
        """

    @abc.abstractmethod
    def send(
        self,
        dst: str,
        frames: Sequence[Buffer],
        *,
        urgent: bool = False,
        group_bytes: int = 0,
    ) -> bool:
        """Queue one packet for ``dst``; True if handed to the backend, False if dropped.

        ``urgent``: a small control packet (membership, heartbeats) that must not
        wait behind queued data, e.g. in the UDP backend's pacer, where seconds of
        paced data would otherwise delay heartbeats into false failure reports.
        Backends without a user-space send queue ignore it.

        ``group_bytes``: the packet belongs to a group (a collective's round) whose
        largest payload is this many bytes; 0 = no group.  A backend with more than
        one channel to a destination may pick the channel from this number, and
        from it alone, so every packet of one group (sent with one value) takes one
        channel and keeps its order.  Backends with one channel ignore it.
        """

    def send_batch(
        self, dst: str, packets: Sequence[Sequence[Buffer]], *, group_bytes: int = 0
    ) -> int:
        """Queue several data packets for ``dst``; how many were handed to the backend.

        Each packet is its own datagram or message, exactly as :meth:`send` sends
        it (and counts its drops): a backend that can take a run at once (the
        UDP backend resolves ``dst`` and checks sizes once) overrides this.
        ``group_bytes`` as for :meth:`send`.
        """
        send = self.send
        if group_bytes:
            return sum(send(dst, frames, group_bytes=group_bytes) for frames in packets)
        return sum(send(dst, frames) for frames in packets)

    def send_each(
        self, dsts: Sequence[str], frames: Sequence[Buffer], *, group_bytes: int = 0
    ) -> int:
        """:meth:`send` one packet to each of ``dsts`` (a broadcast: the same frames,
        one sequence number); how many were handed to the backend.  A backend that
        frames a packet before sending (the UDP backend joins it into one datagram)
        overrides this to do that once.  ``group_bytes`` as for :meth:`send`.
        """
        send = self.send
        if group_bytes:
            return sum(send(dst, frames, group_bytes=group_bytes) for dst in dsts)
        return sum(send(dst, frames) for dst in dsts)

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop delivery, close sockets with zero linger; idempotent."""

    def is_local(self, dst: str) -> bool:
        """Whether packets to ``dst`` now arrive there as :class:`LocalFrames`.

        A sender may then leave their MAC unsigned (``WireCodec.encode(local=True)``):
        the receiver checks only the pair's local token on that channel, and would
        reject such a packet on any other.  False unless a backend knows better.
        """
        return False

    def forget(self, dst: str) -> None:  # noqa: B027 - optional hook
        """Release per-destination resources (e.g. a connected socket) for a departed peer."""
