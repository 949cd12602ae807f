"""UDP backend: one datagram per packet, many per system call, drops when the kernel says no.

Framing: a packet's frames travel as ONE datagram,
``[count: u8][len_1 .. len_count: u32 big-endian][frame_1 .. frame_count]``.
Joining the frames is the only copy on send; on receive the frames are
memoryview slices of the received datagram (no copy).  Broken framing is
counted in ``dropped_malformed``; authentication lives above, in the wire codec.

Why a non-blocking socket driven by ``loop.add_reader`` and ``sock.sendto``
rather than ``loop.create_datagram_endpoint``: measured on loopback with
1 KiB datagrams, the stdlib endpoint reads one datagram per loop iteration
(about 40 k packets/s, so 80% of a burst was lost to a full receive buffer)
while draining the socket per readiness event reached about 180 k/s on both
the stdlib loop and uvloop.  On send, the endpoint would buffer in user space
when the kernel answers EAGAIN; here EAGAIN/ENOBUFS is a counted drop, which
is what UDP semantics ask for (no unbounded queue).

With ``Config.udp_pace_mbps`` set, sends pass a token bucket at that rate
with one FIFO per destination served in turn (:mod:`._pacing` says why):
accepted packets then wait in user space, bounded by ``send_queue_packets``
per destination, instead of overflowing a slower link's queue.

``default_chunk_bytes`` is 1024 so that header + MAC + framing + payload fit a
1500-byte Ethernet MTU without IP fragmentation (a lost fragment loses the
whole datagram).  Loopback benchmarks may set ``Config.chunk_bytes=32768``.

With ``Config.udp_gso`` (the default) a socket sends a loop iteration's
datagrams to one destination as few ``sendmsg`` calls with ``UDP_SEGMENT``
and reads coalesced datagrams with ``UDP_GRO`` (:mod:`.gso`, :mod:`.sender`
say why and how); each datagram is still one packet, MAC'd on its own.
Where the kernel refuses either, that socket uses the plain path below,
detected once; :attr:`UdpTransport.path` says which is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
from collections.abc import Sequence
from typing import ClassVar

from gossipnet.clock import Clock, MonotonicClock
from gossipnet.config import Config
from gossipnet.errors import ClosedError, ConfigError
from gossipnet.transport.address import (
    WILDCARD_HOSTS,
    join_host_port,
    split_address,
    split_host_port,
)
from gossipnet.transport.base import BatchHandler, Buffer, PacketHandler, Transport
from gossipnet.transport.udp.gso import (
    GRO_ANCILLARY_BYTES,
    PathStats,
    enable_gro,
    gro_segment_size,
    split_segments,
)
from gossipnet.transport.udp.pacing import Pacer, default_burst_bytes
from gossipnet.transport.udp.resolve import Resolver, SockAddr
from gossipnet.transport.udp.sender import BatchSender, count_send_error, payload_bytes

__all__ = ("UdpTransport",)

_log = logging.getLogger(__name__)

#: Largest UDP payload over IPv4 (65535 - 20 IP - 8 UDP header bytes).
MAX_DATAGRAM_BYTES = 65507
_MAX_FRAMES = 255
#: ``max_packet_bytes`` leaves room for the framing of this many frames.
_FRAMING_FRAMES = 4
#: Datagrams read per readiness callback before yielding to other loop work.
_DRAIN_BATCH = 256
_MAX_PACKET_BYTES = MAX_DATAGRAM_BYTES - 1 - 4 * _FRAMING_FRAMES
_HEADERS = [struct.Struct(f">B{n}I") for n in range(_MAX_FRAMES + 1)]
_HEADER3 = _HEADERS[3]
#: A coalesced (GRO) read holds at most one IP datagram's worth (64 KiB).
_GRO_READ_BYTES = 65536
#: as a plain int: ``socket.MSG_TRUNC`` is an IntFlag, whose ``&`` is a Python-level
#: call (about a microsecond per read on the receive path)
_MSG_TRUNC = int(socket.MSG_TRUNC)


#: Linux's SO_SNDBUFFORCE/SO_RCVBUFFORCE (absent from the socket module): with
#: CAP_NET_ADMIN they grant the size asked for beyond ``net.core.wmem_max/rmem_max``.
_FORCE_OPTS = (
    {socket.SO_SNDBUF: 32, socket.SO_RCVBUF: 33} if sys.platform.startswith("linux") else {}
)


def _set_buffer(sock: socket.socket, opt: int, size: int) -> None:
    """Best effort: the forced size when privileged, else what the kernel's cap allows.

    Why force: four peers bursting a collective at one receiver overflow a
    receive buffer capped at ``rmem_max`` while the receiver's Python drains it
    (measured on the namespace testbed: ~6% of datagrams lost at 0% link loss
    with 4 MiB), and those drops look exactly like network loss.
    """
    force = _FORCE_OPTS.get(opt)
    if force is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)
            return
        except OSError:  # EPERM without CAP_NET_ADMIN: fall back to the capped option
            pass
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, opt, size)


def parse_datagram(data: bytes | memoryview) -> list[memoryview] | None:
    """Split one datagram into frames (views of ``data``); None if the framing is broken."""
    size = len(data)
    if size == 0:
        return None
    count = data[0]
    if count == 3 and size >= 13:  # every wire packet: header, payload, MAC (inline)
        _, a, b, c = _HEADER3.unpack_from(data)
        if 13 + a + b + c != size:
            return None
        view, a, b = memoryview(data), 13 + a, 13 + a + b
        return [view[13:a], view[a:b], view[b:]]
    start = 1 + 4 * count
    if count == 0 or size < start:
        return None
    lengths = _HEADERS[count].unpack_from(data)[1:]
    if start + sum(lengths) != size:
        return None
    view = memoryview(data)
    frames = []
    for length in lengths:
        frames.append(view[start : start + length])
        start += length
    return frames


class UdpTransport(Transport):
    """Datagram endpoint for ``udp://host:port`` addresses.

    Args:
        config: reads ``udp_socket_buffer_bytes`` (SO_RCVBUF and SO_SNDBUF, best
            effort: the kernel caps them at ``net.core.rmem_max``/``wmem_max``),
            ``udp_pace_mbps`` and ``send_queue_packets`` (pacing, off when None),
            ``udp_gso`` (batched system calls where the kernel allows).
        listen: where to bind; port 0 picks a free port.
        clock: times the retry of failed name resolutions and the pacing.
        advertise_host: host put in :attr:`address` when ``listen`` binds a
            wildcard; ``127.0.0.1`` when not given.

    Raises:
        ConfigError: ``listen`` is not a ``udp://host:port`` URL.
    """

    schemes: ClassVar[tuple[str, ...]] = ("udp",)
    default_chunk_bytes: ClassVar[int] = 1024

    def __init__(
        self,
        config: Config,
        listen: str = "udp://127.0.0.1:0",
        *,
        clock: Clock | None = None,
        advertise_host: str | None = None,
    ) -> None:
        super().__init__()
        scheme, rest = split_address(listen)
        if scheme != "udp":
            raise ConfigError(f"UdpTransport serves udp://host:port, not {listen!r}")
        host, port = split_host_port(rest)
        if not port.isdigit() and port != "*":
            raise ConfigError(f"UDP port must be a number (0 = any), got {listen!r}")
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self._host = host
        self._port = 0 if port == "*" else int(port)
        self._advertise_host = advertise_host
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: per-drain delivery (the node sets it); None: one handler call per packet
        self.batch_handler: BatchHandler | None = None
        self._v6 = False
        self._names = Resolver(self.clock)
        self._addrs = self._names.addrs  # dst URL -> socket address: the hot path's lookup
        self._closed = False
        self._pacer: Pacer | None = None
        self._batch: BatchSender | None = None
        #: Which path this socket uses and its system calls; see :attr:`path`.
        self.path_stats = PathStats()

    @property
    def max_packet_bytes(self) -> int:
        return _MAX_PACKET_BYTES

    @property
    def path(self) -> str:
        """The live path: ``"gso+gro"``, ``"gso"``, ``"gro"`` or ``"plain"``.

        Before :meth:`start`, ``"plain"``; GSO may turn off later, at the first
        batch the kernel refuses (logged once at INFO).
        """
        return self.path_stats.path

    # ------------------------------------------------------------------ lifecycle
    async def start(self, handler: PacketHandler) -> str:
        """Bind the socket and deliver every well-framed datagram to ``handler``.

        Raises:
            ClosedError: the transport was closed.
            ConfigError: the address cannot be bound.
        """
        if self._closed:
            raise ClosedError("this UdpTransport was closed; create a new one")
        if self._sock is not None:
            raise RuntimeError(f"{self.address} is already started")
        loop = asyncio.get_running_loop()
        self._v6 = ":" in self._host
        bind_host = self._host
        if bind_host in WILDCARD_HOSTS:
            bind_host = "::" if self._v6 else "0.0.0.0"
        sock = socket.socket(socket.AF_INET6 if self._v6 else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                _set_buffer(sock, opt, self.config.udp_socket_buffer_bytes)
            sock.bind((bind_host, self._port))
        except OSError as err:
            sock.close()
            raise ConfigError(
                f"cannot bind udp://{join_host_port(self._host, self._port)} ({err}); "
                "is the port taken? port 0 picks a free one"
            ) from err
        host, port = sock.getsockname()[:2]
        if self._host in WILDCARD_HOSTS:
            host = self._advertise_host or "127.0.0.1"
        self._sock, self._loop, self._handler = sock, loop, handler
        self._names.loop, self._names.v6 = loop, self._v6
        self.address = f"udp://{join_host_port(host, port)}"
        self._start_paths(sock, loop)
        loop.add_reader(sock.fileno(), self._drain_gro if self.path_stats.gro else self._drain)
        return self.address

    def _start_paths(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """GRO and GSO where configured and the kernel agrees; the pacer where set."""
        path = self.path_stats
        if self.config.udp_gso:
            path.gro = enable_gro(sock)
            if not path.gro:
                _log.info("%s: the kernel refused UDP_GRO; one datagram per read", self.address)
            path.gso = True  # until the first batch the kernel refuses
        batch = None
        if path.gso:
            batch = BatchSender(
                sock, loop, self.stats, path, None, MAX_DATAGRAM_BYTES, self.address
            )
            self._batch = batch
        if self.config.udp_pace_mbps is not None:
            rate = self.config.udp_pace_mbps * 1e6 / 8
            self._pacer = Pacer(
                rate,
                default_burst_bytes(rate),
                self.config.send_queue_packets,
                self.clock,
                self._emit if batch is None else batch.emit,
            )
            if batch is not None:
                batch.pacer = self._pacer  # it takes whole batches

    async def close(self) -> None:
        """Stop delivery, cancel pending name resolutions, close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._handler = None
        self._names.cancel()
        if self._batch is not None:
            self._batch.close()  # accepted this iteration: sent (or handed to the pacer)
        if self._pacer is not None:
            # queued packets are discarded, as with ZeroMQ's linger 0
            items = self._pacer.discard()
            if self._batch is not None:
                self._batch.discarded(items)  # counted sent at send(): now dropped
        sock, self._sock = self._sock, None
        if sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(sock.fileno())
            sock.close()

    # ------------------------------------------------------------------ receive
    def _drain(self) -> None:
        """Read the datagrams the kernel holds (the fd is level-triggered: no re-arm).

        With a :attr:`batch_handler` set, the drain's packets go to it in one call at
        the end of the drain, in order (the node's per-drain intake).
        """
        sock, handler = self._sock, self._handler
        if sock is None or handler is None:
            return
        batch: list[list[memoryview]] | None = [] if self.batch_handler is not None else None
        try:
            self._read(sock, handler, batch)
        finally:
            self._hand_over(batch)

    def _read(
        self, sock: socket.socket, handler: PacketHandler, batch: list[list[memoryview]] | None
    ) -> None:
        stats = self.stats
        for _ in range(_DRAIN_BATCH):
            try:
                data = sock.recv(MAX_DATAGRAM_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. ECONNREFUSED queued by an ICMP error for an earlier send
                stats.send_errors += 1
                continue
            self.path_stats.recv_calls += 1
            self._deliver(data, handler, batch)
            if self._sock is None:
                return

    def _drain_gro(self) -> None:
        """:meth:`_drain` for a GRO socket: a read may hold several datagrams of one size."""
        sock, handler = self._sock, self._handler
        if sock is None or handler is None:
            return
        batch: list[list[memoryview]] | None = [] if self.batch_handler is not None else None
        try:
            self._read_gro(sock, handler, batch)
        finally:
            self._hand_over(batch)

    def _read_gro(
        self, sock: socket.socket, handler: PacketHandler, batch: list[list[memoryview]] | None
    ) -> None:
        stats, path = self.stats, self.path_stats
        for _ in range(_DRAIN_BATCH):
            try:
                data, ancdata, flags, _ = sock.recvmsg(_GRO_READ_BYTES, GRO_ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. ECONNREFUSED queued by an ICMP error for an earlier send
                stats.send_errors += 1
                continue
            path.recv_calls += 1
            if flags & _MSG_TRUNC:  # cannot happen below 64 KiB; never parse a cut read
                stats.dropped_malformed += 1
                continue
            segment = gro_segment_size(ancdata) if ancdata else 0
            if segment and segment < len(data):
                path.gro_reads += 1
                for view in split_segments(data, segment):
                    self._deliver(view, handler, batch)
                    if self._sock is None:
                        return
            else:
                self._deliver(data, handler, batch)
                if self._sock is None:
                    return

    def _hand_over(self, batch: list[list[memoryview]] | None) -> None:
        """Give one drain's packets to the batch handler (nothing when there is none)."""
        if batch and self.batch_handler is not None:
            try:
                self.batch_handler(batch)
            except Exception:
                _log.exception("batch handler raised on %s; packets dropped", self.address)

    def _deliver(
        self,
        data: bytes | memoryview,
        handler: PacketHandler,
        batch: list[list[memoryview]] | None = None,
    ) -> None:
        """Parse one datagram and hand its frames over (or keep them for the drain's
        batch); broken framing is a counted drop."""
        stats = self.stats
        frames = parse_datagram(data)
        if frames is None:
            stats.dropped_malformed += 1
            return
        stats.recv_packets += 1
        stats.recv_bytes += len(data) - 1 - 4 * len(frames)
        if batch is not None:
            batch.append(frames)
            return
        try:
            handler(frames)
        except Exception:
            _log.exception("packet handler raised on %s; packet dropped", self.address)

    # ------------------------------------------------------------------ send
    def send(
        self,
        dst: str,
        frames: Sequence[Buffer],
        *,
        urgent: bool = False,
        group_bytes: int = 0,  # one channel: ignored
    ) -> bool:
        """Send one packet to ``dst`` as one datagram; False = dropped and counted.

        Drops:
            ``dropped_queue_full``: the kernel's send buffer is full (EAGAIN or
            ENOBUFS); without pacing nothing is buffered in user space, with
            pacing also when ``dst``'s pacing queue holds ``send_queue_packets``.
            ``dropped_oversize``: above :attr:`max_packet_bytes`, a datagram over
            65507 bytes, or more than 255 frames.
            ``dropped_unreachable``: a non-udp or malformed address, a name that
            does not resolve, or one still resolving (the first packets to a host
            *name* are dropped while it resolves in the background, as on a LAN
            before ARP answers; IP literals never wait).
            ``send_errors``: before :meth:`start`, after :meth:`close`, other OS errors.

        Never raises for network conditions.
        """
        stats = self.stats
        sock = self._sock
        if sock is None:
            stats.send_errors += 1
            return False
        addr = self._addrs.get(dst) or self._names.resolve(dst)
        if addr is None:
            stats.dropped_unreachable += 1
            return False
        framed = self._datagram(frames)
        if framed is None:
            return False
        data, nbytes = framed
        if self._batch is not None:
            return self._batch.submit(addr, data, nbytes, urgent=urgent)
        if self._pacer is None:
            return self._emit(addr, data)
        if not self._pacer.submit(addr, data, urgent=urgent):
            stats.dropped_queue_full += 1
            return False
        return True

    def send_each(
        self, dsts: Sequence[str], frames: Sequence[Buffer], *, group_bytes: int = 0
    ) -> int:
        """:meth:`send` of one packet to each of ``dsts`` (an all-gather's or a
        parity's broadcast), its datagram joined once; same drops, counted per send."""
        batch = self._batch
        if batch is None or self._sock is None or len(dsts) < 2:
            return super().send_each(dsts, frames)
        addrs = [self._addrs.get(dst) for dst in dsts]
        if None in addrs:  # a name still to resolve: each its own send (and drop)
            return super().send_each(dsts, frames)
        framed = self._datagram(frames)
        if framed is None:  # counted for the first send; each other one counts its own
            return super().send_each(dsts[1:], frames)
        data, nbytes = framed
        return sum(batch.submit(addr, data, nbytes) for addr in addrs)

    def send_batch(
        self, dst: str, packets: Sequence[Sequence[Buffer]], *, group_bytes: int = 0
    ) -> int:
        """:meth:`send` for a run of packets to ``dst``: one address lookup, and
        straight into the GSO batch sender; same datagrams, same counted drops."""
        batch = self._batch
        addr = self._addrs.get(dst) if batch is not None and self._sock is not None else None
        if addr is None or batch is None:
            return super().send_batch(dst, packets)
        sent = 0
        for frames in packets:
            framed = self._datagram(frames)
            if framed is not None:
                sent += batch.submit(addr, *framed)
        return sent

    def _datagram(self, frames: Sequence[Buffer]) -> tuple[bytes, int] | None:
        """``frames`` as one framed datagram and its frame bytes; None = a counted drop
        (no frames: ``dropped_malformed``; too many or too large: ``dropped_oversize``)."""
        count = len(frames)
        if count == 0:
            self.stats.dropped_malformed += 1
            return None
        if count > _MAX_FRAMES:
            self.stats.dropped_oversize += 1
            return None
        lengths = [f.nbytes if isinstance(f, memoryview) else len(f) for f in frames]
        nbytes = sum(lengths)
        if nbytes > _MAX_PACKET_BYTES or 1 + 4 * count + nbytes > MAX_DATAGRAM_BYTES:
            self.stats.dropped_oversize += 1
            return None
        return b"".join([_HEADERS[count].pack(count, *lengths), *frames]), nbytes

    def _emit(self, addr: SockAddr, data: bytes) -> bool:
        """``sendto`` now; counts the packet as sent or as the drop the kernel reports."""
        stats = self.stats
        sock = self._sock
        if sock is None:
            stats.send_errors += 1
            return False
        self.path_stats.send_calls += 1
        try:
            sock.sendto(data, addr)
        except OSError as err:
            count_send_error(stats, err.errno or 0)
            return False
        stats.sent_packets += 1
        stats.sent_bytes += payload_bytes(data)  # framing excluded
        return True

    async def connect(self, dst: str, timeout_s: float) -> bool:
        """Resolve ``dst`` so the next send is not dropped for a pending lookup.

        UDP has no connection: True means "``dst`` has a socket address", not
        that anyone listens there.  Mirrors :meth:`ZmqTransport.connect` so control
        code can call either.
        """
        if self._sock is None:
            return False
        if self._addrs.get(dst) or self._names.resolve(dst):
            return True
        task = self._names.resolving.get(dst)
        if task is None:
            return False
        deadline = self.clock.now() + timeout_s
        while not task.done():
            remaining = deadline - self.clock.now()
            if remaining <= 0 or self._closed:
                return False
            await self.clock.sleep(min(0.005, remaining))
        return dst in self._addrs

    def forget(self, dst: str) -> None:
        """Drop ``dst``'s cached address (a departed peer's name may move)."""
        self._names.forget(dst)
