"""Membership bookkeeping and the node runtime on a MemoryNetwork (no sockets).

The first half drives :class:`~gossipnet.runtime.membership.Membership` by hand with
explicit ``now`` values; the second runs real :class:`~gossipnet.runtime.node.Node` s
on a memory hub under a :class:`~gossipnet.FakeClock`, so failure timeouts
cost no wall time and every run replays the same packet fates.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import pytest

from gossipnet import Config, Crash, FakeClock, FaultPlan
from gossipnet.errors import ClosedError
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import Membership
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

TIMEOUT_S = 3.0
#: An unassigned packet kind for control messages the tests send.
TEST_KIND = 200


class Events:
    """A membership callback that records ``(event, peer)``."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def __call__(self, event: str, peer: str) -> None:
        self.log.append((event, peer))


def membership() -> tuple[Membership, Events]:
    m = Membership("me", "mem://me", TIMEOUT_S)
    events = Events()
    m.on_change(events)
    return m, events


# --------------------------------------------------------------------------- Membership
def test_first_direct_packet_joins_and_alive_is_sorted_with_self() -> None:
    m, events = membership()
    m.heard_from("zed", 1, "mem://zed", now=0.0)
    m.heard_from("alice", 1, "mem://alice", now=0.0)
    m.heard_from("alice", 1, None, now=0.5)  # later packets need not repeat the address
    assert m.alive() == ["alice", "me", "zed"]
    assert events.log == [("joined", "zed"), ("joined", "alice")]
    assert m.address_of("alice") == "mem://alice"
    assert m.address_of("me") == "mem://me"
    assert m.is_alive("me")
    assert m.version == 2


def test_own_packets_and_unaddressed_strangers_are_ignored() -> None:
    m, events = membership()
    m.heard_from("me", 5, "mem://elsewhere", now=0.0)
    m.heard_from("ghost", 1, None, now=0.0)  # no address: we could not answer it
    assert m.alive() == ["me"]
    assert m.address_of("me") == "mem://me"
    assert m.known() == []
    assert events.log == []


def test_learned_from_a_view_is_known_but_not_alive() -> None:
    m, events = membership()
    assert m.learned("bob", "mem://bob", 0.0) is True
    assert m.learned("bob", "mem://bob", 0.0) is False  # probe once
    assert m.learned("me", "mem://me", 0.0) is False
    assert m.alive() == ["me"]
    assert not m.is_alive("bob")
    assert m.address_of("bob") == "mem://bob"
    assert [p.peer_id for p in m.known()] == ["bob"]
    assert m.view() == [("me", "mem://me")]  # only alive peers are passed on
    assert events.log == []
    m.heard_from("bob", 1, None, now=1.0)  # its first direct packet: now alive
    assert m.alive() == ["bob", "me"]
    assert events.log == [("joined", "bob")]


def test_expire_at_exactly_the_timeout_keeps_then_kills() -> None:
    m, events = membership()
    m.heard_from("bob", 1, "mem://bob", now=10.0)
    m.heard_from("carl", 1, "mem://carl", now=11.0)
    assert m.expire(10.0 + TIMEOUT_S) == []  # silent for exactly the timeout: still alive
    assert m.is_alive("bob")
    assert m.expire(10.0 + TIMEOUT_S + 1e-6) == ["bob"]
    assert not m.is_alive("bob")
    assert m.is_alive("carl")
    assert m.expire(100.0) == ["carl"]
    assert m.expire(1000.0) == []  # the dead die once
    assert events.log == [
        ("joined", "bob"),
        ("joined", "carl"),
        ("died", "bob"),
        ("died", "carl"),
    ]
    assert m.alive() == ["me"]
    assert m.view() == [("me", "mem://me")]


def test_a_fresh_packet_postpones_expiry() -> None:
    m, _ = membership()
    m.heard_from("bob", 1, "mem://bob", now=0.0)
    m.heard_from("bob", 1, None, now=2.0)
    assert m.expire(4.0) == []
    assert m.expire(5.0 + 1e-6) == ["bob"]


def test_a_stale_view_never_resurrects_a_dead_peer() -> None:
    m, events = membership()
    m.heard_from("bob", 7, "mem://bob", now=0.0)
    assert m.expire(TIMEOUT_S + 1.0) == ["bob"]
    # a view that still lists bob (someone has not noticed yet) changes nothing
    assert m.learned("bob", "mem://bob", 0.0) is False
    # neither does a late packet of an older incarnation
    m.heard_from("bob", 6, "mem://bob", now=5.0)
    assert not m.is_alive("bob")
    assert m.alive() == ["me"]
    assert events.log == [("joined", "bob"), ("died", "bob")]
    # only a direct packet of bob's own brings it back
    m.heard_from("bob", 7, None, now=6.0)
    assert m.is_alive("bob")
    assert events.log[-1] == ("joined", "bob")


def test_our_own_stall_is_excused_not_blamed_on_the_peers() -> None:
    m, events = membership()
    m.heard_from("bob", 1, "mem://bob", now=0.0)
    m.heard_from("carl", 1, "mem://carl", now=2.0)
    # our loop did not run from t=1 to t=6: five of their seconds of silence are ours
    m.excuse(5.0, now=6.0)
    assert m.expire(6.0 + 1e-6) == []
    # never later than now: a peer is not credited with a packet from the future
    assert m.expire(6.0 + TIMEOUT_S + 1e-6) == ["bob", "carl"]
    assert [e for e, _ in events.log] == ["joined", "joined", "died", "died"]


def test_newer_epoch_is_a_restart_and_old_epoch_packets_are_ignored() -> None:
    m, events = membership()
    m.heard_from("bob", 1, "mem://bob", now=0.0)
    m.heard_from("bob", 2, "mem://bob2", now=1.0)
    assert events.log == [("joined", "bob"), ("died", "bob"), ("joined", "bob")]
    assert m.address_of("bob") == "mem://bob2"
    assert m.known()[0].epoch == 2
    # the old incarnation's packets neither refresh nor move the address
    m.heard_from("bob", 1, "mem://bob", now=3.5)
    assert m.address_of("bob") == "mem://bob2"
    assert m.expire(1.0 + TIMEOUT_S + 1e-6) == ["bob"]


def test_leave_removes_at_once_and_late_packets_stay_out() -> None:
    m, events = membership()
    m.heard_from("bob", 4, "mem://bob", now=0.0)
    m.left("bob", 4)
    assert m.alive() == ["me"]
    assert m.known() == []
    assert m.address_of("bob") is None
    assert events.log == [("joined", "bob"), ("left", "bob")]
    m.heard_from("bob", 4, "mem://bob", now=0.1)  # in flight when it left
    assert m.learned("bob", "mem://bob", 0.0) is False  # someone's stale view
    assert m.alive() == ["me"]
    m.heard_from("bob", 5, "mem://bob", now=1.0)  # a new incarnation may come back
    assert m.alive() == ["bob", "me"]
    assert events.log[-1] == ("joined", "bob")


def test_a_peer_learned_but_not_yet_heard_is_probed_before_it_is_pruned() -> None:
    """A peer named by a view or an undirected HELLO is kept (and probed) for the prune
    period counted from when we learned of it.  Before, it counted from -inf: the next
    heartbeat pruned it and closed the socket just opened to it, so a peer that
    HELLOed a solo peer was never answered (join then failed: 8 of 12 tries)."""
    m, _ = membership()
    assert m.learned("bob", "mem://bob", 100.0) is True
    assert m.prune(100.5, 10.0) == []
    assert [p.peer_id for p in m.known()] == ["bob"]
    assert [p.address for p in m.prune(111.0, 10.0)] == ["mem://bob"]  # never answered
    assert m.known() == []


def test_leave_of_a_peer_never_alive_emits_nothing() -> None:
    m, events = membership()
    m.learned("bob", "mem://bob", 0.0)
    version = m.version
    m.left("bob", 1)
    assert m.known() == []
    assert events.log == []
    assert m.version == version


def test_a_failing_callback_does_not_stop_the_others() -> None:
    m, events = membership()

    def broken(event: str, peer: str) -> None:
        raise RuntimeError("boom")

    m.on_change(broken)
    later = Events()
    m.on_change(later)
    m.heard_from("bob", 1, "mem://bob", now=0.0)
    assert events.log == later.log == [("joined", "bob")]
    m.off_change(later)
    m.off_change(later)  # idempotent
    m.left("bob", 1)
    assert later.log == [("joined", "bob")]


# --------------------------------------------------------------------------- nodes
def record(nodes: list[Node], clock: FakeClock) -> dict[str, list[tuple[float, str, str]]]:
    """Per node: ``(virtual time, event, peer)`` of every membership change."""
    log: dict[str, list[tuple[float, str, str]]] = collections.defaultdict(list)
    for node in nodes:

        def cb(event: str, peer: str, me: str = node.peer_id) -> None:
            log[me].append((clock.now(), event, peer))

        node.on_membership(cb)
    return log


@pytest.mark.timeout(10)
def test_nodes_discover_each_other_from_a_full_bootstrap_list(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(5, config=fast_config, clock=clock) as nodes:
            ids = [f"p{i}" for i in range(5)]
            for node in nodes:
                assert node.alive_peers() == ids
                assert node.codec.rejects.get("mac", 0) == 0
            # discovery took a few heartbeats, not a failure timeout
            assert clock.now() < fast_config.failure_timeout_s

    run_async(main())


@pytest.mark.timeout(10)
def test_nodes_discover_each_other_transitively(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config
) -> None:
    """A knows B, B knows C, C knows D, D knows nobody: every node ends up knowing all."""

    async def main() -> None:
        clock = FakeClock()

        def chain(i: int, addresses: list[str]) -> list[str]:
            return addresses[i + 1 : i + 2]

        async with cluster(4, config=fast_config, clock=clock, bootstrap=chain) as nodes:
            assert nodes[3].bootstrap == []
            assert nodes[0].bootstrap == ["mem://p1"]
            for node in nodes:
                assert node.alive_peers() == ["p0", "p1", "p2", "p3"]
                assert node.membership is not None
                assert {p.address for p in node.membership.known()} == {
                    f"mem://p{i}" for i in range(4)
                } - {node.address}

    run_async(main())


@pytest.mark.timeout(10)
def test_a_crashed_node_is_declared_dead_within_the_failure_timeout(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config, wait_until: Any
) -> None:
    cfg = fast_config
    crash_at = 1.0

    def plan(i: int) -> FaultPlan | None:
        # p2 becomes a black hole at plan time 1.0 s (its process keeps running)
        return FaultPlan(seed=1, crash=(Crash(peer="mem://p2", at_s=crash_at),)) if i == 2 else None

    async def main() -> None:
        clock = FakeClock()
        async with cluster(4, config=cfg, clock=clock, faults=plan) as nodes:
            log = record(nodes, clock)
            survivors = [nodes[0], nodes[1], nodes[3]]
            assert clock.now() < crash_at
            await wait_until(
                lambda: all("p2" not in n.alive_peers() for n in survivors),
                crash_at + 3 * cfg.failure_timeout_s,
                clock=clock,
                what="p2 declared dead",
            )
            for node in survivors:
                deaths = [(t, p) for t, e, p in log[node.peer_id] if e == "died"]
                assert len(deaths) == 1
                t_dead, peer = deaths[0]
                assert peer == "p2"
                # not before it went silent for the timeout (minus the beat it may have missed)
                assert t_dead - crash_at >= cfg.failure_timeout_s - cfg.heartbeat_interval_s
                # and no later than the timeout plus one heartbeat (plus one test step)
                assert t_dead - crash_at <= cfg.failure_timeout_s + cfg.heartbeat_interval_s + 0.01
                assert node.alive_peers() == ["p0", "p1", "p3"]
            # Survivors keep gossiping views for a while: p2 stays dead, nobody else dies.
            t_end = clock.now() + 4 * cfg.failure_timeout_s
            await wait_until(lambda: clock.now() >= t_end, 10.0, clock=clock)
            for node in survivors:
                assert node.alive_peers() == ["p0", "p1", "p3"]
                assert [e for _, e, _ in log[node.peer_id]] == ["died"]

    run_async(main())


@pytest.mark.timeout(10)
def test_a_heartbeat_after_our_own_stall_declares_nobody_dead(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config
) -> None:
    """The freeze bug: a SIGSTOPped peer's first beat after SIGCONT saw every peer
    silent past the timeout (their packets still unread in its sockets), declared
    them all dead and trained alone until it read them."""
    cfg = fast_config

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            me = nodes[0]
            assert me.membership is not None
            now = clock.now()
            stall = 4 * cfg.failure_timeout_s
            for info in me.membership.known():
                info.last_seen = now - stall  # nothing read while we were stopped
            me.members._due = now - stall + cfg.heartbeat_interval_s
            me.members._beat()
            assert me.alive_peers() == ["p0", "p1", "p2"]
            assert me.stats()["loop_stalls"]["count"] == 1
            assert me.stats()["loop_stalls"]["seconds"] >= stall - cfg.heartbeat_interval_s
            # the same silence without a stall of ours is theirs: both die
            for info in me.membership.known():
                info.last_seen = now - stall
            me.members._due = now
            me.members._beat()
            assert me.alive_peers() == ["p0"]
            assert me.stats()["loop_stalls"]["count"] == 1

    run_async(main())


@pytest.mark.timeout(10)
def test_a_crashed_node_that_comes_back_rejoins(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config, wait_until: Any
) -> None:
    crash = Crash(peer="mem://p1", at_s=0.5, until_s=2.0)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(
            3, config=fast_config, clock=clock, faults=FaultPlan(seed=2, crash=(crash,))
        ) as nodes:
            await wait_until(lambda: "p1" not in nodes[0].alive_peers(), 2.0, clock=clock)
            assert clock.now() < 2.0
            await wait_until(
                lambda: all(len(n.alive_peers()) == 3 for n in nodes), 2.0, clock=clock
            )
            assert clock.now() >= 2.0

    run_async(main())


def record_forgets(node: Node) -> list[str]:
    """The addresses ``node`` asks its transport to forget, in order (it still forgets)."""
    assert node.transport is not None
    forget, log = node.transport.forget, []

    def recording(dst: str) -> None:
        log.append(dst)
        forget(dst)

    node.transport.forget = recording  # type: ignore[method-assign]
    return log


@pytest.mark.timeout(10)
def test_a_closed_transport_without_announce_is_declared_dead(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config, wait_until: Any
) -> None:
    cfg = fast_config

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            forgotten = [record_forgets(node) for node in nodes[:2]]
            await nodes[2].close(announce=False)
            took = await wait_until(
                lambda: all(n.alive_peers() == ["p0", "p1"] for n in nodes[:2]),
                3 * cfg.failure_timeout_s,
                clock=clock,
            )
            assert cfg.failure_timeout_s - cfg.heartbeat_interval_s <= took
            assert took <= cfg.failure_timeout_s + cfg.heartbeat_interval_s + 0.01
            # the dead peer's sockets are closed at once: a send after a restart redials
            assert forgotten == [["mem://p2"], ["mem://p2"]]

    run_async(main())


@pytest.mark.timeout(10)
def test_close_with_announce_removes_the_peer_at_once(
    run_async: Callable[..., Any],
    cluster: Any,
    fast_config: Config,
    wait_until: Any,
    drive: Any,
) -> None:
    cfg = fast_config

    async def main() -> None:
        clock = FakeClock()
        async with cluster(4, config=cfg, clock=clock) as nodes:
            log = record(nodes, clock)
            t0 = clock.now()
            await drive(clock, nodes[3].close(announce=True))
            assert nodes[3].closed
            took = await wait_until(
                lambda: all(n.alive_peers() == ["p0", "p1", "p2"] for n in nodes[:3]),
                cfg.failure_timeout_s,
                clock=clock,
            )
            # LEAVE is acknowledged, not waited out: well before one heartbeat
            assert clock.now() - t0 < cfg.heartbeat_interval_s
            assert took < cfg.heartbeat_interval_s
            for node in nodes[:3]:
                assert log[node.peer_id] == [(t0, "left", "p3")]
            # other peers' views, still naming p3 for a moment, never bring it back
            t_end = clock.now() + 3 * cfg.failure_timeout_s
            await wait_until(lambda: clock.now() >= t_end, 10.0, clock=clock)
            for node in nodes[:3]:
                assert node.alive_peers() == ["p0", "p1", "p2"]
                assert [e for _, e, _ in log[node.peer_id]] == ["left"]
            with pytest.raises(ClosedError):
                await nodes[3].send_reliable("p0", TEST_KIND)

    run_async(main())


class Counting:
    """Counts packets of ``TEST_KIND`` a node's codec accepts, and handler calls."""

    def __init__(self, node: Node) -> None:
        self.arrivals = 0
        self.handled: collections.Counter[int] = collections.Counter()
        decode = node.codec.decode

        def counting_decode(frames: Any, *, local: bool = False) -> Packet | None:
            pkt = decode(frames, local=local)
            if pkt is not None and pkt.kind == TEST_KIND:
                self.arrivals += 1
            return pkt

        node.codec.decode = counting_decode  # type: ignore[method-assign]
        node.subscribe(TEST_KIND, self.on_packet)

    def on_packet(self, pkt: Packet) -> None:
        self.handled[pkt.fields["i"]] += 1


@pytest.mark.timeout(10)
def test_send_reliable_gets_through_a_lossy_link_and_acts_once(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config, drive: Any
) -> None:
    requests = 20

    async def main() -> None:
        clock = FakeClock()
        async with cluster(
            2, config=fast_config, clock=clock, faults=FaultPlan(loss=0.5, seed=3)
        ) as nodes:
            sender, receiver = nodes
            counting = Counting(receiver)
            results = []
            for i in range(requests):
                results.append(
                    await drive(
                        clock, sender.send_reliable("p1", TEST_KIND, {"i": i}, timeout_s=20.0)
                    )
                )
            await drive(clock, _idle())
            assert results == [True] * requests
            # each request acted on exactly once ...
            assert counting.handled == dict.fromkeys(range(requests), 1)
            # ... although retries (lost ACKs) delivered many requests more than once
            assert counting.arrivals > requests
            faults = sender.stats()["faults"]
            assert faults["dropped_loss"] > 0

    run_async(main())


async def _idle() -> None:
    """Nothing: lets ``drive`` settle in-flight packets."""


@pytest.mark.timeout(10)
def test_send_reliable_to_a_dead_peer_returns_false_at_its_deadline(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config, drive: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=fast_config, clock=clock) as nodes:
            counting = Counting(nodes[1])
            await nodes[1].close(announce=False)
            t0 = clock.now()
            ok = await drive(
                clock, nodes[0].send_reliable("p1", TEST_KIND, {"i": 0}, timeout_s=0.8)
            )
            took = clock.now() - t0
            assert ok is False
            assert 0.8 <= took <= 0.8 + 0.01
            assert counting.arrivals == 0
            # a peer nobody ever heard of: no address to send to, same deadline
            t0 = clock.now()
            ok = await drive(clock, nodes[0].send_reliable("nobody", TEST_KIND, timeout_s=0.3))
            assert ok is False
            assert 0.3 <= clock.now() - t0 <= 0.31

    run_async(main())


@pytest.mark.timeout(10)
def test_send_reliable_ignores_acks_from_the_wrong_peer(
    run_async: Callable[..., Any], cluster: Any, fast_config: Config, drive: Any
) -> None:
    """An ACK for our request id from a third peer must not complete the request."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=fast_config, clock=clock) as nodes:
            a, b, c = nodes
            await b.close(announce=False)
            task = asyncio.ensure_future(a.send_reliable("p1", TEST_KIND, timeout_s=0.5))
            await drive(clock, _idle())
            rid = a.reliable.next_rid - 1
            c.send("p0", NodeKind.ACK, {"ak": rid})  # with a's request id, from c
            assert await drive(clock, task) is False

    run_async(main())
