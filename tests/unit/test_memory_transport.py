"""MemoryTransport: asynchronous FIFO delivery, copy-on-send, and counted drops.

The memory hub stands in for a real network in every unit test above the
transport, so what it promises (never deliver inside ``send``, never alias the
sender's buffers, count every drop) is pinned here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

import pytest

from gossipnet.errors import ClosedError, ConfigError
from gossipnet.transport.memory import MemoryNetwork, MemoryTransport

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test coroutine on a fresh loop in debug mode (no pytest-asyncio)."""
    return asyncio.run(coro, debug=True)


async def settle() -> None:
    """Let callbacks already scheduled with ``call_soon`` run."""
    for _ in range(3):
        await asyncio.sleep(0)


class Inbox:
    """A packet handler that keeps copies of what it received."""

    def __init__(self) -> None:
        self.packets: list[list[bytes]] = []
        self.all_memoryviews = True

    def __call__(self, frames: list[memoryview]) -> None:
        self.all_memoryviews &= all(type(f) is memoryview for f in frames)
        self.packets.append([bytes(f) for f in frames])


async def endpoint(net: MemoryNetwork, listen: str, **kw: Any) -> tuple[MemoryTransport, Inbox]:
    transport = MemoryTransport(net, listen, **kw)
    inbox = Inbox()
    await transport.start(inbox)
    return transport, inbox


def test_delivery_is_asynchronous_fifo_and_counted() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        a, _ = await endpoint(net, "mem://a")
        b, inbox = await endpoint(net, "mem://b")
        for i in range(100):
            assert a.send("mem://b", [i.to_bytes(4, "big"), b"payload"])
        assert inbox.packets == []  # never delivered inside send()
        assert b.pending_packets == 100
        await settle()
        assert [int.from_bytes(p[0], "big") for p in inbox.packets] == list(range(100))
        assert inbox.packets[0][1] == b"payload"
        assert inbox.all_memoryviews
        assert b.pending_packets == 0
        assert (a.stats.sent_packets, a.stats.sent_bytes) == (100, 1100)
        assert (b.stats.recv_packets, b.stats.recv_bytes) == (100, 1100)
        await a.close()
        await b.close()

    run(main())


def test_frames_are_copied_at_send() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        a, _ = await endpoint(net, "mem://a")
        _, inbox = await endpoint(net, "mem://b")
        buf = bytearray(b"before")
        view = memoryview(bytearray(b"xy"))
        assert a.send("mem://b", [buf, view])
        buf[:] = b"after!"
        view[:] = b"zz"
        await settle()
        assert inbox.packets == [[b"before", b"xy"]]

    run(main())


def test_unknown_and_closed_destinations_are_unreachable() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        a, _ = await endpoint(net, "mem://a")
        b, inbox = await endpoint(net, "mem://b")
        assert not a.send("mem://nobody", [b"x"])
        assert a.send("mem://b", [b"in flight"])
        await b.close()
        await b.close()  # idempotent
        await settle()
        assert inbox.packets == []  # in flight when b closed: lost
        assert b.stats.recv_packets == 0
        assert not a.send("mem://b", [b"x"])
        assert a.stats.dropped_unreachable == 2
        assert net.addresses == ("mem://a",)
        assert net.lookup("mem://b") is None

    run(main())


def test_queue_limit_drops_and_counts() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        a, _ = await endpoint(net, "mem://a")
        _, inbox = await endpoint(net, "mem://b", queue_limit_packets=3)
        results = [a.send("mem://b", [bytes([i])]) for i in range(5)]
        assert results == [True, True, True, False, False]
        assert a.stats.dropped_queue_full == 2
        await settle()
        assert inbox.packets == [[b"\x00"], [b"\x01"], [b"\x02"]]
        assert a.send("mem://b", [b"again"])  # the queue drained

    run(main())


def test_oversize_packet_dropped() -> None:
    class Small(MemoryTransport):
        MAX_PACKET_BYTES: ClassVar[int] = 8

    async def main() -> None:
        net = MemoryNetwork()
        a = Small(net, "mem://a")
        await a.start(Inbox())
        _, inbox = await endpoint(net, "mem://b")
        assert a.max_packet_bytes == 8
        assert not a.send("mem://b", [b"12345", memoryview(b"6789")])
        assert a.send("mem://b", [b"1234", memoryview(b"5678")])
        await settle()
        assert a.stats.dropped_oversize == 1
        assert len(inbox.packets) == 1

    run(main())


def test_auto_names_and_binding_errors() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        first, _ = await endpoint(net, "mem://")
        second, _ = await endpoint(net, "mem://0")
        assert (first.address, second.address) == ("mem://auto-0", "mem://auto-1")
        await endpoint(net, "mem://auto-2")  # taken by hand: auto naming skips it
        third, _ = await endpoint(net, "mem://")
        assert third.address == "mem://auto-3"
        with pytest.raises(ConfigError, match="already bound"):
            await endpoint(net, "mem://auto-0")
        with pytest.raises(ConfigError, match="mem://"):
            MemoryTransport(net, "tcp://127.0.0.1:0")
        with pytest.raises(ConfigError, match="queue_limit_packets"):
            MemoryTransport(net, queue_limit_packets=0)
        assert first.default_chunk_bytes == 64 * 1024
        assert first.max_packet_bytes >= 64 * 1024 * 1024

    run(main())


def test_closed_transport_refuses_send_and_start() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        a, _ = await endpoint(net, "mem://a")
        await endpoint(net, "mem://b")
        await a.close()
        assert not a.send("mem://b", [b"x"])
        assert a.stats.send_errors == 1
        with pytest.raises(ClosedError):
            await a.start(Inbox())
        unstarted = MemoryTransport(net, "mem://c")
        assert not unstarted.send("mem://b", [b"x"])

    run(main())


def test_networks_are_isolated() -> None:
    async def main() -> None:
        one, two = MemoryNetwork(), MemoryNetwork()
        a, _ = await endpoint(one, "mem://a")
        _, inbox = await endpoint(two, "mem://b")
        await endpoint(two, "mem://a")  # same name on another network is fine
        assert not a.send("mem://b", [b"x"])
        await settle()
        assert inbox.packets == []

    run(main())


def test_delivery_across_event_loops() -> None:
    """Peers run one loop thread each under join(); the hub must cross loops safely."""
    net = MemoryNetwork()
    loop_b = asyncio.new_event_loop()
    thread = threading.Thread(target=loop_b.run_forever, name="loop-b", daemon=True)
    thread.start()
    got = threading.Event()
    received: list[bytes] = []

    def on_b(frames: list[memoryview]) -> None:
        received.append(bytes(frames[0]))
        if len(received) == 3:
            got.set()

    b = MemoryTransport(net, "mem://b")
    try:
        asyncio.run_coroutine_threadsafe(b.start(on_b), loop_b).result(timeout=5)

        async def main() -> None:
            a, _ = await endpoint(net, "mem://a")
            for i in range(3):
                assert a.send("mem://b", [bytes([i])])

        run(main())
        assert got.wait(timeout=5)
        assert received == [b"\x00", b"\x01", b"\x02"]
    finally:
        asyncio.run_coroutine_threadsafe(b.close(), loop_b).result(timeout=5)
        loop_b.call_soon_threadsafe(loop_b.stop)
        thread.join(timeout=5)
        loop_b.close()
