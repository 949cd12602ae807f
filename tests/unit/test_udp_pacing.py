"""The UDP backend's send pacing: rate, per-destination order, round-robin, bounds.

The pacer is pure logic over a clock and a send function, so most checks run
under ``FakeClock`` with no sockets; one loopback test checks that a paced
``UdpTransport`` keeps to its rate and loses nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gossipnet.clock import FakeClock
from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.transport.udp.backend import UdpTransport
from gossipnet.transport.udp.pacing import WIRE_OVERHEAD_BYTES, Pacer, default_burst_bytes


def _pacer(
    rate: float = 100_000.0, burst: int = 2_000, queue: int = 1000
) -> tuple[Pacer, FakeClock, list[tuple[Any, bytes, float]]]:
    clock = FakeClock()
    out: list[tuple[Any, bytes, float]] = []
    pacer = Pacer(rate, burst, queue, clock, lambda dst, data: out.append((dst, data, clock.now())))
    return pacer, clock, out


def test_pacer_keeps_the_rate_and_sends_everything() -> None:
    pacer, clock, out = _pacer(rate=100_000.0, burst=2_000)
    size = 1000 - WIRE_OVERHEAD_BYTES  # 1000 wire bytes each
    for i in range(100):
        assert pacer.submit("a", bytes([i % 256]) * size)
    assert len(out) == 2  # the 2 kB bucket let two leave at once (the second into debt)
    for step in range(1, 101):
        clock.advance(0.01)
        sent_bytes = len(out) * 1000
        # never ahead of the bucket: burst + rate x elapsed, plus the one packet of debt
        assert sent_bytes <= 2_000 + 100_000 * 0.01 * step + 1000
    assert len(out) == 100
    assert pacer.queued == 0
    # 100 kB at 100 kB/s, the first 2 kB free: the last one leaves near t = 0.98 s
    assert 0.9 <= out[-1][2] <= 1.0
    assert [d[1] for d in out] == [bytes([i % 256]) * size for i in range(100)]


def test_pacer_serves_destinations_in_turn_and_keeps_each_fifo() -> None:
    pacer, clock, out = _pacer(rate=10_000.0, burst=1)
    for i in range(5):
        pacer.submit("a", b"a%d" % i)
    for i in range(5):
        pacer.submit("b", b"b%d" % i)
    clock.advance(10.0)
    order = [data.decode() for _, data, _ in out]
    assert order == ["a0", "a1", "b0", "a2", "b1", "a3", "b2", "a4", "b3", "b4"]
    for dst in ("a", "b"):
        mine = [d for d in order if d[0] == dst]
        assert mine == sorted(mine)  # an END marker never overtakes its data


def test_pacer_refuses_beyond_the_queue_bound_and_close_discards() -> None:
    pacer, clock, out = _pacer(rate=1_000.0, burst=1, queue=3)
    assert pacer.submit("a", b"x")  # sent at once (bucket not empty)
    assert all(pacer.submit("a", b"y") for _ in range(3))
    assert not pacer.submit("a", b"z")  # "a" holds 3
    assert pacer.submit("b", b"w")  # other destinations have their own bound
    assert pacer.close() == 4
    clock.advance(100.0)
    assert [d for _, d, _ in out] == [b"x"]  # the timer was cancelled with the queue


def test_pacer_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        _pacer(rate=0.0)
    with pytest.raises(ConfigError, match="udp_pace_mbps"):
        Config(udp_pace_mbps=0.0)
    assert default_burst_bytes(1e6) == 65536
    assert default_burst_bytes(1.25e9) == 5_000_000


@pytest.mark.timeout(20)
def test_paced_udp_transport_keeps_its_rate_on_loopback(run_async: Any) -> None:
    """200 datagrams of 8 KiB at 40 Mbit/s take ~0.33 s and all arrive (unpaced: ~ms)."""

    async def main() -> tuple[float, int, int]:
        cfg = Config(udp_pace_mbps=40.0)
        got: list[int] = []
        done = asyncio.Event()
        rx = UdpTransport(Config())

        def on_packet(frames: list[memoryview]) -> None:
            got.append(frames[0].nbytes)
            if len(got) == 200:
                done.set()

        dst = await rx.start(on_packet)
        tx = UdpTransport(cfg)
        await tx.start(lambda frames: None)
        payload = b"\x07" * 8192
        t0 = time.monotonic()
        accepted = sum(tx.send(dst, [payload]) for _ in range(200))
        await asyncio.wait_for(done.wait(), 10.0)
        elapsed = time.monotonic() - t0
        await tx.close()
        await rx.close()
        return elapsed, accepted, tx.stats.sent_packets

    elapsed, accepted, sent = run_async(main())
    assert accepted == sent == 200
    wire = 200 * (8192 + 1 + 4 + WIRE_OVERHEAD_BYTES)
    ideal = (wire - default_burst_bytes(5e6)) / 5e6
    assert elapsed >= 0.9 * ideal, f"{elapsed:.3f} s is faster than the rate allows"
    assert elapsed <= ideal + 2.0


def test_urgent_packets_skip_the_queue_and_the_rate_still_holds() -> None:
    """A heartbeat must not wait behind a second of queued data (false failure
    reports), but what it takes from the bucket delays the data, not the rate."""
    pacer, clock, out = _pacer(rate=100_000.0, burst=2_000)
    size = 1000 - WIRE_OVERHEAD_BYTES
    for _ in range(100):  # one second of data at the rate
        pacer.submit("a", b"d" * size)
    sent_before = len(out)
    clock.advance(0.001)
    assert pacer.submit("a", b"hb", urgent=True)
    assert out[-1][1] == b"hb"  # left at once, ahead of ~98 queued data packets
    assert out[-1][2] == pytest.approx(0.001)
    assert len(out) == sent_before + 1
    clock.advance(2.0)
    data = [t for _, d, t in out if d != b"hb"]
    assert len(data) == 100  # nothing lost
    # 100 kB + the heartbeat's bytes at 100 kB/s: the data still keeps the rate
    assert data[-1] >= 0.98
