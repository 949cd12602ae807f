"""Large same-host payloads through shared memory (``transport/zeromq/local_shm.py``).

What could go wrong, and is checked here: a payload arriving changed (the
sender's buffer reused after ``send``, a slot reused while a receiver still
reads it); a slot never freed (the segment fills for good) or freed while a
handler still holds the payload; a full segment blocking or dropping instead
of sending inline; forged or stale descriptors, a segment of the wrong size or
a shared payload without a segment crashing the reader or delivering another
packet's bytes instead of being counted drops; a receiver that cannot map
segments breaking its sender's streams for ever; one frame to several readers
copied more than once or freed while one still reads it; ``local_shm=False``
not sending inline.  Waits poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import mmap
import os
import socket
import struct
from typing import Any

import numpy as np
import pytest

from gossipnet.config import Config
from gossipnet.transport.zeromq import local_ipc as _local_ipc
from gossipnet.transport.zeromq import local_shm as _shm
from gossipnet.transport.zeromq import local_stream as _ls
from gossipnet.transport.zeromq import stream_routes as _routes
from gossipnet.transport.zeromq.backend import ZmqTransport

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(
        _local_ipc.stream_path(1) is None or not _shm.available(),
        reason="no same-host sockets or memfd here",
    ),
]

WAIT_S = 5.0  # deadline of every wait on a condition (the conftest's ``wait_until``)


def _states(w: Any) -> list[bytes]:
    """The segment's state rows, one per slot (all 0 = free)."""
    r = _shm.READERS
    return [bytes(w.shm._mm[i * r : (i + 1) * r]) for i in range(_shm.SLOTS)]


def _free(w: Any) -> int:
    """How many slots are free."""
    return sum(row == bytes(_shm.READERS) for row in _states(w))


def _in_shm(frame: memoryview) -> bool:
    """Whether a delivered frame is a view of a shared slot (an array over the mmap)."""
    base = frame.obj.base if isinstance(frame.obj, np.ndarray) else None
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


async def _pair(
    keep: bool, config: Config | None = None
) -> tuple[ZmqTransport, ZmqTransport, list[Any]]:
    """A receiver that records each packet (its frames kept as delivered when ``keep``,
    else copied to bytes at once, which frees their slots), and a sender."""
    got: list[Any] = []
    cfg = config or Config()

    def on_packet(frames: Any) -> None:
        got.append(list(frames) if keep else [bytes(f) for f in frames])

    rx, tx = ZmqTransport(cfg), ZmqTransport(cfg)
    await rx.start(on_packet)
    await tx.start(lambda frames: None)
    return rx, tx, got


def test_large_payloads_go_through_slots_arrive_whole_and_free_them(wait_until: Any) -> None:
    async def main() -> None:
        rx, tx, got = await _pair(keep=False)
        sizes = (10, 70_000, 1 << 20, _shm.SLOT_BYTES, _shm.SLOT_BYTES + 1)
        payloads = [bytearray(os.urandom(n)) for n in sizes]
        expected = [bytes(p) for p in payloads]
        for p in payloads:
            assert tx.send(rx.address, [b"head", p, b"tail"])
            p[:4] = b"XXXX"  # the sender reuses its buffer at once: the slot has a copy
        await wait_until(lambda: len(got) == len(sizes), WAIT_S, what="every packet")
        assert got == [[b"head", e, b"tail"] for e in expected]
        w = tx._streams.writers[rx.address]  # type: ignore[union-attr]
        assert w.shm is not None
        assert w.shm.full == 0
        # freed as soon as the handler let go of the views (it copied them)
        await wait_until(lambda: _free(w) == _shm.SLOTS, WAIT_S, what="free slots")
        assert rx.stats.dropped_malformed == 0
        assert tx.stats.sent_bytes == rx.stats.recv_bytes == sum(sizes) + 8 * len(sizes)
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_a_kept_payload_keeps_its_slot_and_a_full_segment_sends_inline(
    wait_until: Any,
) -> None:
    async def main() -> None:
        rx, tx, got = await _pair(keep=True)
        n = _shm.SLOTS + 3
        payloads = [os.urandom(100_000) for _ in range(n)]
        for p in payloads:
            assert tx.send(rx.address, [b"h", p])
        await wait_until(lambda: len(got) == n, WAIT_S, what="every packet")
        assert [bytes(frames[1]) for frames in got] == payloads  # none overwritten
        assert [_in_shm(frames[1]) for frames in got] == [True] * _shm.SLOTS + [False] * 3
        w = tx._streams.writers[rx.address]  # type: ignore[union-attr]
        assert w.shm is not None
        assert w.shm.full == 3
        assert _free(w) == 0  # every slot held by a kept payload
        del got[:3]  # the handler lets three go
        gc.collect()
        await wait_until(lambda: _free(w) == 3, WAIT_S, what="three free slots")
        assert tx.send(rx.address, [b"h", payloads[0]])
        await wait_until(lambda: len(got) == n - 2, WAIT_S, what="one more packet")
        assert _in_shm(got[-1][1])
        assert bytes(got[-1][1]) == payloads[0]
        assert [bytes(frames[1]) for frames in got[:-1]] == payloads[3:]  # still intact
        got.clear()
        gc.collect()
        await wait_until(lambda: _free(w) == _shm.SLOTS, WAIT_S, what="all free")
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_local_shm_false_sends_payloads_inline(wait_until: Any) -> None:
    async def main() -> None:
        rx, tx, got = await _pair(keep=True, config=Config(local_shm=False))
        payload = os.urandom(1 << 20)
        assert tx.send(rx.address, [b"h", payload])
        await wait_until(lambda: len(got) == 1, WAIT_S, what="the packet")
        assert bytes(got[0][1]) == payload
        assert not _in_shm(got[0][1])
        assert tx._streams.writers[rx.address].shm is None  # type: ignore[union-attr]
        await tx.close()
        await rx.close()

    asyncio.run(main())


def _seg_client(
    path: str, fd: int, version: int = _shm.SEG_VERSION, reader: int = 0
) -> socket.socket:
    """A raw stream client that announces the segment ``fd`` (as column ``reader``) as its
    first record."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    record = _ls.encode_prefix([_shm.SEG.size], _ls.MAGIC_SEG) + _shm.SEG.pack(version, reader)
    client.sendmsg([record], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
    return client


def _shm_record(head: bytes, index: int, slot: int, n: int, gen: int) -> bytes:
    desc = _shm.DESC_FRAME.pack(index, slot, n, gen)
    return _ls.encode_prefix([len(head), len(desc)], _ls.MAGIC_SHM) + head + desc


def test_forged_or_stale_descriptors_are_counted_drops_of_that_packet_only(
    wait_until: Any,
) -> None:
    async def main() -> None:
        rx, tx, got = await _pair(keep=False)
        assert rx._inbox is not None
        assert rx._inbox.path is not None
        seg = _shm.ShmWriter()
        client = _seg_client(rx._inbox.path, seg.fd, reader=seg.attach() or 0)
        desc = seg.put(b"P" * 100_000, 0)
        assert desc is not None
        slot, n, gen = _shm.DESC.unpack(desc)
        forged = [
            _shm_record(b"h", 1, _shm.SLOTS, n, gen),  # slot out of range
            _shm_record(b"h", 1, slot, _shm.SLOT_BYTES + 1, gen),  # longer than a slot
            _shm_record(b"h", 1, slot, n, gen + 1),  # another generation (stale)
            _shm_record(b"h", 1, slot + 1, n, gen),  # a free slot
            _shm_record(b"h", 5, slot, n, gen),  # a frame index past the packet
        ]
        client.sendall(b"".join(forged))
        await wait_until(lambda: rx.stats.dropped_malformed == len(forged), WAIT_S, what="drops")
        assert got == []
        client.sendall(_shm_record(b"h", 1, slot, n, gen))  # the real one still arrives
        await wait_until(lambda: len(got) == 1, WAIT_S, what="the valid packet")
        assert got[0] == [b"h", b"P" * 100_000]
        client.close()
        seg.close()
        await tx.close()
        await rx.close()

    asyncio.run(main())


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(WAIT_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "case", ["no-segment", "wrong-size", "wrong-version", "bad-reader", "second-seg"]
)
def test_a_shared_payload_without_a_usable_segment_closes_that_connection(
    case: str, wait_until: Any
) -> None:
    async def main() -> None:
        rx, tx, got = await _pair(keep=False)
        assert rx._inbox is not None
        assert rx._inbox.path is not None
        path = rx._inbox.path
        seg = _shm.ShmWriter()
        if case == "no-segment":
            bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bad.connect(path)
            bad.sendall(_shm_record(b"h", 1, 0, 10, 1))
        elif case == "wrong-size":
            fd = os.memfd_create("small")
            os.ftruncate(fd, 4096)
            bad = _seg_client(path, fd)
            os.close(fd)
        elif case == "wrong-version":
            bad = _seg_client(path, seg.fd, version=_shm.SEG_VERSION + 1)
        elif case == "bad-reader":
            bad = _seg_client(path, seg.fd, reader=_shm.READERS)
        else:  # a segment announced after the first record
            bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bad.connect(path)
            bad.sendall(_ls.encode_prefix([2]) + b"ok")
            await wait_until(lambda: len(got) == 1, WAIT_S, what="the first record")
            seg_body = _shm.SEG.pack(_shm.SEG_VERSION, 0)
            bad.sendall(_ls.encode_prefix([_shm.SEG.size], _ls.MAGIC_SEG) + seg_body)
        await wait_until(lambda: rx.stats.dropped_malformed == 1, WAIT_S, what="the drop")
        assert await asyncio.to_thread(_closed_by_peer, bad)
        bad.close()
        assert tx.send(rx.address, [b"h", os.urandom(200_000)])  # other senders unaffected
        await wait_until(lambda: len(got) == (2 if case == "second-seg" else 1), WAIT_S)
        seg.close()
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_slots_take_generations_and_free_only_their_own() -> None:
    w = _shm.ShmWriter()
    me = w.attach()
    assert me == 0
    r = _shm.ShmReader(os.dup(w.fd), me)  # a descriptor of its own, as a receiver has
    assert w.put(b"x" * (_shm.SLOT_BYTES + 1), me) is None  # inline: larger than a slot
    gens = []
    for _ in range(300):
        desc = w.put(bytearray(b"abc"), me)  # writable: a copy (and a generation) each
        assert desc is not None
        view = r.take(memoryview(desc))
        assert view is not None
        assert bytes(view) == b"abc"
        gens.append(_shm.DESC.unpack(desc)[2])
        del view  # the last view: reference counting frees the slot now
    assert 0 not in gens  # never the free marker
    assert max(gens) == 255
    assert r.take(memoryview(b"short")) is None
    desc = w.put(b"held", me)
    assert desc is not None
    slot = _shm.DESC.unpack(desc)[0]
    state = slot * _shm.READERS + me
    _shm._release(r._mm, set(), state, 7)  # another generation's release: ignored
    assert w._mm[state] != 0
    view = r.take(memoryview(desc))
    del view
    assert w._mm[state] == 0
    w.close()


def test_one_frozen_frame_to_several_readers_takes_one_slot_until_all_let_go() -> None:
    w = _shm.ShmWriter()
    a, b, c = w.attach(), w.attach(), w.attach()
    assert (a, b, c) == (0, 1, 2)
    ra, rb = _shm.ShmReader(os.dup(w.fd), 0), _shm.ShmReader(os.dup(w.fd), 1)
    frozen = memoryview(bytearray(os.urandom(100_000))).toreadonly()
    da, db = w.put(frozen, 0), w.put(frozen, 1)
    assert da is not None
    assert db is not None
    assert _shm.DESC.unpack(da)[0] == _shm.DESC.unpack(db)[0]  # one slot, one copy
    assert w.shared == 1
    va, vb = ra.take(memoryview(da)), rb.take(memoryview(db))
    assert va is not None
    assert vb is not None
    assert rb.take(memoryview(db)) is None  # a name taken twice: the second is refused
    assert bytes(va) == bytes(vb) == bytes(frozen)
    del va
    nxt = w.put(os.urandom(10), 2)  # reader 1 still reads the slot: another one
    assert nxt is not None
    assert _shm.DESC.unpack(nxt)[0] != _shm.DESC.unpack(da)[0]
    del vb
    again = w.put(os.urandom(10), 2)  # now free: the lowest slot again
    assert again is not None
    assert _shm.DESC.unpack(again)[0] == _shm.DESC.unpack(da)[0]
    # a writable frame is copied for each reader: it may change between the sends
    mutable = bytearray(100_000)
    d1, d2 = w.put(mutable, 0), w.put(mutable, 1)
    assert d1 is not None
    assert d2 is not None
    assert _shm.DESC.unpack(d1)[0] != _shm.DESC.unpack(d2)[0]
    w.close()


def test_a_segment_serves_readers_columns_once_and_closes_after_its_last() -> None:
    w = _shm.ShmWriter()
    columns = [w.attach() for _ in range(_shm.READERS)]
    assert columns == list(range(_shm.READERS))
    assert w.exhausted
    assert w.attach() is None  # a retired column is never handed out again
    for _ in columns[:-1]:
        w.detach()
    assert not w.closed
    w.detach()
    assert w.closed  # no one attached and no one can: unmapped
    assert w.put(b"x" * 100_000, 0) is None  # inline from then on


def test_a_receiver_that_cannot_map_segments_gets_payloads_inline_after_two_tries(
    wait_until: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each stream with a segment it cannot map is closed at once; after
    ``SHM_BREAKS_MAX`` of them the sender's next stream carries payloads inline,
    instead of breaking (and falling back to ZeroMQ for a second) for ever."""

    def refuse(fd: int, reader: int) -> Any:
        os.close(fd)
        raise OSError("mmap refused (simulated address-space limit)")

    monkeypatch.setattr(_ls, "ShmReader", refuse)  # only the receiving side maps
    monkeypatch.setattr(_routes, "RETRY_S", 0.05)  # retry streams soon

    async def main() -> None:
        rx, tx, got = await _pair(keep=False)
        payload = os.urandom(200_000)
        assert tx._streams is not None
        streams = tx._streams

        def inline_stream_up() -> bool:
            tx.send(rx.address, [b"h", payload])  # keeps the sender trying
            w = streams.writers.get(rx.address)
            return w is not None and not w.had_shm

        await wait_until(inline_stream_up, WAIT_S, what="a stream without a segment")
        assert streams._shm_breaks[rx.address] == _routes.SHM_BREAKS_MAX
        before = len(got)
        assert tx.send(rx.address, [b"inline", payload])
        await wait_until(lambda: len(got) > before, WAIT_S, what="an inline packet")
        assert [b"inline", payload] in got
        assert rx.stats.dropped_malformed == _routes.SHM_BREAKS_MAX  # one per refused segment
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_a_packet_dropped_by_a_full_queue_gives_its_slot_back(wait_until: Any) -> None:
    """A receiver that stops reading: once the kernel buffer and the queue are full, a
    payload that took a slot is dropped (counted); its slot is free again at once,
    not held for a descriptor that never left."""

    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path = _local_ipc.stream_path(port)
        assert path is not None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(path)
        listener.listen(4)  # accepts (the kernel does), never reads
        tx = ZmqTransport(Config(send_queue_packets=1))
        await tx.start(lambda frames: None)
        dst = f"tcp://127.0.0.1:{port}"
        try:
            big = os.urandom(_shm.SLOT_BYTES + 1)  # inline: fills the socket, then the queue
            while tx.stats.dropped_queue_full == 0:
                tx.send(dst, [b"h", big])
            w = tx._streams.writers[dst]  # type: ignore[union-attr]
            assert w.shm is not None
            dropped = tx.stats.dropped_queue_full
            assert not tx.send(dst, [b"h", os.urandom(100_000)])  # took a slot, then dropped
            assert tx.stats.dropped_queue_full == dropped + 1
            assert _free(w) == _shm.SLOTS  # given back
        finally:
            await tx.close()
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    asyncio.run(main())
