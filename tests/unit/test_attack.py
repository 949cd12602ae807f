"""One packet (or a replay) from an insider or an on-path attacker must not break a peer.

Each test plays one attack against nodes on a MemoryNetwork under a FakeClock.
Forged packets are built from the format's definition (as ``test_wire.py`` does)
and signed by "mallory", a member holding the run secret and its own key pair,
bound at the victim as an introduction would bind it (:class:`Mallory`): what any
key holder can send.  A captured packet is replayed by handing its bytes to a
node's receive path, as an on-path attacker without the key would.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossipnet import Config, FakeClock
from gossipnet.collectives.statesync.kinds import StateKind
from gossipnet.collectives.statesync.sync import StateSync
from gossipnet.runtime.kinds import NodeKind
from gossipnet.transport.wire import WireCodec

SECRET = b"test-secret"  # the cluster fixture's
NET = {"heartbeat_interval_s": 0.1, "failure_timeout_s": 0.6, "control_timeout_s": 1.0}
CHUNK = 1024


def run_key() -> bytes:
    return hmac.new(SECRET, b"gossipnet/v1/gossipnet", hashlib.sha256).digest()


def tag(peer_id: str) -> bytes:
    """A destination tag, from the format's definition."""
    return hashlib.blake2b(
        peer_id.encode(), key=run_key(), digest_size=4, person=b"gossipnet-dst"
    ).digest()


class Mallory:
    """A member with the secret and its own key, bound at ``victim`` (both ways).

    :meth:`forge` signs any header it likes under the pair key mallory -> victim:
    the victim authenticates it as mallory's, whatever the header claims.
    """

    def __init__(self, victim: Any, name: str = "mallory") -> None:
        self.codec = WireCodec(SECRET, victim.config, name, clock=FakeClock())
        self.name, self.epoch = name, self.codec.epoch
        victim.codec.bind(name, self.epoch, self.codec.identity.public)
        self.codec.bind(victim.peer_id, victim.codec.epoch, victim.codec.identity.public)
        self.session = self.codec.keys.by_id[victim.peer_id]

    def forge(
        self,
        kind: int,
        fields: dict[str, Any],
        *,
        src: str | None = None,
        epoch: int | None = None,
        seq: int = 0,
        to: str | None = None,
        payload: bytes = b"",
    ) -> list[memoryview]:
        """A packet signed under mallory's pair key with any header we like."""
        head: dict[str, Any] = {
            "v": 3, "run": "gossipnet", "src": src or self.name,
            "e": self.epoch if epoch is None else epoch, "q": seq,
        }  # fmt: skip
        head.update(k=int(kind), **fields)
        if to is not None:
            head["@"] = tag(to)
        raw = msgpack.packb(head)
        mac = self.session.send.sign(raw, payload) + self.codec.identity.key_id
        return [memoryview(raw), memoryview(payload), memoryview(mac)]


def intro(head: dict[str, Any], payload: bytes = b"") -> list[memoryview]:
    """A packet signed with the run key (an introduction's signature), any header."""
    raw = msgpack.packb(head)
    nonce = os.urandom(12)
    mac = AESGCM(run_key()).encrypt(nonce, b"", len(raw).to_bytes(4, "big") + raw + payload)
    fp = hashlib.blake2b(b"fingerprint", key=run_key(), digest_size=8).digest()
    return [memoryview(raw), memoryview(payload), memoryview(mac + nonce + fp)]


def tap(node: Any) -> list[tuple[str, list[bytes]]]:
    """Record (address, frames) of every packet ``node`` sends, as an on-path observer."""
    seen: list[tuple[str, list[bytes]]] = []
    send = node.transport.send

    def recording(address: str, frames: Any, **kw: Any) -> bool:
        seen.append((address, [bytes(f) for f in frames]))
        return bool(send(address, frames, **kw))

    node.transport.send = recording
    return seen


def replay(node: Any, frames: list[bytes]) -> None:
    node._on_frames([memoryview(f) for f in frames])


# ---------------------------------------------------------------------- round numbers
@pytest.mark.timeout(30)
def test_huge_beacon_neither_reaches_engines_nor_kills_the_heartbeat(
    run_async: Callable[..., Any], cluster: Any, drive: Any, wait_until: Any
) -> None:
    """A heartbeat with ar = 2**64-1 killed the heartbeat task (msgpack overflow on the
    next beat) and spread: it is a counted drop, and a bad beacon of our own is withheld
    (counted) while the task and our liveness at the others go on."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET), clock=clock) as (a, b):
            heard: list[dict[str, Any]] = []
            b.on_heartbeat(lambda pkt: heard.append(dict(pkt.fields)))
            forged = {"addr": "mem://mallory", "ar": 2**64 - 1}
            b._on_frames(Mallory(b).forge(NodeKind.HEARTBEAT, forged, to="p1"))
            assert b.codec.rejects["beacon_range"] == 1
            assert all(f.get("ar", 0) < 2**62 for f in heard)
            a.beacon["ar"] = 2**64  # what an engine that took the forged round would set
            t0 = clock.now()
            await drive(clock, clock.sleep(5 * a.config.failure_timeout_s))
            assert a.heartbeat_errors["beacon_range"] >= 10  # every beat, none fatal
            assert any(t.get_name().endswith(":heartbeat") and not t.done() for t in a._tasks)
            assert b.membership.is_alive("p0"), "p0's heartbeats stopped"
            assert clock.now() - t0 >= 5 * a.config.failure_timeout_s

    run_async(main())


# ---------------------------------------------------------------------- future epochs
@pytest.mark.timeout(30)
def test_epoch_from_the_future_cannot_lock_a_peer_out(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    """A heartbeat claiming p0's id with epoch 2**63 made p1 drop p0 as stale_epoch
    and declare it dead: a member cannot speak as p0 (``impersonation``), and its
    own packets carry its own incarnation only (``epoch_mismatch``); an epoch past
    int64 is malformed."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET), clock=clock) as (a, b):
            mallory = Mallory(b)
            for epoch in (2**63 - 1, 2**63, time.time_ns() + 3_600 * 10**9):
                for src in ("p0", "mallory"):
                    beat = mallory.forge(
                        NodeKind.HEARTBEAT, {"addr": a.address}, src=src, epoch=epoch, to="p1"
                    )
                    b._on_frames(beat)
            assert b.codec.rejects["impersonation"] == 2
            assert b.codec.rejects["epoch_mismatch"] == 2
            assert b.codec.rejects["header_fields"] == 2
            await drive(clock, clock.sleep(5 * a.config.failure_timeout_s))
            assert b.membership.is_alive("p0")
            assert b.codec.rejects["stale_epoch"] == 0

    run_async(main())


# ---------------------------------------------------------------------- replays
@pytest.mark.timeout(30)
def test_replayed_packets_of_a_killed_peer_do_not_keep_it_alive(
    run_async: Callable[..., Any], cluster: Any, drive: Any, wait_until: Any
) -> None:
    """An on-path attacker without the key replays p0's packets after p0 is killed:
    those it sent to p1 carry no tag under p0's key for p2 (``mac``), and those to p2
    it withheld arrive late, behind newer ones (not fresh): none refreshes p0's
    liveness."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=Config(**NET), clock=clock) as (a, _b, c):
            seen = tap(a)
            await drive(clock, clock.sleep(1.0))
            withheld: list[list[bytes]] = []
            deliver = a.transport.send

            def withhold(address: str, frames: Any, **kw: Any) -> bool:
                if address == c.address and len(withheld) < 12:
                    withheld.append([bytes(f) for f in frames])
                    return True
                return bool(deliver(address, frames, **kw))

            a.transport.send = withhold
            await drive(clock, clock.sleep(1.5))  # withheld, then newer ones delivered
            assert len(withheld) == 12
            await a.close(announce=False)  # SIGKILLed: no goodbye
            to_b = [f for addr, f in seen if addr == "mem://p1"]
            assert len(to_b) >= 12
            for frames in [*to_b, *withheld]:  # one packet every 0.1 s for > 2 s
                replay(c, frames)
                await drive(clock, clock.sleep(0.1))
            assert not c.membership.is_alive("p0"), "replays kept a killed peer alive"
            assert c.codec.rejects["mac"] >= 12

    run_async(main())


@pytest.mark.timeout(30)
def test_own_packets_reflected_back_are_counted_rejects(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET), clock=clock) as (a, _b):
            seen = tap(a)
            await drive(clock, clock.sleep(0.5))
            accepted = a.codec.accepted
            for _, frames in seen:
                replay(a, frames)
            assert a.codec.rejects["own_packet"] == len(seen) > 0
            assert a.codec.accepted == accepted

    run_async(main())


# ---------------------------------------------------------------------- state sync
def _evil_manifest_server(node: Any, fields: dict[str, Any], body: Any) -> None:
    def answer(pkt: Any) -> None:
        if pkt.fields.get("op") == "man":
            head = {"op": "man", "x": pkt.fields["x"], "sid": "s1", "cb": CHUNK, **fields}
            node.send(pkt.src, StateKind.DATA, head, msgpack.packb(body))

    node.subscribe(StateKind.REQ, answer)


GOOD_BODY = {"d": bytes(16), "w": bytes(32), "m": {}}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("fields", "body"),
    [
        ({"sz": 2**40}, GOOD_BODY),  # was MemoryError
        ({"sz": "12"}, GOOD_BODY),  # was TypeError
        ({"sz": -1}, GOOD_BODY),  # was ValueError
        ({"sz": 1.5}, GOOD_BODY),  # was TypeError
        ({"sz": 10, "cb": 0}, GOOD_BODY),
        ({"sz": 10 * CHUNK}, GOOD_BODY),  # one digest for ten chunks
        ({"sz": 10}, {"d": bytes(16), "w": "not bytes", "m": {}}),
        ({"sz": 10}, [1, 2]),
    ],
)
def test_bad_manifests_fail_the_download_with_a_counted_reject(
    run_async: Callable[..., Any], cluster: Any, drive: Any, fields: dict[str, Any], body: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET, chunk_bytes=CHUNK), clock=clock) as (a, b):
            _evil_manifest_server(a, fields, body)
            sync = StateSync(b)
            got, rep = await drive(clock, sync.download(sources=["p0"], timeout_s=2.0))
            assert got is None
            assert not rep.ok
            assert sync.rejects["manifest"] >= 1

    run_async(main())


@pytest.mark.timeout(30)
def test_a_manifest_from_another_peer_than_asked_is_dropped(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    """p2 (a key holder that learned the transfer id) answers p1's request to p0 first:
    its manifest is dropped, and p1 downloads p0's state from p0 at the first try."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=Config(**NET, chunk_bytes=CHUNK), clock=clock) as nodes:
            a, b, m = nodes
            data = os.urandom(20 * CHUNK)
            StateSync(a).publish(data)
            serve = a.io.subscribers[StateKind.REQ]
            first = [True]

            def gate(pkt: Any) -> None:
                if pkt.fields.get("op") == "man" and first[0]:
                    first[0] = False  # p0 misses this request; p2 answers it
                    head = {"op": "man", "x": pkt.fields["x"], "sid": "evil", "sz": len(data)}
                    body = {"d": bytes(16 * 20), "w": bytes(32), "m": {}}
                    m.send("p1", StateKind.DATA, dict(head, cb=CHUNK), msgpack.packb(body))
                    return
                serve(pkt)

            a.subscribe(StateKind.REQ, gate)
            sync = StateSync(b)
            got, rep = await drive(clock, sync.download(sources=["p0"], timeout_s=5.0))
            assert got == data
            assert rep.sources_tried == ("p0",)
            assert rep.chunks_corrupt == 0
            assert sync.rejects["foreign_reply"] == 1

    run_async(main())


@pytest.mark.timeout(30)
def test_manifest_is_cross_checked_against_a_second_donor(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=Config(**NET, chunk_bytes=CHUNK), clock=clock) as nodes:
            donors = [StateSync(n) for n in nodes[:2]]
            data = os.urandom(8 * CHUNK)
            for d in donors:
                d.publish(data)
            sync = StateSync(nodes[2])
            got, rep = await drive(clock, sync.download(timeout_s=5.0))
            assert got == data
            assert (rep.source, rep.second_donor, rep.donors_agree) == ("p0", "p1", True)
            donors[1].publish(os.urandom(8 * CHUNK))  # p1 disagrees (a step ahead, or lying)
            got, rep = await drive(clock, sync.download(timeout_s=5.0))
            assert got == data  # reported, not fatal: honest replicas differ by a step
            assert (rep.source, rep.second_donor, rep.donors_agree) == ("p0", "p1", False)

    run_async(main())


# ---------------------------------------------------------------------- decoder fuzz
_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_VALUE = st.one_of(
    _INT, st.sampled_from([0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1]),
    st.text(max_size=8), st.binary(max_size=12), st.none(), st.booleans(), st.floats(),
    st.lists(_INT, max_size=3),
)  # fmt: skip
_IDS = st.sampled_from(["rx", "x", "y", ""])
_EPOCHS = st.one_of(_VALUE, st.just("same"))  # "same": the signer's own incarnation


@settings(derandomize=True, database=None, deadline=None, max_examples=300,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    src=st.one_of(_IDS, _VALUE),
    epoch=_EPOCHS,
    seq=_VALUE,
    kind=st.one_of(_VALUE, st.just(1)),
    to=st.one_of(st.none(), _IDS, st.lists(_IDS, max_size=3), _VALUE),
    extra=st.dictionaries(st.sampled_from(["dt", "n", "r", "ar", "rq"]), _VALUE, max_size=3),
    pairwise=st.booleans(),
)
def test_decoder_fuzz_authenticated_headers_stay_in_range(
    src: Any, epoch: Any, seq: Any, kind: Any, to: Any, extra: dict[str, Any], pairwise: bool
) -> None:
    """Any header a key holder can sign, under its pair key or as an introduction:
    decode never raises, and what it accepts has every codec-owned field typed and
    in range, is not ours, comes under the key of the id it names (pairwise) or is
    an introduction kind (run key), and only a pairwise packet is directed."""
    rx = WireCodec(SECRET, Config(), "rx", clock=FakeClock(), intro_kinds=frozenset({1}))
    x = WireCodec(SECRET, Config(), "x", clock=FakeClock())
    rx.bind("x", x.epoch, x.identity.public)
    x.bind("rx", rx.epoch, rx.identity.public)
    if epoch == "same":
        epoch = x.epoch
    head: dict[str, Any] = {"v": 3, "run": "gossipnet", "src": src, "e": epoch, "q": seq}
    head.update(k=kind, **extra)
    if isinstance(to, str):
        head["@"] = tag(to)
    elif isinstance(to, list):
        head["@"] = b"".join(tag(p) for p in to if isinstance(p, str))
    elif to is not None:
        head["@"] = to
    raw = msgpack.packb(head)
    if pairwise:
        frames = [raw, b"", x.keys.by_id["rx"].send.sign(raw, b"") + x.identity.key_id]
    else:
        frames = [bytes(f) for f in intro(head)]
    pkt = rx.decode(frames)
    assert "internal" not in rx.rejects
    if pkt is None:
        assert sum(rx.rejects.values()) == 1
        return
    limit = time.time_ns() + int(getattr(rx.config, "max_clock_skew_s", 60) * 1e9)
    assert type(pkt.epoch) is int
    assert 0 <= pkt.epoch <= min(limit, 2**63 - 1)
    assert type(pkt.seq) is int
    assert 0 <= pkt.seq < 2**63
    assert type(pkt.kind) is int
    assert 0 <= pkt.kind <= 0xFFFF
    assert isinstance(pkt.src, str)
    assert pkt.src not in ("", "rx")
    assert pkt.directed == pairwise
    if pairwise:
        assert (pkt.src, pkt.epoch) == ("x", x.epoch)
        assert rx.decode(frames) is None  # and never twice
    else:
        assert pkt.kind == 1
        assert not pkt.fresh


@pytest.mark.timeout(30)
def test_a_chunk_longer_than_its_manifest_says_is_corrupt(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    """A donor whose digests match chunks of twice the announced size: such a chunk
    would have grown the download buffer; it is refused as corrupt."""
    import hashlib as _h

    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET, chunk_bytes=CHUNK), clock=clock) as (a, b):
            big = [os.urandom(2 * CHUNK) for _ in range(4)]
            digests = b"".join(_h.blake2b(x, digest_size=16).digest() for x in big)

            def answer(pkt: Any) -> None:
                op, x = pkt.fields.get("op"), pkt.fields.get("x")
                if op == "man":
                    head = {"op": "man", "x": x, "sid": "s1", "sz": 4 * CHUNK, "cb": CHUNK}
                    body = {"d": digests, "w": bytes(32), "m": {}}
                    a.send(pkt.src, StateKind.DATA, head, msgpack.packb(body))
                elif op == "get":
                    for c in range(4):
                        head = {"op": "chunk", "x": x, "sid": "s1", "c": c, "dt": "u8"}
                        a.send(pkt.src, StateKind.DATA, dict(head, n=2 * CHUNK), big[c])

            a.subscribe(StateKind.REQ, answer)
            sync = StateSync(b)
            got, rep = await drive(clock, sync.download(sources=["p0"], timeout_s=2.0))
            assert got is None
            assert rep.chunks_corrupt >= 4

    run_async(main())


@pytest.mark.timeout(60)
def test_membership_fuzz_no_forged_control_packet_breaks_the_node(
    run_async: Callable[..., Any], cluster: Any, drive: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """500 seeded, validly signed control packets with hostile field values (huge and
    negative ints, wrong types, garbage views) to p1, whose heartbeat listener adopts
    the highest round it hears as an engine does: no handler raises, p1's heartbeats
    go on (p0 still sees it alive), and p0 stays alive at p1."""
    import logging
    import random

    rng = random.Random(19)
    values: list[Any] = [2**64 - 1, 2**63, 2**62, -1, -(2**63), True, None, 1.5, "x" * 50,
                         b"\x00" * 8, [1, 2**64 - 1], {"a": 1}]  # fmt: skip
    kinds = [NodeKind.HELLO, NodeKind.HELLO_ACK, NodeKind.HEARTBEAT, NodeKind.LEAVE, NodeKind.ACK]
    keys = ["addr", "rq", "ak", "ar", "r", "mpt", "rv"]

    def view() -> bytes:
        entry = [rng.choice(["p0", "p1", "zed", ""]), rng.choice([*values, "mem://zed"])]
        return msgpack.packb(rng.choice([[entry], [entry] * 3, entry, 7, [[1, 2]]]))

    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET), clock=clock) as (a, b):

            def adopt(pkt: Any) -> None:  # an engine catching up to the others' round
                ar = pkt.fields.get("ar")
                if type(ar) is int:
                    b.beacon["ar"] = max(b.beacon.get("ar", 0), ar + 1)

            b.on_heartbeat(adopt)
            mallory = Mallory(b)
            for i in range(500):
                fields = {k: rng.choice(values) for k in rng.sample(keys, rng.randrange(4))}
                src = rng.choice(["mallory", "p0", "zed"])
                to = rng.choice(["p1", None])
                body = view() if rng.random() < 0.5 else rng.randbytes(9)
                kind = rng.choice(kinds)
                if rng.random() < 0.5:  # under mallory's own key
                    frames = mallory.forge(kind, fields, src=src, seq=i, to=to, payload=body)
                else:  # as an introduction, under any name
                    head = {"v": 3, "run": "gossipnet", "src": src, "e": 7 + i, "q": 0, "k": kind}
                    frames = intro({**head, **fields}, body)
                b._on_frames(frames)
                if i % 50 == 0:
                    await drive(clock, clock.sleep(0.05))
            await drive(clock, clock.sleep(3 * a.config.failure_timeout_s))
            assert a.membership.is_alive("p1"), "p1's heartbeats stopped"
            assert getattr(b, "heartbeat_errors", {}).get("exception", 0) == 0
            assert "internal" not in b.codec.rejects
            assert b.membership.is_alive("p0")
            assert b.beacon.get("ar", 0) < 2**62
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert not errors, errors[0].getMessage()

    run_async(main())
