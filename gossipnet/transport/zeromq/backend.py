"""ZeroMQ backend: UDP semantics (fire-and-forget, drop when full) over tcp/ipc/inproc.

Why ZeroMQ with datagram semantics: its TCP connections give us framing,
reconnection and kernel flow control for free, while ``IMMEDIATE=1``,
bounded high-water marks and ``NOBLOCK`` sends keep the contract of
:class:`~gossipnet.transport.base.Transport`: ``send`` never blocks and
never queues without bound; a peer that is slow, dead or not yet connected
costs dropped packets (counted), never a stalled loop.

Shape: one PULL socket bound on the listen address receives from everyone
(and a second one on the same-host alias, ``local_ipc``); one PUSH socket per
destination is connected lazily on the first send (``_zmq_routes``).
Consequence of ``IMMEDIATE=1``: the first packets to a fresh peer are
dropped (``dropped_queue_full``) until its TCP connection and ZMTP handshake
complete, typically well under a millisecond on a LAN.  Control code that
must not lose its first message awaits :meth:`ZmqTransport.connect` first,
or simply retries, as acknowledged control messages do anyway.

Receiving reads the PULL socket's notification fd with ``loop.add_reader``
and drains ``recv(NOBLOCK, copy=False)`` until ``zmq.Again``; measured
against ``zmq.asyncio`` (a future per message) on loopback it delivers 2.7x
the packets per second at 1 KiB and 1.9x at 64 KiB.  That fd is
edge-triggered, hence the drain-to-empty and the explicit re-schedule when
a drain stops early to let other work run.

Each transport owns a private ``zmq.Context`` (two native threads, terminated
in :meth:`close`), so a join/leave loop leaks neither threads nor fds.  The
exception is ``inproc://``: those endpoints only reach each other inside one
context, so all inproc transports share one reference-counted context.

This is the only module that imports :mod:`zmq`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import tempfile
from collections.abc import Sequence
from typing import ClassVar, cast

import zmq

from gossipnet.clock import Clock, MonotonicClock
from gossipnet.config import Config
from gossipnet.errors import ClosedError, ConfigError
from gossipnet.transport.address import (
    WILDCARD_HOSTS,
    join_host_port,
    split_address,
    split_host_port,
)
from gossipnet.transport.base import (
    BatchHandler,
    Buffer,
    LocalFrames,
    PacketHandler,
    Transport,
    is_frozen,
)
from gossipnet.transport.zeromq.local_ipc import ALIASED_HOST, alias_path, stream_path
from gossipnet.transport.zeromq.local_stream import (
    MAX_FRAMES,
    STREAM_GROUP_MAX_BYTES,
    StreamInbox,
    StreamWriter,
)
from gossipnet.transport.zeromq.routes import PushRoutes
from gossipnet.transport.zeromq.stream_routes import StreamRoutes

__all__ = ("ZmqTransport",)

_log = logging.getLogger(__name__)

#: Messages taken per reader callback before yielding to other loop work.  Why
#: this few: a peer that is both an owner and a sender of a round receives while
#: it sends, and its send loop yields every 32 packets; with 256 per drain it
#: sent one packet for every 8 it received, so its own stream reached its
#: owners last (the all-reduce's 256 KiB row at 25M float32: 0.43-0.44 s per
#: call with 256, 0.40-0.41 s with 32; 16 KiB chunks at 1M: unchanged).
_DRAIN_BATCH = 32
#: Called with the packets of one drain, in order (``PacketIO.on_batch``), where set.
#: Room for the MAC and msgpack framing on top of header + payload limits.
_PACKET_SLACK_BYTES = 64
_FLAGS_MORE = zmq.NOBLOCK | zmq.SNDMORE


class _SharedInprocContext:
    """One reference-counted context for every ``inproc://`` transport of the process."""

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._users = 0

    def acquire(self) -> zmq.Context[zmq.Socket[bytes]]:
        if self._ctx is None:
            self._ctx = zmq.Context()
        self._users += 1
        return self._ctx

    def release(self) -> None:
        self._users -= 1
        if self._users == 0 and self._ctx is not None:
            self._ctx.term()
            self._ctx = None


_INPROC = _SharedInprocContext()


def _nbytes(frame: Buffer) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


class ZmqTransport(Transport):
    """ZeroMQ PUSH/PULL endpoint for ``tcp://``, ``ipc://`` and ``inproc://`` addresses.

    Args:
        config: reads ``send_queue_packets`` (SNDHWM per destination),
            ``recv_queue_packets`` (RCVHWM), ``max_payload_bytes`` and
            ``max_header_bytes`` (packet limit, also ZeroMQ's MAXMSGSIZE, so a
            peer announcing a giant frame is disconnected before we allocate it),
            ``heartbeat_interval_s`` and ``failure_timeout_s`` (ZMTP heartbeats on
            each outgoing connection).
        listen: where to bind; port ``0`` or ``*`` picks a free port, ``ipc://*``
            a fresh path in the temp directory.
        clock: deadlines of :meth:`connect`.
        advertise_host: host put in :attr:`address` when ``listen`` binds a
            wildcard (``0.0.0.0``, ``*``, ``::``); ``127.0.0.1`` when not given,
            which only peers on this machine can reach.
        zero_copy_min_bytes: frames at least this large that are frozen
            (:func:`~gossipnet.transport.base.is_frozen`: ``bytes``, or a read-only
            memoryview) are handed to ZeroMQ without a copy.  Other buffers (tensor
            views, bytearrays) are copied at ``send``: callers may reuse them the
            moment ``send`` returns, as they may with a real socket.

    Raises:
        ConfigError: ``listen`` is not a tcp/ipc/inproc URL.
    """

    schemes: ClassVar[tuple[str, ...]] = ("tcp", "ipc", "inproc")
    # 256 KiB: per-packet Python costs ~40 us, so 64 KiB chunks spend more time in
    # per-packet overhead than in moving bytes (bench/allreduce.py measured 1.3x CPU)
    default_chunk_bytes: ClassVar[int] = 256 * 1024
    # Large buckets go in chunks of up to 4 MiB (collectives.chunks.auto_chunk_bytes):
    # each packet costs two thread wake-ups per process on top of its Python cost.
    # 1 MiB chunks cut the all-reduce's CPU by ~30% against 256 KiB at 16 MB; 2 MiB
    # by 6-14% more against 1 MiB at 100 MB (bench/allreduce.py --chunk-kib 1024 2048,
    # two runs); 4 MiB by 7-9% more against 2 MiB at 100 MB once received messages
    # stopped costing page faults (gossipnet.runtime._malloc; --chunk-kib 4096, two runs).
    # Never above Config.max_payload_bytes (the engine caps it there).
    max_chunk_bytes: ClassVar[int] = 4 * 1024 * 1024

    def __init__(
        self,
        config: Config,
        listen: str = "tcp://127.0.0.1:0",
        *,
        clock: Clock | None = None,
        advertise_host: str | None = None,
        zero_copy_min_bytes: int = zmq.COPY_THRESHOLD,
    ) -> None:
        super().__init__()
        scheme, _ = split_address(listen)
        if scheme not in self.schemes:
            raise ConfigError(f"ZmqTransport serves {self.schemes}, not {listen!r}")
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self._listen = listen
        self._scheme = scheme
        self._advertise_host = advertise_host
        self._zero_copy_min = zero_copy_min_bytes
        self._max_packet = config.max_payload_bytes + config.max_header_bytes + _PACKET_SLACK_BYTES
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pull: zmq.Socket[bytes] | None = None
        self._routes = PushRoutes(config, self.schemes, inproc=scheme == "inproc")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._local: zmq.Socket[bytes] | None = None  # the alias's own PULL socket
        self._local_fd = -1
        self._scheduled: set[bool] = set()  # drains queued: False network, True local
        #: where set (the node sets ``PacketIO.on_batch``), each drain's packets go
        #: here in one call instead of one handler call each
        self.batch_handler: BatchHandler | None = None
        self._closed = False
        self._ipc_path: str | None = None  # a socket file we named, removed at close
        self._alias: str | None = None  # the same-host alias we bound, removed at close
        # the loop-served same-host stream (local_stream.py), where Config.local_stream
        self._streams: StreamRoutes | None = None
        self._inbox: StreamInbox | None = None

    @property
    def max_packet_bytes(self) -> int:
        return self._max_packet

    # ------------------------------------------------------------------ lifecycle
    async def start(self, handler: PacketHandler) -> str:
        """Bind the PULL socket and deliver every received packet to ``handler``.

        Raises:
            ClosedError: the transport was closed.
            ConfigError: the address cannot be bound (in use, bad path or host).
        """
        if self._closed:
            raise ClosedError("this ZmqTransport was closed; create a new one")
        if self._pull is not None:
            raise RuntimeError(f"{self.address} is already started")
        loop = asyncio.get_running_loop()
        ctx = _INPROC.acquire() if self._scheme == "inproc" else zmq.Context()
        pull = self._pull_socket(ctx)
        try:
            bind = self._bind_endpoint(pull)
            pull.bind(bind)
            endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            pull.close(linger=0)
            self._release(ctx)
            raise ConfigError(
                f"cannot bind {self._listen!r} ({err}); is the port taken? port 0 picks a free one"
            ) from err
        self._ctx, self._pull, self._loop, self._handler = ctx, pull, loop, handler
        self._routes.ctx = ctx
        self.address = self._advertised(endpoint)
        # pyzmq types getsockopt as int | bytes; FD and EVENTS are int options
        self._fd = cast(int, pull.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._drain, False)
        # Packets queued before the reader existed raised no edge: look once.
        self._schedule_drain(False)
        self._bind_alias(ctx, loop, endpoint)
        self._bind_stream(loop, endpoint)
        return self.address

    def _pull_socket(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, self.config.recv_queue_packets)
        pull.setsockopt(zmq.MAXMSGSIZE, self._max_packet)
        return pull

    async def close(self) -> None:
        """Stop delivery, close every socket with zero linger, end the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._handler = None
        if self._loop is not None and not self._loop.is_closed():
            for fd in (self._fd, self._local_fd):
                if fd >= 0:
                    self._loop.remove_reader(fd)
        self._routes.close()
        if self._streams is not None:
            self._streams.close()
        if self._inbox is not None:
            self._inbox.close()
        self._streams = self._inbox = None  # sends now fail as on the ZeroMQ path
        for inbox in (self._pull, self._local):
            if inbox is not None:
                inbox.close(linger=0)
        self._pull = self._local = None
        if self._ctx is not None:
            self._release(self._ctx)
            self._ctx = self._routes.ctx = None
        for attr in ("_ipc_path", "_alias"):
            path = getattr(self, attr)
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                setattr(self, attr, None)

    def _release(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        if self._scheme == "inproc":
            _INPROC.release()
        else:
            ctx.term()  # returns at once: every socket is closed with linger 0

    def _bind_endpoint(self, pull: zmq.Socket[bytes]) -> str:
        if self._scheme == "ipc" and self._listen == "ipc://*":
            # libzmq puts wildcard ipc sockets under $TMPDIR or, without it, the
            # current directory (as a relative path): pick an absolute one instead.
            name = f"gossipnet-{os.getpid()}-{secrets.token_hex(6)}.ipc"
            self._ipc_path = os.path.join(tempfile.gettempdir(), name)
            return f"ipc://{self._ipc_path}"
        if self._scheme != "tcp":
            return self._listen
        host, port = split_host_port(split_address(self._listen)[1])
        if ":" in host:
            pull.setsockopt(zmq.IPV6, 1)
        port = "*" if port in ("0", "*") else port
        return (
            f"tcp://*:{port}" if host in WILDCARD_HOSTS else f"tcp://{join_host_port(host, port)}"
        )

    def _bind_alias(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        loop: asyncio.AbstractEventLoop,
        endpoint: str,
    ) -> None:
        """Also listen on the same-host alias of a loopback-reachable tcp endpoint.

        On a PULL socket of its own: what arrives there was written by a process
        of this user (the alias lives in a private directory), and is handed on
        as :class:`~gossipnet.transport.base.LocalFrames` so the codec can skip
        the payload MAC.  One shared socket could not tell the two apart.
        """
        if self._scheme != "tcp" or not self.config.local_ipc:
            return
        host, port = split_host_port(split_address(endpoint)[1])
        if host not in (ALIASED_HOST, "0.0.0.0"):  # LAST_ENDPOINT spells * as 0.0.0.0
            return
        path = alias_path(port)
        if path is None:
            return
        local = self._pull_socket(ctx)
        try:
            local.bind(f"ipc://{path}")  # replaces a stale file: we hold the port
        except zmq.ZMQError as err:
            local.close(linger=0)
            _log.debug("no same-host alias for %s (%s); loopback peers use TCP", endpoint, err)
            return
        self._alias, self._local = path, local
        self._local_fd = cast(int, local.getsockopt(zmq.FD))
        loop.add_reader(self._local_fd, self._drain, True)
        self._schedule_drain(True)

    def _bind_stream(self, loop: asyncio.AbstractEventLoop, endpoint: str) -> None:
        """Send to same-host peers over their loop-served stream, and serve our own.

        Where ``Config.local_stream`` (and ``local_ipc``) are on; see
        ``local_stream.py``.  Sending needs no socket of ours: a peer bound
        elsewhere still reaches ``127.0.0.1`` peers over their streams.
        """
        if self._scheme != "tcp" or not (self.config.local_ipc and self.config.local_stream):
            return
        self._streams = StreamRoutes(self.config, loop, self.stats, self.clock.now)
        # the alias dialed beside a stream (``send``) goes with it: a peer that left
        # holds no socket of ours; a later send dials again
        self._streams.on_broken = self._routes.forget
        host, port = split_host_port(split_address(endpoint)[1])
        path = stream_path(port) if host in (ALIASED_HOST, "0.0.0.0") else None
        if path is None:
            return
        inbox = StreamInbox(loop, self.stats, self._max_packet, self._deliver_local)
        if inbox.listen(path):
            self._inbox = inbox

    def _deliver_local(self, packets: list[list[memoryview]]) -> None:
        """One read's packets from a stream: to the batch handler, or one by one."""
        handler = self._handler
        if handler is None:
            return
        batch = self.batch_handler
        if batch is not None:
            try:
                batch(packets)
            except Exception:
                _log.exception("batch handler raised on %s; packets dropped", self.address)
            return
        for frames in packets:
            try:
                handler(frames)
            except Exception:
                _log.exception("packet handler raised on %s; packet dropped", self.address)
            if self._handler is None:
                return

    def _advertised(self, endpoint: str) -> str:
        """The address peers must use: never a wildcard host."""
        if self._scheme != "tcp":
            return endpoint
        host, port = split_host_port(split_address(endpoint)[1])
        listen_host, _ = split_host_port(split_address(self._listen)[1])
        if listen_host in WILDCARD_HOSTS or host in WILDCARD_HOSTS:
            host = self._advertise_host or "127.0.0.1"
        return f"tcp://{join_host_port(host, port)}"

    # ------------------------------------------------------------------ receive
    def _schedule_drain(self, local: bool) -> None:
        if local not in self._scheduled and self._loop is not None:
            self._scheduled.add(local)
            self._loop.call_soon(self._drain, local)

    def _drain(self, local: bool) -> None:
        """Deliver queued messages until ZeroMQ reports none (the fd is edge-triggered).

        ``local``: drain the alias's socket, whose packets go out as ``LocalFrames``.
        With a :attr:`batch_handler` set, the drain's packets go to it in one call
        at the end of the drain (at most ``_DRAIN_BATCH``), in order.
        """
        self._scheduled.discard(local)
        pull, handler = (self._local if local else self._pull), self._handler
        if pull is None or handler is None:
            return
        batch: list[list[memoryview]] | None = [] if self.batch_handler is not None else None
        try:
            if self._receive(pull, local, handler, batch):
                # Batch used up with messages possibly left: no new edge will come for them.
                self._schedule_drain(local)
        finally:
            if batch:
                try:
                    self.batch_handler(batch)  # type: ignore[misc]
                except Exception:
                    _log.exception("batch handler raised on %s; packets dropped", self.address)

    def _receive(
        self,
        pull: zmq.Socket[bytes],
        local: bool,
        handler: PacketHandler,
        batch: list[list[memoryview]] | None,
    ) -> bool:
        """Receive up to ``_DRAIN_BATCH`` messages; True if more may be queued.

        Each goes to ``handler`` at once, or into ``batch`` where one is given.
        """
        stats = self.stats
        recv = pull.recv
        frames = LocalFrames if local else list
        for _ in range(_DRAIN_BATCH):
            try:
                frame = recv(zmq.NOBLOCK, copy=False)
                views = frames((frame.buffer,))
                while frame.more:
                    frame = recv(zmq.NOBLOCK, copy=False)
                    views.append(frame.buffer)
            except zmq.Again:
                return False
            except zmq.ZMQError:  # closed under us (a handler called close())
                return False
            stats.recv_packets += 1
            stats.recv_bytes += sum(v.nbytes for v in views)
            if batch is not None:
                batch.append(views)
                continue
            try:
                handler(views)
            except Exception:
                _log.exception("packet handler raised on %s; packet dropped", self.address)
            if self._pull is None:
                return False
        return True

    # ------------------------------------------------------------------ send
    def send(
        self,
        dst: str,
        frames: Sequence[Buffer],
        *,
        urgent: bool = False,
        group_bytes: int = 0,
    ) -> bool:
        """Queue one packet for ``dst`` without blocking; False = dropped and counted.

        Same-host destinations with a loop-served stream (``Config.local_stream``)
        get it there, unless the stream has no shared-memory segment
        (``Config.local_shm``), ``group_bytes`` is above
        :data:`~.local_stream.STREAM_GROUP_MAX_BYTES` and their ZeroMQ alias is
        connected: then over the alias (dialed only for such streams).  The choice
        depends on ``group_bytes`` and on which channels are up, so one group's
        packets share a channel (the alias answers within a millisecond of the first
        packet to ``dst``, long before a collective's first round).

        Drops: ``dropped_queue_full`` when ``dst``'s queue is at SNDHWM or its
        connection is not up (yet, or any more); ``dropped_oversize`` above
        :attr:`max_packet_bytes`; ``dropped_unreachable`` for an address this
        backend cannot connect to (other scheme, malformed); ``send_errors``
        before :meth:`start`, after :meth:`close`, or on other ZeroMQ errors.
        """
        stats, routes = self.stats, self._routes
        if self._streams is not None:
            writer = self._streams.writer(dst)
            if writer is not None:
                if writer.shm is None:  # with a segment every group takes the stream
                    if dst not in routes.push:
                        routes.ready_alias(dst)  # start connecting it for large groups
                    if group_bytes > STREAM_GROUP_MAX_BYTES:
                        alias = routes.ready_alias(dst)
                        if alias is not None:
                            return self._push(alias, frames)
                return self._send_stream(writer, frames)
        sock = routes.push.get(dst)
        if sock is None:
            if self._ctx is None:
                stats.send_errors += 1
                return False
            sock = routes.open(dst)
            if sock is None:
                stats.dropped_unreachable += 1
                return False
        elif routes.next and dst in routes.next:
            sock = routes.take_over(dst, sock)
        if not self._push(sock, frames):
            return False
        if routes.unaliased and dst in routes.unaliased:
            routes.look_for_alias(dst)
        return True

    def _push(self, sock: zmq.Socket[bytes], frames: Sequence[Buffer]) -> bool:
        """One packet onto a PUSH socket, as one multipart message; counted."""
        stats = self.stats
        sizes = [_nbytes(frame) for frame in frames]
        nbytes = sum(sizes)
        if nbytes > self._max_packet:
            stats.dropped_oversize += 1
            return False
        last = len(frames) - 1
        if last < 0:
            stats.dropped_malformed += 1
            return False
        zc_min = self._zero_copy_min
        try:
            # A multipart message is atomic in ZeroMQ: if the first part is accepted
            # the rest are too, so Again can only come from the first send.
            for i, frame in enumerate(frames):
                copy = sizes[i] < zc_min or not is_frozen(frame)
                sock.send(frame, _FLAGS_MORE if i < last else zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            stats.dropped_queue_full += 1
            return False
        except zmq.ZMQError:
            stats.send_errors += 1
            return False
        stats.sent_packets += 1
        stats.sent_bytes += nbytes
        return True

    def _send_stream(self, writer: StreamWriter, frames: Sequence[Buffer]) -> bool:
        """``send`` over a same-host stream: the same size checks and counters."""
        sizes = [_nbytes(frame) for frame in frames]
        if sum(sizes) > self._max_packet:
            self.stats.dropped_oversize += 1
            return False
        if not sizes or len(sizes) > MAX_FRAMES:
            self.stats.dropped_malformed += 1
            return False
        return writer.send(frames, sizes)

    def is_local(self, dst: str) -> bool:
        """True once ``dst``'s packets go over its alias or stream (arriving as ``LocalFrames``)."""
        if self._streams is not None and self._streams.writer(dst) is not None:
            return True
        return self._routes.is_local(dst)

    def forget(self, dst: str) -> None:
        """Close ``dst``'s PUSH socket and stream (queued packets dropped); a later send reopens."""
        self._routes.forget(dst)
        if self._streams is not None:
            self._streams.forget(dst)

    async def connect(self, dst: str, timeout_s: float) -> bool:
        """Wait until a packet to ``dst`` would be accepted; False at the deadline.

        Why: ``IMMEDIATE=1`` drops packets to a peer whose connection is not up,
        so control code that must not lose its first message (a join announcement)
        waits here first.  Polls the socket's POLLOUT state with a short, growing
        pause on the injected clock; never blocks the loop.
        """
        if self._ctx is None:
            return False
        if self._streams is not None and self._streams.writer(dst) is not None:
            return True
        push = self._routes.push
        sock = push.get(dst) or self._routes.open(dst)
        if sock is None:
            return False
        deadline = self.clock.now() + timeout_s
        pause_s = 0.0005
        while not self._closed and push.get(dst) is sock:
            if cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
                return True
            remaining = deadline - self.clock.now()
            if remaining <= 0:
                return False
            await self.clock.sleep(min(pause_s, remaining))
            pause_s = min(pause_s * 2, 0.02)
        return False
