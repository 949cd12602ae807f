"""The loop-served same-host stream (``transport/zeromq/local_stream.py``).

What could go wrong, and is checked here: packets (small, large, several
frames) arriving changed, out of order or not as ``LocalFrames``; garbage,
oversized or cut-short records crashing the reader instead of being counted
drops; a receiver that stops reading making ``send`` block or queue without
bound; a queued frame the caller changes after ``send`` arriving changed; a
receiver that dies mid-stream breaking the sender instead of sending it back
to the ZeroMQ path; and ``local_stream=False`` (or a peer without the stream)
not falling back.  Waits poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gossipnet.config import Config
from gossipnet.transport.base import LocalFrames
from gossipnet.transport.zeromq import local_ipc as _local_ipc
from gossipnet.transport.zeromq import local_stream as _ls
from gossipnet.transport.zeromq.backend import ZmqTransport

pytestmark = [
    pytest.mark.timeout(20),
    pytest.mark.skipif(_local_ipc.stream_path(1) is None, reason="no same-host sockets here"),
]

WAIT_S = 5.0  # deadline of every wait on a condition (the conftest's ``wait_until``)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _pair(config: Config | None = None) -> tuple[ZmqTransport, ZmqTransport, list[Any]]:
    """A receiver that records each packet's frames (as bytes, with its type), and a sender."""
    got: list[Any] = []
    cfg = config or Config(local_stream=True)
    rx, tx = ZmqTransport(cfg), ZmqTransport(cfg)
    await rx.start(lambda frames: got.append((type(frames), [bytes(f) for f in frames])))
    await tx.start(lambda frames: None)
    return rx, tx, got


def test_packets_arrive_whole_in_order_as_local_frames(wait_until: Any) -> None:
    async def main() -> None:
        rx, tx, got = await _pair()
        assert rx._inbox is not None
        assert rx._inbox.path == _local_ipc.stream_path(rx.address.rsplit(":", 1)[1])
        rng = [os.urandom(n) for n in (0, 1, 5000, 70_000, 300_000, 3_000_000)]
        sent = [[b"head%d" % i, payload, b"t"] for i, payload in enumerate(rng)]
        sent.append([b"one frame only"])
        pushed: list[object] = []  # packets handed to a ZeroMQ socket
        tx._push = lambda sock, frames: bool(pushed.append(frames)) or True  # type: ignore[method-assign]
        for frames in sent:
            assert tx.send(rx.address, frames)
        assert tx.is_local(rx.address)
        assert pushed == []  # nothing went through ZeroMQ (its alias is dialed, unused)
        await wait_until(lambda: len(got) == len(sent), WAIT_S, what="every packet")
        assert [frames for _, frames in got] == sent
        assert all(kind is LocalFrames for kind, _ in got)
        nbytes = sum(len(f) for frames in sent for f in frames)
        assert tx.stats.sent_packets == rx.stats.recv_packets == len(sent)
        assert tx.stats.sent_bytes == rx.stats.recv_bytes == nbytes
        paths.append(rx._inbox.path)
        assert tx._streams is not None
        await rx.close()
        # an idle writer notices its receiver left and frees its socket at once
        await wait_until(lambda: not tx._streams.writers, WAIT_S, what="the writer to close")
        assert tx.stats.dropped_unreachable == 0  # nothing was queued
        await tx.close()

    paths: list[str | None] = []
    asyncio.run(main())
    assert paths[0] is not None
    assert not os.path.exists(paths[0])  # close removed it


def test_local_stream_false_and_peers_without_it_use_zeromq(wait_until: Any) -> None:
    async def main() -> None:
        got: list[bytes] = []
        rx = ZmqTransport(Config(local_stream=False))  # serves no stream
        tx = ZmqTransport(Config(local_stream=True))  # would use one
        await rx.start(lambda frames: got.append(bytes(frames[1])))
        await tx.start(lambda frames: None)
        assert rx._inbox is None
        assert rx._streams is None
        assert tx._streams is not None
        assert tx._streams.writer(rx.address) is None
        assert await tx.connect(rx.address, 3.0)
        assert tx.send(rx.address, [b"h", b"over zeromq"])
        await wait_until(lambda: got == [b"over zeromq"], WAIT_S, what="the fallback packet")
        assert rx.address in tx._routes.push
        await tx.close()
        await rx.close()

    asyncio.run(main())


def _raw_client(path: str) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    return client


def _record(frames: list[bytes]) -> bytes:
    return _ls.encode_prefix([len(f) for f in frames]) + b"".join(frames)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 64,  # bad magic
        struct.pack("<HHI", _ls.MAGIC, 0, 0),  # no frames
        struct.pack("<HHI", _ls.MAGIC, _ls.MAX_FRAMES + 1, 4),  # too many frames
        struct.pack("<HHI", _ls.MAGIC, 1, 1 << 30),  # body above the packet limit
        struct.pack("<HHII", _ls.MAGIC, 2, 10, 3) + struct.pack("<I", 4),  # lengths 3+4 != 10
    ],
    ids=["magic", "no-frames", "many-frames", "oversize", "lengths"],
)
def test_garbage_records_are_counted_drops_and_close_only_that_connection(
    garbage: bytes, wait_until: Any
) -> None:
    async def main() -> None:
        rx, tx, got = await _pair()
        assert rx._inbox is not None
        assert rx._inbox.path is not None
        bad = _raw_client(rx._inbox.path)
        bad.sendall(_record([b"fine before"]) + garbage)
        await wait_until(lambda: rx.stats.dropped_malformed == 1, WAIT_S, what="the drop")
        assert [frames for _, frames in got] == [[b"fine before"]]
        assert bad.recv(1) == b""  # the receiver closed that connection
        bad.close()
        assert tx.send(rx.address, [b"h", b"after"])  # other senders unaffected
        await wait_until(lambda: len(got) == 2, WAIT_S, what="a good packet after")
        assert got[1][1] == [b"h", b"after"]
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_a_sender_dying_mid_record_is_one_counted_drop(wait_until: Any) -> None:
    async def main() -> None:
        rx, tx, got = await _pair()
        assert rx._inbox is not None
        assert rx._inbox.path is not None
        for body in (b"x" * 100, b"y" * 200_000):  # small (buffered) and large (own buffer)
            dying = _raw_client(rx._inbox.path)
            record = _record([b"h", body])
            dying.sendall(record[: len(record) - 7])
            await asyncio.sleep(0)  # let the reader see part of it (not needed to pass)
            dying.close()
        await wait_until(lambda: rx.stats.dropped_malformed == 2, WAIT_S, what="two drops")
        assert got == []
        assert rx.stats.recv_packets == 0
        await tx.close()
        await rx.close()

    asyncio.run(main())


class _SlowReader:
    """A stream listener at ``port``'s path that accepts but reads only when asked."""

    def __init__(self, port: int) -> None:
        path = _local_ipc.stream_path(port)
        assert path is not None
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            os.unlink(path)
        self.listener.bind(path)
        self.listener.listen(4)
        self.conn: socket.socket | None = None

    def accept(self) -> None:
        self.conn, _ = self.listener.accept()

    def records(self, count: int) -> list[list[bytes]]:
        """Read ``count`` whole records (blocking, bounded by a socket timeout)."""
        assert self.conn is not None
        self.conn.settimeout(WAIT_S)
        out = []
        for _ in range(count):
            magic, n, body = struct.unpack("<HHI", self._exact(8))
            assert magic == _ls.MAGIC
            lens = struct.unpack(f"<{n}I", self._exact(4 * n))
            data = self._exact(body)
            pos, frames = 0, []
            for size in lens:
                frames.append(data[pos : pos + size])
                pos += size
            out.append(frames)
        return out

    def _exact(self, n: int) -> bytes:
        assert self.conn is not None
        buf = bytearray()
        while len(buf) < n:
            chunk = self.conn.recv(n - len(buf))
            assert chunk, "stream ended early"
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


@contextlib.asynccontextmanager
async def _sender_to_slow_reader(
    queue: int,
) -> AsyncIterator[tuple[ZmqTransport, _SlowReader, str]]:
    """A stream sender (``queue`` packets of user-space queue) to a reader that
    accepts and reads only when told; both closed after."""
    port = _free_port()
    slow = _SlowReader(port)
    # payloads inline (local_shm=False): the slow reader parses plain records
    tx = ZmqTransport(Config(local_stream=True, local_shm=False, send_queue_packets=queue))
    await tx.start(lambda frames: None)
    try:
        yield tx, slow, f"tcp://127.0.0.1:{port}"
    finally:
        await tx.close()
        slow.close()


def test_a_receiver_that_stops_reading_costs_counted_drops_never_a_block() -> None:
    """Bounded queue: ``send`` returns at once, drops beyond it are counted, and a
    queued frame the caller changes after ``send`` arrives as it was sent."""

    async def main() -> None:
        async with _sender_to_slow_reader(3) as (tx, slow, dst):
            payloads = [bytearray(os.urandom(1 << 20)) for _ in range(40)]
            expected = [bytes(p) for p in payloads]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            ok = [tx.send(dst, [b"h", p]) for p in payloads]
            assert loop.time() - t0 < 2.0  # never blocked on the full socket
            for p in payloads:
                p[:8] = b"CHANGED!"  # the caller reuses its buffers
            taken = sum(ok)
            assert 0 < taken < len(payloads)  # the kernel buffer and the queue filled
            assert tx.stats.dropped_queue_full == len(payloads) - taken
            assert 0 < tx._streams.writers[dst].queued_packets <= 3  # type: ignore[union-attr]
            slow.accept()
            records = await asyncio.to_thread(slow.records, taken)
            accepted = [e for e, k in zip(expected, ok, strict=True) if k]
            assert records == [[b"h", e] for e in accepted]

    asyncio.run(main())


def test_a_receiver_dying_mid_stream_sends_its_packets_back_to_zeromq(
    wait_until: Any,
) -> None:
    async def main() -> None:
        async with _sender_to_slow_reader(8) as (tx, slow, dst):
            sent = [tx.send(dst, [b"h", os.urandom(1 << 20)]) for _ in range(16)]
            writer = tx._streams.writers[dst]  # type: ignore[union-attr]
            queued = writer.queued_packets
            assert 0 < queued <= 8
            assert sent[0]
            assert not sent[-1]
            slow.accept()
            slow.close()  # dies with our packets unread
            broke: Callable[[], bool] = lambda: dst not in tx._streams.writers  # type: ignore[union-attr] # noqa: E731
            await wait_until(broke, WAIT_S, what="the writer to notice")
            assert tx.stats.dropped_unreachable == queued
            # nothing listens now: the next sends take the ZeroMQ path (its own drops)
            before = tx.stats.dropped_queue_full + tx.stats.dropped_unreachable
            assert not tx.send(dst, [b"h", b"x"])
            assert tx.stats.dropped_queue_full + tx.stats.dropped_unreachable == before + 1
            assert dst in tx._routes.push
            assert not tx.is_local(dst)

    asyncio.run(main())


def test_a_stale_stream_file_is_not_used_and_is_tried_again_later(wait_until: Any) -> None:
    """A socket file nobody listens on (a peer killed with SIGKILL) refuses the
    connect: packets take the ZeroMQ path, and the stream is tried again only
    after ``RETRY_S``, not on every send."""

    async def main() -> None:
        got: list[bytes] = []
        rx = ZmqTransport(Config(local_stream=False))
        tx = ZmqTransport(Config(local_stream=True))
        await rx.start(lambda frames: got.append(bytes(frames[1])))
        await tx.start(lambda frames: None)
        path = _local_ipc.stream_path(rx.address.rsplit(":", 1)[1])
        assert path is not None
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)
        stale.close()  # the file stays, nothing listens
        try:
            assert tx._streams is not None
            assert tx._streams.writer(rx.address) is None
            skip_until = tx._streams._skip[rx.address]
            assert skip_until > tx.clock.now()
            assert await tx.connect(rx.address, 3.0)
            assert tx.send(rx.address, [b"h", b"via zeromq"])
            await wait_until(lambda: got == [b"via zeromq"], WAIT_S, what="the packet")
            assert tx._streams._skip[rx.address] == skip_until  # not re-probed per send
        finally:
            os.unlink(path)
            await tx.close()
            await rx.close()

    asyncio.run(main())
