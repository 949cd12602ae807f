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
MTU = 1500
SENDER_PORT = 47_311
RECEIVER_PORT = 47_312
DEADLINE_S = 20.0


def _payload(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size


def receive(listen: str, sender: str, size: int) -> dict[str, Any]:
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
            bad += bytes(frames[1]) != _payload(i, size)
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


def send(listen: str, receiver: str, size: int) -> dict[str, Any]:
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
                assert tx.send(receiver, [struct.pack(">I", i), _payload(i, size)])
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
@pytest.mark.parametrize(
    "size",
    [1200, 8000],
    ids=["fits-mtu", "above-mtu"],  # above: GSO cannot fragment; those go one per call
)
def test_gso_and_gro_work_or_fall_back_cleanly_on_veth(size: int, record_property: Any) -> None:
    with Testbed(hosts=2, mtu=MTU) as tb:
        rx_host, tx_host = tb.hosts
        rx_url, tx_url = rx_host.url(RECEIVER_PORT), tx_host.url(SENDER_PORT)
        rx_task = rx_host.start(receive, rx_url, tx_url, size)
        tx = tx_host.call(send, tx_url, rx_url, size, timeout_s=60)
        rx = rx_task.result(60)
    path = (
        f"{size} B payloads, MTU {MTU}: sender {tx['path']} ({tx['send_calls']} send calls),"
        f" receiver {rx['path']} ({rx['recv_calls']} reads, {rx['gro_reads']} coalesced)"
    )
    record_property("udp_path", path)
    print(f"UDP path on veth: {path}")
    assert tx["stats"]["sent_packets"] == PACKETS, tx
    assert sum(v for k, v in tx["stats"].items() if k.startswith("dropped")) == 0, tx
    assert rx["stats"]["recv_packets"] == PACKETS, rx
    assert rx["stats"]["dropped_malformed"] == 0, rx
    assert rx["in_order"], "packets reordered or lost on one veth path"
    assert rx["bad"] == 0, "payloads changed on the way"
    if tx["gso_batches"]:  # batched: fewer calls than datagrams
        assert "gso" in tx["path"]
        assert tx["send_calls"] < PACKETS
    else:  # fell back (for the socket, or for datagrams above the MTU): one call each,
        # plus the one batch the kernel refused (resent plainly, nothing lost)
        assert PACKETS <= tx["send_calls"] <= PACKETS + 1
    if size + 13 + 28 > MTU:  # the kernel refuses to segment above the MTU
        assert tx["gso_batches"] == 0
        assert "gso" in tx["path"]  # for that size only: smaller datagrams stay batched
    if rx["gro_reads"]:
        assert "gro" in rx["path"]
        assert rx["recv_calls"] < PACKETS
