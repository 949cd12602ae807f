"""The node's three parts, each exercised alone on a MemoryNetwork under a FakeClock.

:class:`~gossipnet.runtime.dispatch.PacketIO` (send, receive, dispatch by kind),
:class:`~gossipnet.runtime.reliable.Reliable` (acks, retries, once per request) and
:class:`~gossipnet.runtime.membership_protocol.MembershipProtocol` (hello, views,
heartbeats, waiting for peers) are built here by hand, without a ``Node``, so each
test shows what one part does and needs.  ``test_membership.py`` runs them together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gossipnet import Config, FakeClock, FaultPlan
from gossipnet.runtime.dispatch import PacketIO
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import Membership
from gossipnet.runtime.membership_protocol import MembershipProtocol
from gossipnet.runtime.reliable import Reliable
from gossipnet.testing import MemoryNetwork, introduce
from gossipnet.transport import create_transport
from gossipnet.transport.wire import Packet, WireCodec

#: Unassigned packet kinds for the tests' own messages (data range: not urgent).
DATA_KIND = 200
OTHER_KIND = 201
SECRET = b"test-secret"


async def _bound_io(
    network: MemoryNetwork,
    name: str,
    config: Config,
    clock: FakeClock,
    faults: FaultPlan | None = None,
) -> PacketIO:
    """A PacketIO listening on ``mem://<name>``, its transport started (no membership);
    its codec takes HELLOs as introductions, as a node's does."""
    codec = WireCodec(SECRET, config, name, clock=clock, intro_kinds=frozenset({NodeKind.HELLO}))
    io = PacketIO(name, clock, codec)
    io.transport = create_transport(
        f"mem://{name}", config, clock=clock, faults=faults, network=network
    )
    io.address = await io.transport.start(io.on_frames)
    return io


def _know_each_other(a: PacketIO, b: PacketIO, now: float) -> None:
    """Bind each side's codec to the other's key and give each a Membership in which
    the other is alive (no protocol: what a completed handshake leaves)."""
    introduce(a.codec, b.codec)
    for me, other in ((a, b), (b, a)):
        me.membership = Membership(me.peer_id, me.address, failure_timeout_s=60.0)
        me.membership.heard_from(other.peer_id, other.codec.epoch, other.address, now)


@contextlib.asynccontextmanager
async def _pair(
    config: Config, clock: FakeClock, faults: FaultPlan | None = None
) -> AsyncIterator[tuple[PacketIO, PacketIO]]:
    network = MemoryNetwork()
    a = await _bound_io(network, "a", config, clock, faults)
    b = await _bound_io(network, "b", config, clock, faults)
    try:
        yield a, b
    finally:
        for io in (a, b):
            io.closed = True
            assert io.transport is not None
            await io.transport.close()


# --------------------------------------------------------------------------- PacketIO
@pytest.mark.timeout(10)
def test_packet_io_dispatches_by_kind_and_counts_the_unhandled(
    run_async: Callable[..., Any], fast_config: Config, wait_until: Any
) -> None:
    """One handler per kind; a kind nobody took is counted; a handler that raises is
    logged and the next packet is still dispatched; a directed, fresh packet refreshes
    the sender's liveness."""

    async def main() -> None:
        clock = FakeClock()
        async with _pair(fast_config, clock) as (a, b):
            _know_each_other(a, b, clock.now())
            got: list[Packet] = []
            b.subscribe(DATA_KIND, got.append)

            def broken(pkt: Packet) -> None:
                raise RuntimeError("handler bug")

            b.subscribe(OTHER_KIND, broken)
            clock.advance(5.0)
            assert a.send("b", OTHER_KIND, {"i": 0})
            assert a.send("b", DATA_KIND, {"i": 1}, b"payload")
            assert a.send("b", DATA_KIND + 50)  # nobody subscribed
            await wait_until(lambda: len(got) == 1 and b.unhandled, 1.0, clock=clock)
            assert bytes(got[0].payload) == b"payload"
            assert got[0].fields["i"] == 1
            assert b.unhandled == {DATA_KIND + 50: 1}
            assert b.membership is not None
            assert b.membership.known()[0].last_seen == 5.0  # refreshed at arrival
            b.unsubscribe(DATA_KIND)
            assert a.send_many(["b"], DATA_KIND) == 1
            await wait_until(lambda: b.unhandled[DATA_KIND] == 1, 1.0, clock=clock)
            assert not a.send("nobody", DATA_KIND)  # no address: dropped locally

    run_async(main())


@pytest.mark.timeout(10)
def test_packet_io_refuses_to_send_before_it_knows_anyone_and_after_close(
    run_async: Callable[..., Any], fast_config: Config
) -> None:
    """Nothing goes to a peer without its address and key (it would drop a packet we
    hold no pair key for, so none is sent and ``unkeyed`` counts it), except an
    introduction; nothing at all after close."""

    async def main() -> None:
        clock = FakeClock()
        async with _pair(fast_config, clock) as (a, b):
            assert not a.send("b", DATA_KIND)  # no membership yet
            a.membership = Membership("a", a.address, failure_timeout_s=60.0)
            a.membership.heard_from("b", b.codec.epoch, b.address, clock.now())
            assert not a.send("b", DATA_KIND)  # an address but no key: b would drop it
            assert not a.send_to_address(b.address, DATA_KIND, dst="b")
            assert a.codec.unkeyed == 2
            assert a.send_to_address(b.address, NodeKind.HELLO, intro=True)  # needs no key
            _know_each_other(a, b, clock.now())
            assert a.send("b", DATA_KIND)
            a.closed = True
            assert not a.send("b", DATA_KIND)
            assert a.send_many(["b"], DATA_KIND) == 0
            assert not a.send_to_address(b.address, DATA_KIND)

    run_async(main())


# --------------------------------------------------------------------------- Reliable
class _Counting:
    """A handler that counts arrivals and acts on each request id once."""

    def __init__(self) -> None:
        self.acted: dict[int, int] = {}

    def __call__(self, pkt: Packet) -> None:
        i = pkt.fields["i"]
        self.acted[i] = self.acted.get(i, 0) + 1


@pytest.mark.timeout(10)
def test_reliable_retries_through_loss_and_acts_once_per_request(
    run_async: Callable[..., Any], fast_config: Config, drive: Any
) -> None:
    """30% loss both ways (requests and ACKs): every request is acknowledged in the
    end, and b acts on each exactly once although retries of requests it had already
    acknowledged (the ACK lost) arrived too."""

    async def main() -> None:
        clock = FakeClock()
        async with _pair(fast_config, clock, FaultPlan(loss=0.3, seed=7)) as (a, b):
            _know_each_other(a, b, clock.now())
            ra, rb = Reliable(a, fast_config), Reliable(b, fast_config)
            counting = _Counting()
            b.subscribe(DATA_KIND, counting)
            sends = [ra.send_reliable("b", DATA_KIND, {"i": i}, timeout_s=5.0) for i in range(20)]
            results = await drive(clock, asyncio.gather(*sends))
            assert results == [True] * 20
            assert counting.acted == dict.fromkeys(range(20), 1)
            assert b.codec.accepted > 20  # some requests arrived more than once
            assert ra.pending == {}
            assert rb.next_rid == 1  # b sent no request of its own

    run_async(main())


@pytest.mark.timeout(10)
def test_reliable_gives_up_at_its_deadline_and_ignores_a_strangers_ack(
    run_async: Callable[..., Any], fast_config: Config, drive: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with _pair(fast_config, clock) as (a, b):
            _know_each_other(a, b, clock.now())
            ra = Reliable(a, fast_config)
            Reliable(b, fast_config)
            b.closed = True  # b hears nothing, ACKs nothing
            task = asyncio.ensure_future(ra.send_reliable("b", DATA_KIND, timeout_s=0.4))
            await asyncio.sleep(0)
            # an ACK for our request id that b did not send completes nothing
            fields = {"ak": ra.next_rid - 1}
            fake = Packet(src="c", epoch=1, seq=1, kind=5, fields=fields, payload=memoryview(b""))
            ra.on_ack(fake)
            t0 = clock.now()
            assert await drive(clock, task) is False
            assert 0.4 - 1e-9 <= clock.now() - t0 <= 0.41
            assert ra.pending == {}

    run_async(main())


# --------------------------------------------------------------------------- membership
@pytest.mark.timeout(10)
def test_membership_protocol_alone_finds_peers_and_waits_for_them(
    run_async: Callable[..., Any], fast_config: Config, drive: Any
) -> None:
    """Two PacketIOs with a MembershipProtocol each (no Reliable, no Node): HELLOs to
    the bootstrap address (introductions: each binds the other's key) and heartbeats
    make each see the other alive, and beacons ride on the heartbeats."""

    async def main() -> None:
        clock = FakeClock()
        async with _pair(fast_config, clock) as (a, b):
            ma = MembershipProtocol(a, fast_config, bootstrap=[b.address, a.address])
            mb = MembershipProtocol(b, fast_config)
            ma.start()
            mb.start()
            assert ma.bootstrap == [b.address]  # our own address dropped at start
            beacons: list[Any] = []
            mb.on_heartbeat(lambda pkt: beacons.append(pkt.fields.get("round")))
            ma.beacon["round"] = 7
            loops = [asyncio.ensure_future(m.heartbeat_loop()) for m in (ma, mb)]
            try:
                assert await drive(clock, ma.wait_for_peers(2, 2.0)) is True
                assert await drive(clock, mb.wait_for_peers(2, 2.0)) is True
                assert ma.alive_peers() == mb.alive_peers() == ["a", "b"]
                # the HELLOs (introductions) bound each side to the other's own key
                assert a.codec.keys.by_id["b"].public == b.codec.identity.public
                assert b.codec.keys.by_id["a"].public == a.codec.identity.public
                assert await drive(clock, ma.wait_for_peers(3, 0.3)) is False
                assert 7 in beacons
            finally:
                for task in loops:
                    task.cancel()
                await asyncio.gather(*loops, return_exceptions=True)

    run_async(main())
