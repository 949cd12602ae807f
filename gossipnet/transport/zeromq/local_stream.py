"""Same-host packets without ZeroMQ's threads: a Unix stream socket the event loop reads and writes.

Why: between processes on one host, ZeroMQ's own alias (``local_ipc``) still
passes every packet through three extra threads: the sender's ZeroMQ I/O
thread writes it, the receiver's I/O thread reads it and wakes the event
loop, and pyzmq's garbage-collector thread wakes to release each zero-copy
frame.  A 1M float32 all-reduce across four processes makes about eight such
wake-ups on its critical path, on 2 cores shared by a dozen threads; after an
idle gap each costs scheduling latency, not just CPU (docs/benchmarks.md).
Here the loop itself calls ``sendmsg`` (the kernel copies the frames; nothing is
queued in user space while the socket has room)
and ``recv_into`` a buffer allocated for the packet, so a packet costs one
wake-up: the receiver's loop.

Records on the stream, one per packet: ``<HHI`` (magic, frame count, body
length), the frame lengths (``<I`` each), then the frames' bytes.  The stream
only frames packets: each is still a whole wire packet, checked alone by
:class:`~gossipnet.transport.wire.WireCodec` (local token, replay window,
header).  A record that cannot be parsed (bad magic, no or too many frames, a
body above the packet limit, lengths that do not add up) or a stream cut
mid-record is counted (``dropped_malformed``) and closes that connection: a
byte stream cannot resynchronise; the sender reconnects on a later send.

Large payloads skip the socket (``Config.local_shm``, ``local_shm.py``): the
connection's first record (``MAGIC_SEG``) passes a shared-memory segment's fd,
and a packet's largest frame of 64 KiB or more then travels in a slot of it,
the record (``MAGIC_SHM``) carrying the packet's other frames and a
descriptor.  The reader maps the segment and delivers views of the slots.

Who may connect: the socket lives in the same private directory as the
ZeroMQ alias (``local_ipc``: mode 0700, this user's), and each accepted
connection's peer credentials are checked to be this user's; packets arrive
as :class:`~gossipnet.transport.base.LocalFrames`.

Sending keeps the transport contract: ``send`` never blocks (non-blocking
socket); what the kernel did not take waits in a queue bounded by
``Config.send_queue_packets`` packets and :data:`MAX_QUEUED_BYTES`, flushed
when the socket is writable; a packet that does not fit is dropped and
counted (``dropped_queue_full``).  Frames that are not frozen
(:func:`~gossipnet.transport.base.is_frozen`) are copied before they are
queued.  A peer that dies mid-stream fails the next write: its queued packets
are counted as ``dropped_unreachable`` and its destination falls back to the
ZeroMQ path for :data:`RETRY_S`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import socket
import struct
from collections.abc import Callable, Sequence

import numpy as np

from gossipnet.transport.base import Buffer, LocalFrames, TransportStats, is_frozen
from gossipnet.transport.zeromq.local_shm import (
    DESC_FRAME,
    SEG,
    SEG_VERSION,
    SHM_MIN_BYTES,
    ShmReader,
    ShmWriter,
)

__all__ = (
    "MAX_QUEUED_BYTES",
    "RETRY_S",
    "STREAM_GROUP_MAX_BYTES",
    "StreamInbox",
    "StreamWriter",
    "encode_prefix",
)

_log = logging.getLogger(__name__)

MAGIC = 0x4753
#: A record whose last frame describes one of the packet's frames, which is in shared
#: memory (``local_shm.py``): ``DESC_FRAME`` = (its index among the packet's frames,
#: slot, length, generation); the record's other frames are the packet's others.
MAGIC_SHM = 0x4754
#: The first record of a connection that shares memory: its one frame is
#: ``local_shm.SEG`` (the segment format, this connection's reader index) and the
#: segment's fd rides with it.
MAGIC_SEG = 0x4755
#: Frames besides a shared payload stay on the stream: at most this many bytes of them.
_SHM_INLINE_MAX = 32 * 1024
_PREFIX = struct.Struct("<HHI")
MAX_FRAMES = 16
#: Bytes a destination may hold in user space beyond the kernel's buffer.
MAX_QUEUED_BYTES = 64 * 1024 * 1024
#: After a failed connect or a broken connection, the ZeroMQ path is used this long.
RETRY_S = 1.0
#: Without a shared-memory segment (``local_shm.py``), groups (a collective's rounds,
#: ``Transport.send``'s ``group_bytes``) of packets up to this size take the stream;
#: larger ones take ZeroMQ's alias where it is connected.  With one, every group takes
#: the stream: the slot's one copy replaces the kernel copies the alias offloads.
#: Why: with 1 MiB packets (1M float32 over 4 peers) the stream's single wake-up per
#: packet wins (1.19x gloo against the alias's ~1.27x), but at 4 MiB per packet the
#: loop thread makes every kernel copy that ZeroMQ's I/O thread made beside the
#: reduction (25M: 1.06x gloo against 0.85-0.95x; docs/benchmarks.md, "Issue 21,
#: sessions 15 and 16").  Every packet of one group takes one channel: no reordering
#: of a round's END ahead of its data.
STREAM_GROUP_MAX_BYTES = 1024 * 1024
#: Kernel send buffer asked for (capped by ``net.core.wmem_max``): a 4 MiB
#: packet then leaves in one ``sendmsg`` instead of several writable wake-ups.
SNDBUF_BYTES = 4 * 1024 * 1024
#: Records up to this size are copied out of the read buffer; larger ones are
#: read straight into a buffer of their own.
_SMALL = 64 * 1024
_READ_BUFFER = 256 * 1024
_READS_PER_CALL = 16  # recv calls per readable callback: other loop work runs between
_IOV_MAX = 512
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE, never SIGPIPE, from a dead reader
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)  # a received fd is close-on-exec at once

Deliver = Callable[[list[list[memoryview]]], None]


def _nbytes(frame: Buffer) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def encode_prefix(sizes: Sequence[int], magic: int = MAGIC) -> bytes:
    """The record prefix of a packet whose frames have ``sizes``."""
    return _PREFIX.pack(magic, len(sizes), sum(sizes)) + struct.pack(f"<{len(sizes)}I", *sizes)


class StreamWriter:
    """One connected, non-blocking stream to a same-host peer; see the module docstring."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        stats: TransportStats,
        max_packets: int,
        on_broken: Callable[[StreamWriter], None],
    ) -> None:
        self.sock = sock
        self._loop = loop
        self._stats = stats
        self._max_packets = max_packets
        self._on_broken = on_broken
        #: pieces not yet written, each with whether it ends a packet
        self._queue: collections.deque[tuple[memoryview, bool]] = collections.deque()
        self.queued_packets = 0
        self.queued_bytes = 0
        self.closed = False
        #: the segment large payloads go through (``local_shm.py``), once offered,
        #: and our receiver's column in it
        self.shm: ShmWriter | None = None
        self.shm_reader = -1  # kept after close (``had_shm``)
        # The receiver never writes back: readable means it closed (or broke the
        # protocol).  Why watch: a writer idle after its peer left would otherwise
        # hold its descriptor until the next send or ``forget``.
        loop.add_reader(sock.fileno(), self._on_peer_closed)

    def _on_peer_closed(self) -> None:
        try:
            data = self.sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._break(err)
            return
        self._break(ConnectionResetError("peer closed" if not data else "peer wrote to us"))

    def offer_shm(self, shm: ShmWriter, reader: int) -> bool:
        """Pass ``shm``'s fd and our column ``reader`` to the receiver in the
        connection's first record; True if it went (large payloads then take the
        segment), else the column is given back.

        Call it before any other send: the receiver takes a segment only from the
        stream's first record.
        """
        record = encode_prefix([SEG.size], MAGIC_SEG) + SEG.pack(SEG_VERSION, reader)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", shm.fd))]
        try:
            sent = self.sock.sendmsg([record], rights, _NOSIGNAL)
        except OSError:
            sent = 0
        if sent == 0:  # nothing (and no fd) went: this stream carries payloads inline
            shm.detach()
            return False
        if sent < len(record):  # the fd went with the first byte; the rest follows
            self._enqueue(record, (), sent)
            self._loop.add_writer(self.sock.fileno(), self._flush)
        self.shm, self.shm_reader = shm, reader
        return True

    @property
    def had_shm(self) -> bool:
        """Whether this stream shared memory (also after it closed)."""
        return self.shm_reader >= 0

    def send(self, frames: Sequence[Buffer], sizes: list[int]) -> bool:
        """Write one packet, or queue what the kernel did not take; False = dropped, counted."""
        stats = self._stats
        if self.closed:
            stats.send_errors += 1
            return False
        payload_bytes = sum(sizes)
        magic = MAGIC
        shm, desc = self.shm, None
        if shm is not None and payload_bytes >= SHM_MIN_BYTES:  # small packets: no search
            big = max(range(len(sizes)), key=sizes.__getitem__)
            if sizes[big] >= SHM_MIN_BYTES and payload_bytes - sizes[big] <= _SHM_INLINE_MAX:
                desc = shm.put(frames[big], self.shm_reader)
                if desc is not None:  # that frame went to a slot; its descriptor goes last
                    frames = [*frames[:big], *frames[big + 1 :], struct.pack("<I", big) + desc]
                    sizes = [*sizes[:big], *sizes[big + 1 :], DESC_FRAME.size]
                    magic = MAGIC_SHM
        prefix = encode_prefix(sizes, magic)
        total = len(prefix) + sum(sizes)
        if self._queue:
            if (
                self.queued_packets >= self._max_packets
                or self.queued_bytes + total > MAX_QUEUED_BYTES
            ):
                if shm is not None and desc is not None:  # never sent: its slot is free
                    shm.unput(desc, self.shm_reader)
                stats.dropped_queue_full += 1
                return False
            self._enqueue(prefix, frames, 0)
        else:
            try:
                sent = self.sock.sendmsg([prefix, *frames], (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as err:
                if shm is not None and desc is not None:
                    shm.unput(desc, self.shm_reader)
                stats.send_errors += 1
                self._break(err)
                return False
            if sent < total:
                self._enqueue(prefix, frames, sent)
                self._loop.add_writer(self.sock.fileno(), self._flush)
        stats.sent_packets += 1
        stats.sent_bytes += payload_bytes
        return True

    def _enqueue(self, prefix: bytes, frames: Sequence[Buffer], skip: int) -> None:
        """Queue the packet's bytes after the first ``skip``; copies frames not frozen."""
        pieces: list[memoryview] = []
        for part in (prefix, *frames):
            view = memoryview(part).cast("B") if not isinstance(part, bytes) else memoryview(part)
            n = view.nbytes
            if skip >= n:
                skip -= n
                continue
            if skip:
                view = view[skip:]
                skip = 0
            if not is_frozen(part):
                view = memoryview(bytes(view))
            pieces.append(view)
        for i, view in enumerate(pieces):
            self._queue.append((view, i == len(pieces) - 1))
            self.queued_bytes += view.nbytes
        self.queued_packets += 1

    def _flush(self) -> None:
        """Writable: write queued pieces until the kernel refuses more."""
        queue = self._queue
        while queue:
            batch = [view for view, _ in itertools.islice(queue, _IOV_MAX)]
            try:
                sent = self.sock.sendmsg(batch, (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self._break(err)
                return
            self.queued_bytes -= sent
            while sent:
                view, last = queue[0]
                if sent < view.nbytes:
                    queue[0] = (view[sent:], last)
                    break
                sent -= view.nbytes
                queue.popleft()
                self.queued_packets -= last
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_writer(self.sock.fileno())

    def _break(self, err: OSError) -> None:
        _log.debug("same-host stream broke (%s); %d queued dropped", err, self.queued_packets)
        self._stats.dropped_unreachable += self.queued_packets
        self.close()
        self._on_broken(self)

    def close(self) -> None:
        """Close the socket; packets still queued are discarded (counted by the caller)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_writer(self.sock.fileno())
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self._queue.clear()
        self.queued_packets = self.queued_bytes = 0
        if self.shm is not None:
            self.shm.detach()
            self.shm = None


class _Reader:
    """One accepted connection: parses records, delivers each as :class:`LocalFrames`."""

    def __init__(self, inbox: StreamInbox, sock: socket.socket) -> None:
        self.inbox = inbox
        self.sock = sock
        self.buf = bytearray(_READ_BUFFER)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        # a large record read straight into its own buffer
        self.body: memoryview | None = None
        self.lens: tuple[int, ...] = ()
        self.filled = 0
        #: the writer's segment (``local_shm.py``), from the stream's first record
        self.shm: ShmReader | None = None
        self.first = True  # no record parsed yet: one may bring a segment's fd
        self.fd: int | None = None  # a segment's fd, received, not yet mapped

    def on_readable(self) -> None:
        out: list[list[memoryview]] = []
        try:
            for _ in range(_READS_PER_CALL):
                if not self._read_once(out):
                    break
        finally:
            if out:
                self.inbox.deliver(out)

    def _read_once(self, out: list[list[memoryview]]) -> bool:
        """One ``recv_into``; False when the socket is (probably) empty or closed.

        A read that did not fill its target emptied the socket: trying again at
        once would only fail with ``EAGAIN``; the level-triggered reader calls
        again when more has arrived.
        """
        body = self.body
        target = body[self.filled :] if body is not None else self.view[self.end :]
        try:
            # the first record may carry a segment's fd: ask for it until it is parsed
            n = self._recv_fd(target) if self.first else self.sock.recv_into(target)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as err:
            self.inbox.close_reader(self, f"read failed ({err})", partial=self._partial())
            return False
        if n == 0:
            self.inbox.close_reader(self, "peer closed", partial=self._partial())
            return False
        full = n == target.nbytes
        if body is not None:
            self.filled += n
            if self.filled == body.nbytes:
                out.append(self._frames(body, self.lens))
                self.body = None
            return full
        self.end += n
        return self._parse(out) and full

    def _recv_fd(self, target: memoryview) -> int:
        """``recv_into`` that also takes an fd passed with the bytes (``SCM_RIGHTS``)."""
        n, ancdata, _flags, _ = self.sock.recvmsg_into(
            [target],
            socket.CMSG_SPACE(4 * 4),
            _CLOEXEC,  # no fork inherits a stray fd
        )
        for level, kind, data in ancdata:
            if level != socket.SOL_SOCKET or kind != socket.SCM_RIGHTS:
                continue
            fds = list(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
            if self.fd is None and fds:
                self.fd = fds.pop(0)
            for extra in fds:  # more than a segment's: never ours to keep
                os.close(extra)
        return n

    def _segment(self, reader: int) -> bool:
        """Map the segment the first record announced, as column ``reader``; False if
        it cannot be used."""
        fd, self.fd = self.fd, None
        if fd is None:
            return False
        try:
            self.shm = ShmReader(fd, reader)
        except (OSError, ValueError) as err:
            _log.warning(
                "same-host stream %s: a sender's shared-memory segment is unusable (%s);"
                " closing its stream (it retries, then sends inline)", self.inbox.path, err,
            )  # fmt: skip
            return False
        return True

    def _partial(self) -> bool:
        return self.body is not None or self.end > self.start

    def _parse(self, out: list[list[memoryview]]) -> bool:
        """Take every whole record in the buffer; False if the stream was garbage."""
        buf, view = self.buf, self.view
        while self.end - self.start >= _PREFIX.size:
            start = self.start
            magic, count, body = _PREFIX.unpack_from(buf, start)
            if (
                magic not in (MAGIC, MAGIC_SHM, MAGIC_SEG)
                or not 1 <= count <= MAX_FRAMES
                or body > self.inbox.max_packet
                or (magic != MAGIC and body > _SMALL)
            ):
                self.inbox.close_reader(self, "garbage record prefix", partial=True)
                return False
            head = _PREFIX.size + 4 * count
            if self.end - start < head:
                break
            lens = struct.unpack_from(f"<{count}I", buf, start + _PREFIX.size)
            if sum(lens) != body:
                self.inbox.close_reader(self, "record lengths do not add up", partial=True)
                return False
            have = self.end - start - head
            if magic != MAGIC:
                if have < body:
                    break
                self.start = start + head + body
                if not self._special(magic, view[start + head : self.start], lens, out):
                    return False
                continue
            self.first = False
            if body <= _SMALL:
                if have < body:
                    break
                data = bytearray(view[start + head : start + head + body])
                out.append(self._frames(memoryview(data), lens))
                self.start = start + head + body
                continue
            # large: its own buffer, never reused once delivered (base.PacketHandler)
            own = np.empty(body, dtype=np.uint8).data
            take = min(have, body)
            own[:take] = view[start + head : start + head + take]
            self.start = start + head + take
            if take == body:
                out.append(self._frames(own, lens))
            else:
                self.body, self.lens, self.filled = own, lens, take
                break
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start and self.end - self.start < _PREFIX.size + 4 * MAX_FRAMES + _SMALL:
            # keep room for one whole small record at the front
            rest = self.end - self.start
            view[:rest] = view[self.start : self.end]
            self.start, self.end = 0, rest
        return True

    def _special(
        self, magic: int, body: memoryview, lens: tuple[int, ...], out: list[list[memoryview]]
    ) -> bool:
        """A segment's announcement or a packet whose payload is in it; False if the
        stream broke the protocol (the connection is closed, counted)."""
        if magic == MAGIC_SEG:
            version, reader = SEG.unpack(body) if lens == (SEG.size,) else (0, 0)
            ok = self.first and version == SEG_VERSION and self._segment(reader)
            self.first = False
            if not ok:
                self.inbox.close_reader(self, "unusable shared-memory segment", partial=True)
            return ok
        self.first = False
        shm = self.shm
        if shm is None or lens[-1] != DESC_FRAME.size:
            self.inbox.close_reader(self, "shared payload without a segment", partial=True)
            return False
        frames = self._frames(memoryview(bytearray(body)), lens)
        desc = frames.pop()
        index = struct.unpack_from("<I", desc)[0]
        payload = shm.take(desc[4:]) if index <= len(frames) else None
        if payload is None:  # a descriptor that names no payload of ours: this packet only
            self.inbox.dropped_shm()
            return True
        frames.insert(index, payload)
        out.append(frames)
        return True

    @staticmethod
    def _frames(body: memoryview, lens: tuple[int, ...]) -> list[memoryview]:
        frames = LocalFrames()
        pos = 0
        for n in lens:
            frames.append(body[pos : pos + n])
            pos += n
        return frames


class StreamInbox:
    """The listening socket at a peer's stream path, and its accepted connections.

    Args:
        loop: the event loop that reads (this transport's).
        stats: the transport's counters (``recv_*``, ``dropped_malformed``).
        max_packet: larger records are garbage.
        deliver: called on the loop with each readable callback's packets, in order.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stats: TransportStats,
        max_packet: int,
        deliver: Deliver,
    ) -> None:
        self._loop = loop
        self._stats = stats
        self.max_packet = max_packet
        self._deliver = deliver
        self._listener: socket.socket | None = None
        self._readers: dict[int, _Reader] = {}
        self.path: str | None = None

    def listen(self, path: str) -> bool:
        """Bind and listen at ``path`` (replacing a stale file); False if the OS refuses."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale file of a dead peer: we hold its port now
            sock.bind(path)
            sock.listen(64)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            _log.debug("no same-host stream at %s (%s)", path, err)
            return False
        self._listener, self.path = sock, path
        self._loop.add_reader(sock.fileno(), self._accept)
        return True

    def _accept(self) -> None:
        listener = self._listener
        if listener is None:
            return
        for _ in range(16):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                _log.debug("accept on %s failed: %s", self.path, err)
                return
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                self._stats.dropped_malformed += 1
                _log.warning("same-host stream %s: refused a connection of uid %d", self.path, uid)
                conn.close()
                continue
            conn.setblocking(False)
            reader = _Reader(self, conn)
            self._readers[conn.fileno()] = reader
            self._loop.add_reader(conn.fileno(), reader.on_readable)

    def deliver(self, packets: list[list[memoryview]]) -> None:
        stats = self._stats
        stats.recv_packets += len(packets)
        stats.recv_bytes += sum(v.nbytes for frames in packets for v in frames)
        self._deliver(packets)

    def dropped_shm(self) -> None:
        """A shared payload's descriptor did not match its segment: one packet dropped."""
        self._stats.dropped_malformed += 1
        _log.debug("same-host stream %s: a shared payload's descriptor is stale", self.path)

    def close_reader(self, reader: _Reader, why: str, *, partial: bool) -> None:
        """Drop one connection; a record cut short or unparsable counts as one drop."""
        if partial:
            self._stats.dropped_malformed += 1
            _log.debug("same-host stream %s: %s; connection closed", self.path, why)
        fd = reader.sock.fileno()
        if self._readers.pop(fd, None) is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(fd)
        reader.sock.close()
        if reader.fd is not None:  # received, never mapped
            with contextlib.suppress(OSError):
                os.close(reader.fd)
            reader.fd = None
        reader.shm = None  # the mapping lives on while delivered payloads do

    def close(self) -> None:
        """Stop accepting and reading; remove the socket file."""
        for reader in list(self._readers.values()):
            self.close_reader(reader, "closing", partial=False)
        if self._listener is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None
