"""UDP GSO/GRO on loopback: batches arrive as separate, byte-exact packets.

Each test runs with batching on (``Config.udp_gso``, what the kernel allows) and
forced off, and checks counters exactly: on loopback nothing is lost below the
socket buffers (8 MiB), and the bursts here are far smaller.  A raw GSO sender
stands in for a peer whose coalesced input holds a broken segment.
"""

from __future__ import annotations

import random
import socket
import struct

import pytest

from gossipnet.config import Config
from gossipnet.testing import run
from gossipnet.testing.virtual_time import wait_until
from gossipnet.transport.udp.backend import UdpTransport
from gossipnet.transport.udp.gso import SOL_UDP, UDP_SEGMENT

pytestmark = pytest.mark.timeout(30)
TIMEOUT_S = 10.0


class Inbox:
    def __init__(self) -> None:
        self.packets: list[list[bytes]] = []

    def __call__(self, frames: list[memoryview]) -> None:
        self.packets.append([bytes(f) for f in frames])


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("udp://").rsplit(":", 1)
    return host, int(port)


def _expected_path(gso: bool) -> str:
    """On this kernel (Linux >= 5.0, loopback) batching is on when asked for."""
    return "gso+gro" if gso else "plain"


async def _burst(
    senders: list[UdpTransport], rx: UdpTransport, inbox: Inbox, sizes: list[int]
) -> None:
    """Every sender sends one packet per size (tag, sender, index) without yielding."""
    for s, tx in enumerate(senders):
        for i, n in enumerate(sizes):
            tag = struct.pack(">HI", s, i)
            payload = bytes([(s * 31 + i) % 256]) * n
            assert tx.send(rx.address, [tag, payload])
    total = len(senders) * len(sizes)
    await wait_until(lambda: len(inbox.packets) >= total, TIMEOUT_S, what=f"{total} packets")


def _check_burst(senders: list[UdpTransport], rx: UdpTransport, inbox: Inbox, sizes: list[int]):
    total = len(senders) * len(sizes)
    assert len(inbox.packets) == total
    per_sender: dict[int, list[int]] = {}
    for tag, payload in inbox.packets:
        s, i = struct.unpack(">HI", tag)
        assert payload == bytes([(s * 31 + i) % 256]) * sizes[i], "payload changed on the way"
        per_sender.setdefault(s, []).append(i)
    for s in range(len(senders)):
        assert per_sender[s] == list(range(len(sizes))), f"sender {s} out of order"
    payload_total = sum(6 + n for n in sizes)
    for tx in senders:
        assert tx.stats.sent_packets == len(sizes)
        assert tx.stats.sent_bytes == payload_total
    assert rx.stats.recv_packets == total
    assert rx.stats.recv_bytes == payload_total * len(senders)
    assert rx.stats.dropped_malformed == 0


@pytest.mark.parametrize("gso", [True, False], ids=["gso", "plain"])
def test_batches_arrive_as_separate_packets_in_order(gso: bool) -> None:
    """(a) Two senders' equal-size bursts: byte-exact, in order per sender, exact counters."""
    sizes = [1000] * 300

    async def main() -> None:
        config = Config(udp_gso=gso)
        inbox = Inbox()
        rx = UdpTransport(config)
        senders = [UdpTransport(config) for _ in range(2)]
        await rx.start(inbox)
        for tx in senders:
            await tx.start(lambda frames: None)
        try:
            await _burst(senders, rx, inbox, sizes)
            _check_burst(senders, rx, inbox, sizes)
            assert rx.path == senders[0].path == _expected_path(gso)
            calls = sum(tx.path_stats.send_calls for tx in senders)
            if gso:  # 1011-byte datagrams: 64 per sendmsg, 5 calls per sender
                assert calls == 2 * 5
                assert rx.path_stats.gro_reads > 0
                assert rx.path_stats.recv_calls < len(inbox.packets)
            else:
                assert calls == 600
                assert rx.path_stats.recv_calls == 600
        finally:
            for t in (*senders, rx):
                await t.close()

    run(main(), timeout_s=TIMEOUT_S * 2)


@pytest.mark.parametrize("gso", [True, False], ids=["gso", "plain"])
def test_a_mixed_size_burst_is_split_correctly(gso: bool) -> None:
    """(b, c) Sizes drawn from a seeded RNG: runs of equal sizes, shorter tails, big ones."""
    rng = random.Random(2101)
    sizes = [rng.choice((0, 7, 1000, 1000, 1000, 1400, 8192, 30000)) for _ in range(400)]

    async def main() -> None:
        config = Config(udp_gso=gso)
        inbox = Inbox()
        rx, tx = UdpTransport(config), UdpTransport(config)
        await rx.start(inbox)
        await tx.start(lambda frames: None)
        try:
            await _burst([tx], rx, inbox, sizes)
            _check_burst([tx], rx, inbox, sizes)
            if gso:
                assert tx.path_stats.gso_batches > 0
                assert tx.path_stats.send_calls < len(sizes)
        finally:
            await tx.close()
            await rx.close()

    run(main(), timeout_s=TIMEOUT_S * 2)


@pytest.mark.parametrize(("tx_gso", "rx_gso"), [(True, False), (False, True)])
def test_batched_and_plain_endpoints_interoperate(tx_gso: bool, rx_gso: bool) -> None:
    """(c) A GSO sender to a plain receiver (the kernel segments) and the reverse."""
    sizes = [1200] * 100 + [300] * 50

    async def main() -> None:
        inbox = Inbox()
        rx, tx = UdpTransport(Config(udp_gso=rx_gso)), UdpTransport(Config(udp_gso=tx_gso))
        await rx.start(inbox)
        await tx.start(lambda frames: None)
        try:
            await _burst([tx], rx, inbox, sizes)
            _check_burst([tx], rx, inbox, sizes)
            assert rx.path_stats.gro_reads == 0  # plain reads, or plain input
        finally:
            await tx.close()
            await rx.close()

    run(main(), timeout_s=TIMEOUT_S * 2)


def test_a_coalesced_read_with_a_broken_segment_drops_only_that_one() -> None:
    """(d) A raw GSO send of 4 good datagrams then a truncated one: the receiver's GRO
    read holds all five; it delivers the four and counts one malformed drop."""
    good = [struct.pack(">BI", 1, 200) + bytes([i]) * 200 for i in range(4)]
    broken = struct.pack(">BI", 1, 200) + b"cut" * 10  # says 200 bytes, holds 30

    async def main() -> None:
        inbox = Inbox()
        rx = UdpTransport(Config())
        await rx.start(inbox)
        try:
            assert rx.path == "gso+gro"
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
                seg = struct.pack("=H", len(good[0]))
                raw.sendmsg(
                    [*good, broken], [(SOL_UDP, UDP_SEGMENT, seg)], 0, _host_port(rx.address)
                )
            await wait_until(
                lambda: rx.stats.dropped_malformed == 1, TIMEOUT_S, what="the malformed drop"
            )
            assert inbox.packets == [[bytes([i]) * 200] for i in range(4)]
            assert rx.stats.recv_packets == 4
            assert rx.stats.recv_bytes == 800
            assert rx.path_stats.gro_reads == 1
            assert rx.path_stats.recv_calls == 1
        finally:
            await rx.close()

    run(main(), timeout_s=TIMEOUT_S * 2)


def test_paced_batches_keep_every_packet() -> None:
    """Pacing with batching: a burst of 500 paced 1 KiB packets all arrive, in order."""
    sizes = [1024] * 500

    async def main() -> None:
        inbox = Inbox()
        rx = UdpTransport(Config())
        tx = UdpTransport(Config(udp_pace_mbps=200.0))
        await rx.start(inbox)
        await tx.start(lambda frames: None)
        try:
            await _burst([tx], rx, inbox, sizes)
            _check_burst([tx], rx, inbox, sizes)
            assert tx.path_stats.gso_batches > 0
        finally:
            await tx.close()
            await rx.close()

    run(main(), timeout_s=TIMEOUT_S * 2)


@pytest.mark.parametrize("gso", [True, False], ids=["gso", "plain"])
def test_a_batch_handler_gets_each_drain_in_one_call_in_order(gso: bool) -> None:
    """With ``batch_handler`` set (the node's per-drain intake) every packet arrives
    once, in order per sender, and in fewer calls than packets; the per-packet handler
    is not called."""
    sizes = [1000] * 300

    async def main() -> None:
        config = Config(udp_gso=gso)
        per_packet = Inbox()
        inbox = Inbox()
        calls: list[int] = []

        def on_batch(batch: list[list[memoryview]]) -> None:
            calls.append(len(batch))
            for frames in batch:
                inbox(frames)

        rx = UdpTransport(config)
        rx.batch_handler = on_batch
        senders = [UdpTransport(config) for _ in range(2)]
        await rx.start(per_packet)
        for tx in senders:
            await tx.start(lambda frames: None)
        try:
            await _burst(senders, rx, inbox, sizes)
            _check_burst(senders, rx, inbox, sizes)
            assert per_packet.packets == []
            assert sum(calls) == 600
            assert len(calls) < 600
        finally:
            for t in (*senders, rx):
                await t.close()

    run(main(), timeout_s=TIMEOUT_S * 2)


def test_a_fault_plan_passes_drains_through() -> None:
    """FaultyTransport over UDP (faults act on the send side): with loss 0 every packet
    reaches the node's batch handler, in drains (fewer calls than packets)."""
    from gossipnet.clock import MonotonicClock
    from gossipnet.transport.fault_plan import FaultPlan
    from gossipnet.transport.faults import FaultyTransport

    async def main() -> None:
        config = Config()
        got: list[int] = []
        tx = UdpTransport(config)
        await tx.start(lambda frames: None)
        rx = FaultyTransport(UdpTransport(config), FaultPlan(seed=1), MonotonicClock())
        rx.batch_handler = lambda batch: got.append(len(batch))
        await rx.start(lambda frames: None)
        try:
            for i in range(200):
                assert tx.send(rx.address, [struct.pack(">I", i), b"x" * 500])
            await wait_until(lambda: sum(got) >= 200, TIMEOUT_S, what="200 packets")
            assert sum(got) == 200
            assert len(got) < 200
        finally:
            await tx.close()
            await rx.close()

    run(main(), timeout_s=TIMEOUT_S * 2)
