"""The UDP backend's batching logic without a network: grouping, splitting, fallback.

``runs`` decides which datagrams share one ``sendmsg``; ``BatchSender`` sends them
and falls back when the kernel refuses GSO; the pacer charges a batch at once.
A fake socket stands in for the kernel, so each refusal is replayed exactly.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import struct
from typing import Any

import pytest

from gossipnet.clock import FakeClock
from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.transport.base import TransportStats
from gossipnet.transport.udp.backend import UdpTransport
from gossipnet.transport.udp.gso import (
    MAX_SEGMENTS,
    SOL_UDP,
    UDP_GRO,
    UDP_SEGMENT,
    GsoState,
    PathStats,
    gro_segment_size,
    runs,
    split_segments,
)
from gossipnet.transport.udp.pacing import WIRE_OVERHEAD_BYTES, Pacer
from gossipnet.transport.udp.sender import BatchSender

LIMIT = 65507


def _submit(batch: BatchSender, addr: str, datagram: bytes, *, urgent: bool = False) -> bool:
    """``batch.submit`` with the frame bytes send() passes along (one frame: 5 bytes of framing)."""
    return batch.submit(addr, datagram, len(datagram) - 5, urgent=urgent)


def _framed(payload: bytes) -> bytes:
    """One datagram in the backend's framing, one frame."""
    return struct.pack(">BI", 1, len(payload)) + payload


def test_runs_group_equal_sizes_and_let_the_last_be_shorter() -> None:
    a, b, c = b"a" * 100, b"b" * 100, b"c" * 60
    big = b"d" * 200
    assert list(runs([a, b, c, a], LIMIT, LIMIT)) == [[a, b, c], [a]]
    assert list(runs([c, a, b], LIMIT, LIMIT)) == [[c], [a, b]]  # a larger one starts a run
    assert list(runs([a, big, b], LIMIT, LIMIT)) == [[a], [big, b]]  # shorter after big: ok
    assert list(runs([a, b], 99, LIMIT)) == [[a], [b]]  # above the GSO ceiling: alone
    assert list(runs([], LIMIT, LIMIT)) == []


def test_runs_respect_the_segment_and_byte_limits_and_keep_order() -> None:
    rng = random.Random(21)
    sizes = [rng.choice((1200, 1200, 1200, 900, 3000)) for _ in range(2000)]
    datagrams = [bytes([i % 256]) * n for i, n in enumerate(sizes)]
    out = list(runs(datagrams, LIMIT, LIMIT))
    assert [d for run in out for d in run] == datagrams  # nothing lost, order kept
    for run in out:
        assert len(run) <= MAX_SEGMENTS
        assert sum(map(len, run)) <= LIMIT
        assert all(len(d) == len(run[0]) for d in run[:-1])
        assert len(run[-1]) <= len(run[0])
    full = [b"x" * 100] * 130
    assert [len(r) for r in runs(full, LIMIT, LIMIT)] == [64, 64, 2]
    assert [len(r) for r in runs([b"y" * 30000] * 3, LIMIT, LIMIT)] == [2, 1]


def test_split_segments_are_views_with_a_shorter_tail() -> None:
    data = bytes(range(250))
    parts = split_segments(data, 100)
    assert [bytes(p) for p in parts] == [data[:100], data[100:200], data[200:]]
    assert all(p.obj is data for p in parts)  # views, not copies
    assert [bytes(p) for p in split_segments(data, 0)] == [data]
    assert [bytes(p) for p in split_segments(data, 250)] == [data]


def test_gro_segment_size_reads_the_cmsg() -> None:
    assert gro_segment_size([(SOL_UDP, UDP_GRO, struct.pack("=i", 1400))]) == 1400
    assert gro_segment_size([(SOL_UDP, UDP_SEGMENT, struct.pack("=i", 9))]) == 0
    assert gro_segment_size([(SOL_UDP, UDP_GRO, b"\x01")]) == 0  # short: ignored
    assert gro_segment_size([]) == 0


def test_gso_state_reads_refusals() -> None:
    state = GsoState(max_segment=LIMIT)
    assert not state.refused(1000, errno.EAGAIN)  # a full buffer is a drop, not a refusal
    assert state.max_segment == LIMIT
    assert state.refused(8200, errno.EINVAL)  # above an Ethernet MTU: that size only
    assert state.max_segment == 8199
    assert state.refused(4000, errno.EMSGSIZE)  # Linux 6.x says EMSGSIZE above the MTU
    assert state.max_segment == 3999
    assert state.refused(1400, errno.EMSGSIZE)  # a tunnel's smaller MTU: still that size only
    assert state.max_segment == 1399
    assert state.refused(1000, errno.EIO)  # no checksum offload: off for the socket
    assert state.max_segment == 0


class FakeSocket:
    """Records sends; ``sendmsg`` raises ``refuse`` (an errno) when set."""

    def __init__(self, refuse: int | None = None) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, list[bytes], int]] = []

    def sendmsg(self, buffers: list[bytes], cmsg: Any, flags: int, addr: Any) -> int:
        if self.refuse is not None:
            raise OSError(self.refuse, os.strerror(self.refuse))
        (segment,) = struct.unpack("=H", cmsg[0][2])
        self.calls.append(("sendmsg", list(buffers), segment))
        return sum(map(len, buffers))

    def sendto(self, data: bytes, addr: Any) -> int:
        self.calls.append(("sendto", [data], 0))
        return len(data)


class FakeLoop:
    """Keeps the end-of-iteration flush callbacks; the tests flush by hand."""

    def __init__(self) -> None:
        self.soon: list[Any] = []

    def call_soon(self, callback: Any) -> None:
        self.soon.append(callback)


def _sender(sock: FakeSocket, pacer: Pacer | None = None) -> tuple[BatchSender, TransportStats]:
    stats = TransportStats()
    batch = BatchSender(
        sock,  # type: ignore[arg-type]
        FakeLoop(),  # type: ignore[arg-type]
        stats,
        PathStats(gso=True),
        pacer,
        LIMIT,
        "udp://test",
    )
    return batch, stats


@pytest.mark.parametrize("err", [errno.EIO, errno.EINVAL, errno.EOPNOTSUPP])
def test_refused_gso_resends_the_batch_plainly_logs_once_and_stays_off(
    err: int, caplog: pytest.LogCaptureFixture
) -> None:
    sock = FakeSocket(refuse=err)
    batch, stats = _sender(sock)
    packets = [_framed(bytes([i]) * 1000) for i in range(10)]
    with caplog.at_level(logging.INFO, logger="gossipnet.transport.udp.sender"):
        for data in packets[:5]:
            assert _submit(batch, "a", data)
        batch.flush_all()
        sock.refuse = None  # would work now, but the verdict is once per socket
        for data in packets[5:]:
            assert _submit(batch, "a", data)
        batch.flush_all()
    assert [c[0] for c in sock.calls] == ["sendto"] * 10
    assert [c[1][0] for c in sock.calls] == packets  # nothing lost, order kept
    assert stats.sent_packets == 10
    assert stats.sent_bytes == 10 * 1000
    assert stats.dropped_queue_full == stats.send_errors == 0
    assert batch._path.path == "plain"
    assert len([r for r in caplog.records if "refused UDP GSO" in r.getMessage()]) == 1


@pytest.mark.parametrize("err", [errno.EMSGSIZE, errno.EINVAL])
def test_large_segments_refused_keep_gso_for_small_ones(err: int) -> None:
    """The testbed's veth at MTU 1500 refuses 8000-byte segments (EMSGSIZE on 6.x):
    those datagrams go one per call (IP fragments them), nothing is dropped."""
    sock = FakeSocket(refuse=err)
    batch, stats = _sender(sock)
    for _ in range(3):
        _submit(batch, "a", _framed(b"L" * 8000))
    batch.flush_all()
    sock.refuse = None
    for _ in range(3):
        _submit(batch, "a", _framed(b"s" * 1000))
    batch.flush_all()
    assert [(c[0], len(c[1])) for c in sock.calls] == [("sendto", 1)] * 3 + [("sendmsg", 3)]
    assert sock.calls[-1][2] == 1005
    assert stats.sent_packets == 6
    assert batch._path.path == "gso"


def test_a_full_batch_leaves_at_once_and_urgent_keeps_the_order() -> None:
    sock = FakeSocket()
    batch, stats = _sender(sock)
    for i in range(MAX_SEGMENTS):
        _submit(batch, "a", _framed(bytes([i]) * 100))
    assert [(c[0], len(c[1])) for c in sock.calls] == [("sendmsg", MAX_SEGMENTS)]
    _submit(batch, "a", _framed(b"d" * 100))
    _submit(batch, "b", _framed(b"other" * 20))
    _submit(batch, "a", _framed(b"hb"), urgent=True)  # flushes "a" first, not "b"
    assert [c[1] for c in sock.calls[1:]] == [[_framed(b"d" * 100)], [_framed(b"hb")]]
    batch.flush_all()
    assert sock.calls[-1][1] == [_framed(b"other" * 20)]
    assert stats.sent_packets == MAX_SEGMENTS + 3


def test_paced_batches_are_charged_at_once_and_bounded_in_packets() -> None:
    clock = FakeClock()
    sock = FakeSocket()
    pacer = Pacer(100_000.0, 2_000, 16, clock, lambda dst, run: None)
    batch, stats = _sender(sock, pacer)
    pacer._emit = batch.emit
    datagrams = [_framed(bytes([i]) * 500) for i in range(20)]
    assert all(_submit(batch, "a", d) for d in datagrams[:12])
    batch.flush_all()
    # one batch of 12 left at once (the bucket had tokens): one call, all bytes charged
    assert [(c[0], len(c[1])) for c in sock.calls] == [("sendmsg", 12)]
    assert pacer._tokens == pytest.approx(2_000 - 12 * (505 + WIRE_OVERHEAD_BYTES))
    # now the bucket is in debt: these wait, bounded by 16 packets (queued + pending)
    later = [_submit(batch, "a", d) for d in datagrams]
    assert later == [True] * 16 + [False] * 4
    assert stats.dropped_queue_full == 4
    batch.flush_all()
    assert pacer.queued_for("a") == 16
    assert pacer.queued == 16
    clock.advance(1.0)
    assert [(c[0], len(c[1])) for c in sock.calls] == [("sendmsg", 12), ("sendmsg", 16)]
    assert sock.calls[1][1] == datagrams[:16]
    assert stats.sent_packets == 28


def test_pacer_discard_at_close_counts_batches_as_dropped() -> None:
    clock = FakeClock()
    sock = FakeSocket()
    pacer = Pacer(1_000.0, 1, 100, clock, lambda dst, run: None)
    batch, stats = _sender(sock, pacer)
    pacer._emit = batch.emit
    for _ in range(2):
        _submit(batch, "a", _framed(b"z" * 100))  # the first leaves (bucket > 0), then one batch
    batch.flush_all()
    for _ in range(3):
        _submit(batch, "a", _framed(b"z" * 100))
    batch.flush_all()
    assert pacer.queued == 3
    batch.discarded(pacer.discard())
    assert stats.sent_packets == 2
    assert stats.dropped_queue_full == 3


def test_config_udp_gso_must_be_a_bool() -> None:
    assert Config().udp_gso is True
    assert Config(udp_gso=False).udp_gso is False
    with pytest.raises(ConfigError, match="udp_gso"):
        Config(udp_gso=1)  # type: ignore[arg-type]


def test_send_batch_delivers_each_packet_and_counts_the_oversized(run_async: Any) -> None:
    """``UdpTransport.send_batch``: one lookup for a run, the same datagrams and drops
    as :meth:`send` per packet: every packet arrives whole and in order, an
    oversized one is a counted drop, an unknown address counts every packet."""

    async def main() -> tuple[list[bytes], int, Any, int]:
        got: list[bytes] = []
        done = asyncio.Event()
        rx = UdpTransport(Config())

        def on_packet(frames: list[memoryview]) -> None:
            got.append(bytes(frames[1]))
            if len(got) == 5:
                done.set()

        dst = await rx.start(on_packet)
        tx = UdpTransport(Config())
        await tx.start(lambda frames: None)
        packets = [[b"h%d" % i, bytes([i]) * 8000] for i in range(5)]
        packets.insert(2, [b"big", b"\x00" * 70_000])  # over a datagram: dropped, counted
        accepted = tx.send_batch(dst, packets)
        await asyncio.wait_for(done.wait(), 10.0)
        unreachable = tx.send_batch("tcp://127.0.0.1:1", packets[:2])  # not a udp address
        stats = tx.stats
        await tx.close()
        await rx.close()
        return got, accepted, stats, unreachable

    got, accepted, stats, unreachable = run_async(main())
    assert accepted == 5
    assert stats.sent_packets == 5
    assert stats.dropped_oversize == 1
    assert got == [bytes([i]) * 8000 for i in range(5)]
    assert unreachable == 0
    assert stats.dropped_unreachable == 2


def test_parse_datagram_reads_three_frames_inline_and_refuses_broken_lengths() -> None:
    """The usual wire packet (header, payload, MAC) takes a branch of its own: the
    same views as the general path, and broken lengths are still None."""
    from gossipnet.transport.udp.backend import parse_datagram

    frames = [b"head", b"p" * 100, b"m" * 36]
    data = struct.pack(">B3I", 3, 4, 100, 36) + b"".join(frames)
    got = parse_datagram(data)
    assert got is not None
    assert [bytes(f) for f in got] == frames
    empty = parse_datagram(struct.pack(">B3I", 3, 0, 0, 0))  # three empty frames
    assert [bytes(f) for f in empty or [b"x"]] == [b""] * 3
    for bad in (data[:-1], data + b"x", struct.pack(">B3I", 3, 1, 0, 0), data[:12]):
        assert parse_datagram(bad) is None


def test_send_each_joins_a_broadcast_once_and_counts_every_send(run_async: Any) -> None:
    """``UdpTransport.send_each``: one packet to three receivers arrives at each,
    counted once per send; an oversized one is dropped (counted) for each; an
    address that is not UDP takes the per-send path and its own drop."""

    async def main() -> tuple[list[list[bytes]], int, int, int, Any]:
        got: list[list[bytes]] = [[], [], []]
        done = asyncio.Event()
        rxs = [UdpTransport(Config()) for _ in range(3)]

        def on_packet(i: int) -> Any:
            def handler(frames: list[memoryview]) -> None:
                got[i].append(b"".join(bytes(f) for f in frames))
                if all(got):
                    done.set()

            return handler

        dsts = [await rx.start(on_packet(i)) for i, rx in enumerate(rxs)]
        tx = UdpTransport(Config())
        await tx.start(lambda frames: None)
        frames = [b"head", b"x" * 8000, b"m" * 36]
        accepted = tx.send_each(dsts, frames)
        await asyncio.wait_for(done.wait(), 10.0)
        oversized = tx.send_each(dsts, [b"big", b"\x00" * 70_000, b"m"])
        mixed = tx.send_each([dsts[0], "tcp://127.0.0.1:1"], frames)
        stats = tx.stats
        await tx.close()
        for rx in rxs:
            await rx.close()
        return got, accepted, oversized, mixed, stats

    got, accepted, oversized, mixed, stats = run_async(main())
    assert accepted == 3
    assert got == [[b"head" + b"x" * 8000 + b"m" * 36]] * 3
    assert oversized == 0
    assert mixed == 1  # of the mixed pair, the UDP one
    assert stats.sent_packets == 4
    assert stats.dropped_oversize == 3
    assert stats.dropped_unreachable == 1
