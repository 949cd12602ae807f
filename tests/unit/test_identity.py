"""Per-peer identity: a member holding the secret speaks only for itself.

Played against nodes on a MemoryNetwork under a FakeClock.  "mallory" is a
member: it holds the run secret and introduces itself with its own key pair, as
any peer of the run can.  Each test is one attack of the security review; each
passed on the shared-key wire (any key holder could sign as any peer).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from gossipnet import Config, FakeClock
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import MAX_UNVERIFIED
from gossipnet.testing import MemoryNetwork, MemoryTransport, start_node
from gossipnet.testing.cluster import TEST_SECRET
from gossipnet.transport.wire import WireCodec

NET = {"heartbeat_interval_s": 0.1, "failure_timeout_s": 0.6, "control_timeout_s": 1.0}


class Member:
    """A raw member on the memory network: its own codec (own key), its own socket."""

    def __init__(self, network: MemoryNetwork, name: str, config: Config) -> None:
        self.codec = WireCodec(
            TEST_SECRET, config, name, clock=FakeClock(), intro_kinds=frozenset({NodeKind.HELLO})
        )
        self.address = f"mem://{name}"
        self.transport = MemoryTransport(network, self.address)
        self.inbox: list[Any] = []

    async def start(self) -> None:
        await self.transport.start(self._receive)

    def _receive(self, frames: Any) -> None:
        pkt = self.codec.decode(frames)
        if pkt is None:
            return
        self.inbox.append(pkt)
        if pkt.kind == NodeKind.HELLO and isinstance(pkt.fields.get("pk"), bytes):
            with contextlib.suppress(ValueError):  # bind whoever introduces itself
                self.codec.bind(pkt.src, pkt.epoch, pkt.fields["pk"])

    def introduce(self, to: str, *, as_id: str | None = None, addr: str | None = None) -> None:
        """Send our introduction (our public key) to address ``to``."""
        codec = self.codec if as_id is None else self._alias(as_id)
        fields = {"addr": addr or self.address, "pk": codec.identity.public, "re": False}
        self.transport.send(to, codec.encode(NodeKind.HELLO, fields, intro=True))

    def _alias(self, as_id: str) -> WireCodec:
        """A second codec (another key) under another name: a made-up id of ours."""
        alias = WireCodec(TEST_SECRET, self.codec.config, as_id, clock=FakeClock())
        self.aliases = getattr(self, "aliases", {})
        self.aliases[as_id] = alias
        return alias

    def send(
        self, to: str, dst: str, kind: int, fields: dict[str, Any], payload: bytes = b""
    ) -> None:
        self.transport.send(to, self.codec.encode(kind, fields, payload, dst=dst))


async def admitted(network: MemoryNetwork, victim: Any, clock: FakeClock, drive: Any) -> Member:
    """Mallory started on ``network`` and introduced to ``victim`` (bound there as itself)."""
    mallory = Member(network, "mallory", victim.config)
    await mallory.start()
    mallory.introduce(victim.address)
    await drive(clock, clock.sleep(0.3))
    return mallory


@pytest.mark.timeout(30)
def test_a_member_cannot_send_heartbeats_or_views_as_another_peer(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    """Finding 1/3: heartbeats under made-up or others' ids, each with its own addr,
    made the ids alive members and redirected p0's traffic.  Now mallory's packets
    count only as mallory's: claiming p0 is ``impersonation``; p0's address at p1
    stays p0's; made-up ids never become alive without their own key."""

    async def main() -> None:
        clock = FakeClock()
        network = MemoryNetwork()
        async with cluster(2, config=Config(**NET), clock=clock, network=network) as (a, b):
            mallory = await admitted(network, b, clock, drive)
            assert "mallory" in b.codec.keys.by_id  # admitted as itself
            # heartbeats claiming p0 (with mallory's address) and made-up ids
            for claimed in ("p0", "ghost1", "ghost2"):
                beat = {"addr": mallory.address, "ar": 10**9}
                frames = mallory.codec.encode(NodeKind.HEARTBEAT, beat, dst="p1")
                head = msgpack.unpackb(frames[0])
                head["src"] = claimed  # re-signed under mallory's own pair key
                raw = msgpack.packb(head)
                session = mallory.codec.keys.by_id["p1"]
                mac = session.send.sign(raw, b"") + mallory.codec.identity.key_id
                mallory.transport.send(b.address, [raw, b"", mac])
            await drive(clock, clock.sleep(2 * b.config.failure_timeout_s))
            assert b.codec.rejects["impersonation"] == 3
            assert b.membership.address_of("p0") == a.address
            assert not b.membership.is_alive("ghost1")
            assert not b.membership.is_alive("ghost2")
            assert b.membership.is_alive("p0")

    run_async(main())


@pytest.mark.timeout(30)
def test_an_introduction_under_a_live_peers_name_is_refused_and_reported(
    run_async: Callable[..., Any], cluster: Any, drive: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A second key claiming p0 while p0's key still speaks: refused
    (``identity_conflict``, a warning), p0 keeps its key, address and liveness."""

    async def main() -> None:
        clock = FakeClock()
        network = MemoryNetwork()
        async with cluster(2, config=Config(**NET), clock=clock, network=network) as (a, b):
            mallory = Member(network, "mallory", b.config)
            await mallory.start()
            bound = b.codec.keys.by_id["p0"].public
            for _ in range(5):
                mallory.introduce(b.address, as_id="p0")
                await drive(clock, clock.sleep(0.2))
            assert b.members.admission is not None
            assert b.members.admission.counts["identity_conflict"] >= 5
            assert b.codec.keys.by_id["p0"].public == bound
            assert b.membership.address_of("p0") == a.address
            assert b.membership.is_alive("p0")
            assert any("claims peer id 'p0'" in r.getMessage() for r in caplog.records)

    run_async(main())


@pytest.mark.timeout(30)
def test_a_restarted_peer_is_bound_to_its_new_key_once_its_old_life_is_silent(
    run_async: Callable[..., Any], drive: Any, wait_until: Any
) -> None:
    """A crash-restart under the same id (new process, new key, newer epoch): refused
    while the old key is alive, bound once the old life has been silent for the
    failure timeout, and alive again."""

    async def main() -> None:
        clock = FakeClock()
        network = MemoryNetwork()
        cfg = Config(**NET)
        a = await start_node(network, "p0", config=cfg, clock=clock)
        b = await start_node(network, "p1", config=cfg, clock=clock, bootstrap=[a.address])
        try:
            await drive(clock, b.wait_for_peers(2, 5.0))
            old = b.codec.keys.by_id["p0"].public
            await a.close(announce=False)  # killed
            a = await start_node(network, "p0", config=cfg, clock=clock, bootstrap=[b.address])
            assert a.codec.identity.public != old
            await wait_until(lambda: b.codec.keys.by_id["p0"].public != old, 10.0, clock=clock)
            await wait_until(lambda: b.membership.is_alive("p0"), 5.0, clock=clock)
            assert b.members.admission is not None
            assert b.members.admission.counts["rebound"] == 1
        finally:
            await a.close(announce=False)
            await b.close(announce=False)

    run_async(main())


@pytest.mark.timeout(60)
def test_a_flood_of_made_up_ids_is_bounded_and_a_genuine_peer_still_joins(
    run_async: Callable[..., Any], cluster: Any, drive: Any, wait_until: Any
) -> None:
    """Finding 7: views of 4,096 made-up peers a heartbeat made the victim track and
    dial them all (1,560 fds, then ``Too many open files``) and a genuine new peer
    failed to join.  Now known-but-unheard entries are capped, made-up
    introductions bind at the admission rate up to ``max_peers``, and a genuine
    peer joins during the flood."""

    async def main() -> None:
        clock = FakeClock()
        network = MemoryNetwork()
        cfg = Config(**NET, max_peers=128, admit_per_s=20.0)
        rng = random.Random(7)
        async with cluster(2, config=cfg, clock=clock, network=network) as (_a, b):
            mallory = await admitted(network, b, clock, drive)
            dialled: set[str] = set()
            real_send = b.transport.send

            def counting(address: str, frames: Any, **kw: Any) -> bool:
                dialled.add(address)
                return bool(real_send(address, frames, **kw))

            b.transport.send = counting
            newcomer = None
            for beat in range(40):  # 4 s of heartbeats naming 4,096 or 120 made-up peers
                size = 4096 if beat % 2 else 120
                view = [[f"ghost{rng.getrandbits(48)}", f"mem://g{beat}-{i}"] for i in range(size)]
                mallory.send(b.address, "p1", NodeKind.HEARTBEAT, {"addr": mallory.address},
                             msgpack.packb(view))  # fmt: skip
                for i in range(8):  # and made-up ids introduced with keys of their own
                    mallory.introduce(b.address, as_id=f"sybil{beat}-{i}")
                if beat == 20:
                    newcomer = await start_node(
                        network, "p2", config=cfg, clock=clock, bootstrap=[b.address]
                    )
                await drive(clock, clock.sleep(0.1))
            assert newcomer is not None
            try:
                await wait_until(lambda: b.membership.is_alive("p2"), 5.0, clock=clock)
                assert len(b.membership.known()) < cfg.max_peers
                assert sum(not p.verified for p in b.membership.known()) <= MAX_UNVERIFIED
                assert len(b.codec.keys) < cfg.max_peers
                assert len(dialled) < 2 * cfg.max_peers  # not one socket per made-up id
                assert b.membership.refused["learned_full"] > 0
                assert b.codec.rejects["view_parse"] == 20  # more entries than max_peers
                admission = b.members.admission
                assert admission is not None
                assert admission.counts["admit_rate"] + admission.counts["peers_full"] > 0
                assert b.membership.is_alive("p0")
            finally:
                await newcomer.close(announce=False)

    run_async(main())


@pytest.mark.timeout(30)
def test_leave_and_address_changes_come_only_from_the_peer_itself(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    """A LEAVE or an address carried by mallory's packets changes nothing about p0;
    the ACK of a request goes to the requester's known address, not to an ``addr``
    the packet names (finding 3: ACKs and replies redirected to the attacker)."""

    async def main() -> None:
        clock = FakeClock()
        network = MemoryNetwork()
        async with cluster(2, config=Config(**NET), clock=clock, network=network) as (a, b):
            mallory = await admitted(network, b, clock, drive)
            mallory.inbox.clear()
            # a data-kind packet with an addr field, and a request naming an addr
            mallory.send(b.address, "p1", 900, {"addr": "mem://elsewhere"})
            mallory.send(b.address, "p1", 900, {"addr": "mem://elsewhere", "rq": 1})
            mallory.send(b.address, "p1", NodeKind.LEAVE, {"rq": 2})
            await drive(clock, clock.sleep(0.3))
            assert b.membership.address_of("p0") == a.address
            assert b.membership.is_alive("p0")
            assert b.membership.address_of("mallory") in (mallory.address, None)
            acks = [p for p in mallory.inbox if p.kind == NodeKind.ACK]
            assert acks  # answered at mallory's own address, nowhere else

    run_async(main())
