"""Who the torch backend's ranks trust when no ``GOSSIPNET_SECRET`` is set.

Without a secret the key must not come from anything public (the run id and group
name, as ``join()``'s default does): rank 0 draws a random key and the ranks share it
through torch's store before any peer starts.  A process on the same machine that
derives the run-id key (another local user who read the addresses from the store)
must get nothing taken in, and a store that cannot carry the key must stop the start
with an error asking for ``GOSSIPNET_SECRET``.  And since receivers now keep parts for
only a window of collectives, a root that broadcasts far ahead of a slow rank must
still deliver every broadcast.

Ranks run in threads of this process, each a real peer on 127.0.0.1 found through a
shared ``HashStore``, as in ``test_torch_backend_collectives.py``.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gossipnet import Config, ConfigError, join
from gossipnet.distributed import rendezvous
from gossipnet.distributed.exchange import Exchange
from gossipnet.distributed.kinds import DistKind
from gossipnet.distributed.options import GossipnetOptions, resolve_options
from gossipnet.distributed.process_group import ProcessGroupGossipnet
from gossipnet.distributed.rendezvous import KEY_BYTES, read_ranks, start_peer
from gossipnet.peer import Peer
from gossipnet.runtime.kinds import NodeKind
from gossipnet.testing import wait_until_sync

CONFIG = Config(
    heartbeat_interval_s=0.1,
    failure_timeout_s=2.0,
    control_retry_s=0.02,
    join_timeout_s=20.0,
    collective_timeout_s=10.0,
)
#: Bounds a hang of one call, not its speed (calls take milliseconds on loopback).
CALL_S = 30.0
TD = datetime.timedelta(seconds=CALL_S)
#: How long the slow rank computes before its first collective: long against a
#: broadcast on loopback, short against the collective timeout.


@pytest.fixture(autouse=True)
def _first_incarnation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Store keys carry torchrun's restart count: none here."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


def _start(
    store: dist.Store, world: int, group: str, secret: str | None = None
) -> list[tuple[Peer, Exchange]]:
    opts = GossipnetOptions(config=CONFIG, handle_sigterm=False, secret=secret)
    resolved = resolve_options(opts, 0, env={})  # no GOSSIPNET_SECRET from the environment
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(
            pool.map(
                lambda r: start_peer(store, r, world, resolved, group=group, timeout=TD),
                range(world),
            )
        )


def _close(started: list[tuple[Peer, Exchange]]) -> None:
    for peer, _ in started:
        peer.close(announce=False)


def _stored_key(store: dist.Store, generation: str) -> bytes:
    return bytes.fromhex(read_ranks(store, generation, "key", [0], 2, 1.0)[0].decode())


def _rejected(peer: Peer) -> int:
    return sum(peer.stats()["wire_rejects"].values())


@pytest.mark.timeout(120)
def test_without_a_secret_ranks_share_a_random_key_and_the_run_id_key_gets_nothing() -> None:
    store = dist.HashStore()
    started = _start(store, 2, "trust")  # returns once both ranks authenticate each other
    peer0, ex0 = started[0]
    try:
        key = _stored_key(store, "0.1")
        assert len(key) == KEY_BYTES
        # another job (its own store) draws another key
        other = dist.HashStore()
        again = _start(other, 2, "trust")
        _close(again)
        assert _stored_key(other, "0.1") != key

        # a local process that claims to be rank 1 and sends rank 0 a pickled part for
        # the next collective: first with the run-id key ("gossipnet:pgtrust", no
        # secret), then with the group's key itself, read from the store (an insider):
        # rank 1's id is pinned to the public key rank 1 published, so neither gets in
        evil = pickle.dumps({"run": "id > /tmp/pwned"})
        for secret in (None, key):
            attacker = join(
                [],
                "tcp://127.0.0.1:0",
                secret=secret,
                config=CONFIG.replace(peer_id="rank1", run=f"{CONFIG.run}:pgtrust"),
                handle_sigterm=False,
            )
            try:
                before = _rejected(peer0)

                async def send(node: Any = attacker.node) -> bool:
                    epoch, public = peer0.node.identity  # published in the store
                    node.codec.bind("rank0", epoch, public)
                    hello = {"addr": node.address, "pk": node.codec.identity.public, "re": False}
                    node.send_to_address(peer0.address, NodeKind.HELLO, hello, intro=True)
                    part = {"o": 1, "i": 0, "n": 1, "rq": 1}
                    return bool(
                        node.send_to_address(peer0.address, DistKind.PART, part, evil, dst="rank0")
                    )

                assert attacker.runtime.call(send())
                wait_until_sync(
                    lambda b=before: _rejected(peer0) > b, CALL_S, what="forged part refused"
                )
            finally:
                attacker.close(announce=False)
        admission = peer0.stats()["admission"]
        assert admission.get("identity_conflict", 0) >= 1  # the insider's claim on rank1
        assert peer0.stats()["wire_rejects"].get("unknown_key", 0) >= 2
        assert ex0.counters["parts_in"] == 0  # nothing taken in

        # rank 1's real broadcast reaches rank 0 intact
        pg0 = ProcessGroupGossipnet(*started[0], 0, 2, resolve_options(None, 0, env={}), CALL_S)
        pg1 = ProcessGroupGossipnet(*started[1], 1, 2, resolve_options(None, 1, env={}), CALL_S)
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        sent = torch.arange(100, dtype=torch.uint8)
        got = torch.zeros(100, dtype=torch.uint8)
        works = [pg1.broadcast([sent.clone()], opts), pg0.broadcast([got], opts)]
        for w in works:
            w.wait(TD)
        assert torch.equal(got, sent)
    finally:
        _close(started)


@pytest.mark.timeout(120)
def test_each_incarnation_on_a_store_gets_its_own_key_and_a_secret_given_is_used() -> None:
    """A second rendezvous on the same store (torchrun's restart) draws a new key under
    its own generation; with a secret given no key goes through the store."""
    store = dist.HashStore()
    _close(_start(store, 2, "gen"))
    _close(_start(store, 2, "gen"))
    assert _stored_key(store, "0.1") != _stored_key(store, "0.2")
    given = dist.HashStore()
    _close(_start(given, 2, "given", secret="s3cret"))
    assert not given.check(["gossipnet/0.1/key/0"])


class _AddOnlyStore(dist.Store):
    """A store that counts but cannot set, wait, check or get (a custom store type)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]

    def set(self, key: str, value: Any) -> None:
        raise NotImplementedError("this store has no set")

    def get(self, key: str) -> bytes:
        raise NotImplementedError("this store has no get")

    def wait(self, keys: Any, timeout: Any = None) -> None:
        raise NotImplementedError("this store has no wait")

    def check(self, keys: Any) -> bool:
        raise NotImplementedError("this store has no check")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", ["10.255.255.1", "127.0.0.1"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_store_that_cannot_carry_the_key_stops_the_start_before_any_peer(
    host: str, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No secret and a store that cannot share a key: a ConfigError asking for
    GOSSIPNET_SECRET on every rank and address, before a socket is bound."""

    def no_peer(*args: Any, **kwargs: Any) -> Peer:
        raise AssertionError("a peer was started without a shared key")

    monkeypatch.setattr(rendezvous, "join", no_peer)
    opts = resolve_options(
        GossipnetOptions(config=CONFIG, handle_sigterm=False, listen_host=host), rank, env={}
    )
    with pytest.raises(ConfigError, match=r"no GOSSIPNET_SECRET is set.*this store has no"):
        start_peer(_AddOnlyStore(), rank, 2, opts, group="x", timeout=TD)


class _Started(Exception):
    """Raised in place of starting a peer: the test looks only at what came before."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("host", "warned"), [("10.255.255.1", True), ("127.0.0.1", False)])
def test_a_store_shared_key_beyond_loopback_is_said_loudly(
    host: str, warned: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever reads torch's store reads the key: beyond loopback rank 0 says so and
    names GOSSIPNET_SECRET; then the peer starts with the key (32 random bytes)."""
    keys: list[Any] = []

    def started(*args: Any, secret: Any = None, **kwargs: Any) -> Peer:
        keys.append(secret)
        raise _Started

    monkeypatch.setattr(rendezvous, "join", started)
    opts = resolve_options(
        GossipnetOptions(config=CONFIG, handle_sigterm=False, listen_host=host), 0, env={}
    )
    store = dist.HashStore()
    logger = "gossipnet.distributed.rendezvous"
    with caplog.at_level("WARNING", logger=logger), pytest.raises(_Started):
        start_peer(store, 0, 2, opts, group="w", timeout=TD)
    assert keys == [_stored_key(store, "0.1")]
    assert len(keys[0]) == KEY_BYTES
    said = [r.getMessage() for r in caplog.records if "GOSSIPNET_SECRET" in r.getMessage()]
    assert bool(said) == warned, said


@pytest.fixture
def trio() -> Iterator[list[ProcessGroupGossipnet]]:
    store = dist.HashStore()
    started = _start(store, 3, "ahead")
    opts = resolve_options(GossipnetOptions(config=CONFIG, handle_sigterm=False), 0, env={})
    pgs = [ProcessGroupGossipnet(p, x, r, 3, opts, CALL_S) for r, (p, x) in enumerate(started)]
    yield pgs
    for pg in pgs:
        pg.abort()


@pytest.mark.timeout(120)
def test_collectives_issued_far_ahead_of_a_slow_rank_all_arrive(
    trio: list[ProcessGroupGossipnet],
) -> None:
    """Ranks 0 and 1 issue 24 broadcasts (roots 0 and 1 in a seeded order), allgathers
    and barriers at once; rank 2, a slow rank, first computes for a while, then issues
    each only after its previous one completed.  Every result is exact and no part was
    refused as ahead of the window: a rank never runs further ahead than it keeps.
    (Under a root that completed on delivery alone, ranks 0 and 1 would be five
    broadcasts ahead by the first allgather, beyond a window of three.)"""
    gen = torch.Generator().manual_seed(5)
    plan = [("bcast", int(r)) for r in torch.randint(0, 2, (24,), generator=gen)]
    plan[5::6] = [("gather", -1)] * len(plan[5::6])
    plan[8::9] = [("barrier", -1)] * len(plan[8::9])
    data = [torch.randint(0, 255, (3000,), generator=gen, dtype=torch.uint8) for _ in plan]

    def issue(pg: ProcessGroupGossipnet, k: int) -> tuple[Any, torch.Tensor | list[torch.Tensor]]:
        kind, root = plan[k]
        me = pg.rank()
        if kind == "bcast":
            mine = data[k].clone() if me == root else torch.zeros_like(data[k])
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            return pg.broadcast([mine], opts), mine
        if kind == "gather":
            outs = [torch.zeros(4, dtype=torch.int64) for _ in range(3)]
            return pg.allgather([outs], [torch.full((4,), 10 * k + me)]), outs
        return pg.barrier(), []

    def check(k: int, out: torch.Tensor | list[torch.Tensor]) -> None:
        kind, _ = plan[k]
        if kind == "bcast":
            assert isinstance(out, torch.Tensor)
            assert torch.equal(out, data[k])
        elif kind == "gather":
            assert [int(o[0]) for o in out] == [10 * k + r for r in range(3)]

    ahead = [threading.Event(), threading.Event()]  # each fast rank issued everything

    def fast(pg: ProcessGroupGossipnet, i: int) -> None:
        issued = [issue(pg, k) for k in range(len(plan))]
        ahead[i].set()
        for k, (work, out) in enumerate(issued):
            work.wait(TD)
            check(k, out)

    def slow(pg: ProcessGroupGossipnet) -> None:
        for event in ahead:  # start only once the others ran ahead of us
            assert event.wait(CALL_S), "a fast rank did not issue its collectives"
        for k in range(len(plan)):
            work, out = issue(pg, k)
            work.wait(TD)
            check(k, out)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(fast, trio[i], i) for i in (0, 1)] + [pool.submit(slow, trio[2])]
        for f in futs:
            f.result(timeout=CALL_S * 3)
    for pg in trio:
        c = pg.exchange_counters()
        assert (c["dropped_ahead"], c["dropped_over_cap"], c["malformed"]) == (0, 0, 0), c
