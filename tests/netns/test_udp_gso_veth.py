"""UDP GSO/GRO across veth: two testbed hosts (namespaces, veth to a bridge).

Loopback accepts GSO and GRO on any kernel that has them; a veth path may not
(a device without checksum offload refuses GSO, and GRO reads depend on the
device).  This test sends a burst across a real veth pair and checks that the
batched path either works or falls back cleanly: every packet arrives byte for
byte, in order, counted exactly, and the path each side ended on is reported
(``record_property("udp_path", ...)``, and on stdout with ``-s``).

Needs root, ``ip`` and namespaces; skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import pytest

from gossipnet.testbed import Testbed, unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

PACKETS = 600
PAYLOAD_BYTES = 1200  # + framing and tag: one datagram fits a 1500-byte MTU
SENDER_PORT = 47_311
RECEIVER_PORT = 47_312
DEADLINE_S = 20.0


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * PAYLOAD_BYTES


def receive(listen: str, sender: str) -> dict[str, Any]:
    """In the receiver host: announce readiness until data comes, then count the burst."""
    from gossipnet.config import Config
    from gossipnet.transport.udp.backend import UdpTransport

    async def main() -> dict[str, Any]:
        got: list[int] = []
        bad = 0
        done = asyncio.Event()

        def on_packet(frames: list[memoryview]) -> None:
            nonlocal bad
            (i,) = struct.unpack(">I", frames[0])
            bad += bytes(frames[1]) != _payload(i)
            got.append(i)
            if len(got) == PACKETS:
                done.set()

        rx = UdpTransport(Config(), listen)
        await rx.start(on_packet)
        async with asyncio.timeout(DEADLINE_S):
            while not got:  # UDP has no connect: say "ready" until the burst starts
                rx.send(sender, [b"ready"], urgent=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.05)
            await done.wait()
        await rx.close()
        return {
            "path": rx.path,
            "in_order": got == list(range(PACKETS)),
            "bad": bad,
            "stats": rx.stats.as_dict(),
            "recv_calls": rx.path_stats.recv_calls,
            "gro_reads": rx.path_stats.gro_reads,
        }

    return asyncio.run(main())


def send(listen: str, receiver: str) -> dict[str, Any]:
    """In the sender host: wait for the receiver's "ready", then send the burst."""
    from gossipnet.config import Config
    from gossipnet.transport.udp.backend import UdpTransport

    async def main() -> dict[str, Any]:
        ready = asyncio.Event()
        tx = UdpTransport(Config(), listen)
        await tx.start(lambda frames: ready.set())
        async with asyncio.timeout(DEADLINE_S):
            await ready.wait()
            for i in range(PACKETS):
                assert tx.send(receiver, [struct.pack(">I", i), _payload(i)])
                if i % 64 == 63:
                    await asyncio.sleep(0)  # one batch per loop turn, as the engine sends
        await asyncio.sleep(0)  # the last batch leaves at the end of this turn
        await tx.close()
        return {
            "path": tx.path,
            "stats": tx.stats.as_dict(),
            "send_calls": tx.path_stats.send_calls,
            "gso_batches": tx.path_stats.gso_batches,
        }

    return asyncio.run(main())


@pytest.mark.timeout(90)
def test_gso_and_gro_work_or_fall_back_cleanly_on_veth(
    record_property: Any,
) -> None:
    with Testbed(hosts=2, mtu=1500) as tb:
        rx_host, tx_host = tb.hosts
        rx_url, tx_url = rx_host.url(RECEIVER_PORT), tx_host.url(SENDER_PORT)
        rx_task = rx_host.start(receive, rx_url, tx_url)
        tx = tx_host.call(send, tx_url, rx_url, timeout_s=60)
        rx = rx_task.result(60)
    path = (
        f"sender {tx['path']} ({tx['send_calls']} send calls), receiver {rx['path']}"
        f" ({rx['recv_calls']} reads, {rx['gro_reads']} coalesced)"
    )
    record_property("udp_path", path)
    print(f"UDP path on veth: {path}")
    assert tx["stats"]["sent_packets"] == PACKETS, tx
    assert sum(v for k, v in tx["stats"].items() if k.startswith("dropped")) == 0, tx
    assert rx["stats"]["recv_packets"] == PACKETS, rx
    assert rx["stats"]["dropped_malformed"] == 0, rx
    assert rx["in_order"], "packets reordered or lost on one veth path"
    assert rx["bad"] == 0, "payloads changed on the way"
    if "gso" in tx["path"]:  # batched: fewer calls than datagrams
        assert tx["gso_batches"] > 0
        assert tx["send_calls"] < PACKETS
    else:  # fell back: one call per datagram, nothing lost
        assert tx["send_calls"] == PACKETS
    if rx["gro_reads"]:
        assert "gro" in rx["path"]
        assert rx["recv_calls"] < PACKETS
