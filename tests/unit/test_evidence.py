"""Evidence before adopting state, piece by piece: the quorum, who counts as a
participant, the digest vote, and the state transfer's bounds and chunk checks.

Pure functions first, then nodes on a MemoryNetwork under a FakeClock.  The whole
rule, played by peers that train, is ``test_evidence_attack.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

from gossipnet import Config, FakeClock
from gossipnet.collectives.lossy.round_id import Alignment
from gossipnet.collectives.statesync.kinds import StateKind
from gossipnet.collectives.statesync.sync import StateSync, pack_state
from gossipnet.training import _evidence, _realign, _snapshot
from gossipnet.training._evidence import Claim, ParticipantLog, quorum, vouched, vouched_chunks
from gossipnet.training.kinds import TrainingKind
from gossipnet.training.replicas import DIGEST_KEY, ReplicaDigests, digest

NET = {"heartbeat_interval_s": 0.1, "failure_timeout_s": 0.6, "control_timeout_s": 1.0}
CHUNK = 1024


# ---------------------------------------------------------------------- the rule
def test_quorum_is_a_strict_majority_and_never_one_word_from_three_on() -> None:
    assert [quorum(n) for n in range(8)] == [1, 2, 1, 2, 3, 3, 4, 4]


def test_two_peer_runs_follow_the_documented_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_evidence, "ADOPT_ON_ONE_WORD", False)
    assert quorum(2) == 3  # never: more holders than exist


def _claim(step: int = 10, layout: str = "0" * 16) -> Claim:
    return Claim(step, 0, 3 * step, layout)


def test_one_insider_cannot_reach_a_quorum_alone() -> None:
    honest, evil = _claim(10), _claim(99)
    # 4 verified peers and us (n = 5): the insider's claim is one voice, 3 needed
    assert vouched({"a": honest, "b": honest, "c": honest, "x": evil}, 5) == (
        honest,
        ["a", "b", "c"],
    )
    assert vouched({"a": honest, "b": honest, "x": evil}, 4) is None  # 2 of 4: no quorum
    assert vouched({"a": honest, "x": evil}, 3) is None  # 1 + 1 of 3: nobody has 2
    assert vouched({"x": evil}, 3) is None
    assert vouched({"x": evil}, 2) == (evil, ["x"])  # two peers: the other's word


def test_one_far_ahead_peer_cannot_move_the_target() -> None:
    """The step to ask the donors for is the one a quorum of them reach: a verified
    peer announcing a step far ahead alone would make every attempt wait in vain."""
    assert _realign._robust_top([12, 12, 10**9], quorum(4)) == 12
    assert _realign._robust_top([12, 10**9], quorum(3)) == 12
    assert _realign._robust_top([12], quorum(2)) == 12


def test_chunks_are_vouched_one_by_one() -> None:
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    digests = {"p": [a, b, c], "q": [a, b, a], "x": [b, b, b]}
    assert vouched_chunks(digests, 4) == {1: b}  # 3 of 4 needed: only chunk 1
    assert vouched_chunks(digests, 3) == {0: a, 1: b}  # 2 of 3: chunk 2 is contested


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {"k": 1, "step": 1, "rb": 0, "nr": 3, "lay": "0" * 16},  # another kind
        {"k": 0, "step": -1, "rb": 0, "nr": 3, "lay": "0" * 16},
        {"k": 0, "step": 2**53, "rb": 0, "nr": 3, "lay": "0" * 16},
        {"k": 0, "step": 2**52, "rb": 0, "nr": 3, "lay": "0" * 16},  # ids past 2**53
        {"k": 0, "step": True, "rb": 0, "nr": 3, "lay": "0" * 16},
        {"k": 0, "step": 1.0, "rb": 0, "nr": 3, "lay": "0" * 16},
        {"k": 0, "step": 1, "rb": 0, "nr": 3, "lay": "G" * 16},
        {"k": 0, "step": 1, "rb": 0, "nr": 3, "lay": b"0" * 16},
    ],
)
def test_malformed_claims_are_no_claims(meta: dict[str, Any]) -> None:
    assert Claim.from_meta(meta) is None


def test_a_claim_survives_its_meta() -> None:
    claim = Claim(7, 3, 24, "0123456789abcdef")
    assert Claim.from_meta(claim.to_meta()) == claim


def test_ids_never_heard_in_a_round_are_neither_ahead_nor_behind() -> None:
    """The reviewer's attack at the decision: three made-up ids far ahead, three
    honest peers in our round.  Before, 3 ahead against 3 in sync read "we are
    behind"; now only ids heard in our rounds count."""
    log = ParticipantLog("p0")
    honest = frozenset({"p0", "p1", "p2"})
    log.note(Alignment(honest, {}, {}))
    raw = Alignment(honest, {"x1": 10**9, "x2": 10**9, "x3": 10**9}, {"x4": 0})
    assert raw.we_are_behind
    judged = log.judge(raw)
    assert (judged.ahead, judged.behind) == ({}, {})
    assert not judged.we_are_behind
    assert not judged.we_are_ahead
    # a verified peer far ahead still counts
    assert log.judge(Alignment(frozenset({"p0"}), {"p1": 90, "x1": 90}, {})).ahead == {"p1": 90}


def test_a_fresh_peer_falls_back_to_those_whose_round_packets_it_holds() -> None:
    log = ParticipantLog("p9")
    log.note(Alignment(frozenset({"p9"}), {}, {}))  # a first round that nobody shared
    raw = Alignment(frozenset({"p9"}), {"p0": 300, "x1": 10**9}, {})
    assert log.judge(raw, fallback={"p0", "p9"}).ahead == {"p0": 300}
    assert log.verified(fallback={"p0"}) == {"p0"}
    log.note(Alignment(frozenset({"p9", "p1"}), {}, {}))  # once a round is shared
    assert log.verified(fallback={"p0"}) == {"p1"}  # the fallback no longer counts


def test_parameter_bytes_are_written_only_if_whole_and_finite() -> None:
    buckets = [torch.arange(10, dtype=torch.float32), torch.zeros(3, dtype=torch.float64)]
    raw = _snapshot.pack_params(buckets)
    assert len(raw) == _snapshot.raw_size(buckets) == 64
    theirs = bytes(torch.full((16,), 2.0).numpy())  # 64 bytes of float32 2.0
    assert _snapshot.write_chunks(buckets, {0: theirs[:16], 9: b"x"}, 16) == "layout"
    assert _snapshot.write_chunks(buckets, {1: b"x" * 15}, 16) == "layout"
    nan = bytes(torch.full((4,), float("nan")).numpy())
    assert _snapshot.write_chunks(buckets, {0: nan}, 16) == "non_finite"
    assert torch.equal(buckets[0], torch.arange(10, dtype=torch.float32))  # all or nothing
    assert _snapshot.write_chunks(buckets, {1: theirs[:16]}, 16) == ""
    assert buckets[0][4:8].tolist() == [2.0] * 4
    assert buckets[0][3] == 3.0
    assert _snapshot.layout_key(buckets) != _snapshot.layout_key(buckets[:1])


def _adam(lr: float, seed: int) -> tuple[list[torch.nn.Parameter], torch.optim.Adam]:
    """A two-tensor model and its Adam after one step (moments filled)."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.Adam(params, lr=lr)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def _packed(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, step: int) -> bytes:
    return pack_state(
        {"params": [p.detach() for p in params], "optim": opt.state_dict(), "step": step}
    )


def test_a_whole_state_is_adopted_without_the_donors_hyperparameters() -> None:
    """What a joiner downloads: parameters, Adam's moments and the step come along;
    the donor's learning rate (1e6) does not."""
    theirs, their_opt = _adam(1e6, 1)
    mine, my_opt = _adam(0.01, 2)
    checked, why = _snapshot.check_state(_packed(theirs, their_opt, 42), mine, my_opt)
    assert why == ""
    assert checked is not None
    _snapshot.adopt_state(checked, mine, my_opt)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert torch.equal(my_opt.state[mine[0]]["exp_avg"], their_opt.state[theirs[0]]["exp_avg"])
    assert checked["step"] == 42
    assert my_opt.param_groups[0]["lr"] == 0.01


def test_a_state_that_does_not_fit_is_refused_with_a_reason() -> None:
    """Each way a downloaded state can be wrong is a reason string, never an exception
    (before, the same bytes raised out of the step that downloaded them)."""
    theirs, their_opt = _adam(0.01, 1)
    mine, my_opt = _adam(0.01, 2)
    good = _packed(theirs, their_opt, 3)
    bound = _snapshot.state_bound(mine, my_opt)
    assert len(good) < bound < len(good) + 128 * 1024  # the local layout, with a margin
    nan = [p.detach().clone() for p in theirs]
    nan[1][0] = float("nan")
    bad_moment = their_opt.state_dict()
    bad_moment["state"][0]["exp_avg_sq"] = torch.zeros(5)
    cases = {
        "oversize": good + bytes(bound),
        "bad_pickle": b"not a state at all",
        "layout": pack_state({"params": [t.t() for t in theirs], "optim": {}, "step": 3}),
        "non_finite": pack_state({"params": nan, "optim": their_opt.state_dict(), "step": 3}),
    }
    for why, data in cases.items():
        assert _snapshot.check_state(data, mine, my_opt) == (None, why), why
    moment = pack_state({"params": list(theirs), "optim": bad_moment, "step": 3})
    assert _snapshot.check_state(moment, mine, my_opt) == (None, "layout")
    assert _snapshot.check_state(good, mine, my_opt)[1] == ""


# ---------------------------------------------------------------------- the digest vote
@pytest.mark.timeout(30)
def test_digests_of_ids_not_in_the_resync_do_not_vote(
    run_async: Callable[..., Any], cluster: Any, drive: Any, wait_until: Any
) -> None:
    """p0's resync was shared by p1 and p2; four more ids (p3-p6: made up by one key
    holder) announce another digest for it.  Before, every alive id voted: 4 against
    3, p0 and the honest peers were outvoted and would download the made-up ids'
    state.  Now only the resync's participants vote: the replicas agree."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(7, config=Config(**NET), clock=clock) as nodes:
            votes = [ReplicaDigests(n) for n in nodes]
            good, evil = "a" * 32, "e" * 32
            votes[0].publish(41, good, participants={"p0", "p1", "p2"})
            for i, node in enumerate(nodes[1:], start=1):
                fields = {DIGEST_KEY: [41, good if i < 3 else evil]}
                node.send("p0", TrainingKind.DIGEST, fields)
            await wait_until(lambda: len(votes[0].peers) == 6, 2, clock=clock)
            check = votes[0].verdict([n.peer_id for n in nodes])
            assert check.agree, check
            assert set(check.digests) == {"p0", "p1", "p2"}
            assert (check.majority, check.disagree, check.missing) == (good, (), ())
            assert not check.outvoted("p0")

    run_async(main())


def test_an_outvoted_peer_repairs_only_behind_a_quorum() -> None:
    """Of four voters, the majority digest held by two (a 2-2 split broken by the
    lowest id) is no quorum: nobody repairs; held by three, the fourth does."""

    class _Node:
        peer_id = "p3"

        def __init__(self) -> None:
            self.beacon: dict[str, Any] = {}

        def on_heartbeat(self, cb: Any) -> None: ...
        def subscribe(self, kind: int, cb: Any) -> None: ...
        def on_membership(self, cb: Any) -> None: ...
        def alive_peers(self) -> list[str]:
            return []

    votes = ReplicaDigests(_Node())  # type: ignore[arg-type]
    votes.publish(5, "b" * 32, participants={"p0", "p1", "p2"})
    votes.peers.update({"p0": (5, "a" * 32), "p1": (5, "a" * 32), "p2": (5, "b" * 32)})
    split = votes.verdict(["p0", "p1", "p2", "p3"])
    assert (split.majority, split.needed) == ("a" * 32, 3)
    assert "p3" in split.disagree
    assert not split.outvoted("p3")
    votes.peers["p2"] = (5, "a" * 32)
    assert votes.verdict(["p0", "p1", "p2", "p3"]).outvoted("p3")


def test_digests_are_128_bits() -> None:
    assert len(digest([torch.zeros(4)])) == 32


# ---------------------------------------------------------------------- state transfer
def _manifest_server(node: Any, sz: int, cb: int) -> None:
    """Answer every manifest request with one for ``sz`` bytes; serve no chunk."""
    nchunks = max(1, -(-sz // cb))
    body = msgpack.packb({"d": bytes(16 * nchunks), "w": bytes(32), "m": {}})

    def answer(pkt: Any) -> None:
        if pkt.fields.get("op") == "man":
            head = {"op": "man", "x": pkt.fields["x"], "sid": "s1", "sz": sz, "cb": cb}
            node.send(pkt.src, StateKind.DATA, head, body)

    node.subscribe(StateKind.REQ, answer)


@pytest.mark.timeout(60)
def test_a_manifest_alone_allocates_nothing(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    """A peer announces 256 MiB (within the default bound) and sends none of it.
    Before, the client allocated and zeroed the whole buffer on the manifest alone.
    Now chunks are kept as they arrive: nothing arrived, nearly nothing is held."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET), clock=clock) as (a, b):
            _manifest_server(a, 256 << 20, 4 << 20)
            sync = StateSync(b, stall_timeout_s=0.3)
            tracemalloc.start()
            try:
                got, rep = await drive(clock, sync.download(sources=["p0"], timeout_s=1.0))
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert got is None
            assert not rep.ok
            assert peak < 16 << 20, peak

    run_async(main())


@pytest.mark.timeout(30)
def test_a_manifest_larger_than_the_callers_bound_is_refused(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET), clock=clock) as (a, b):
            _manifest_server(a, 10 * CHUNK + 1, CHUNK)
            sync = StateSync(b, stall_timeout_s=0.3)
            coro = sync.download(sources=["p0"], timeout_s=1.0, max_bytes=10 * CHUNK)
            got, rep = await drive(clock, coro)
            assert got is None
            assert not rep.ok
            assert sync.rejects["oversize"] >= 1

    run_async(main())


@pytest.mark.timeout(30)
def test_a_target_is_answered_once_a_snapshot_reaches_it(
    run_async: Callable[..., Any], cluster: Any, drive: Any, wait_until: Any
) -> None:
    """Asked for its state at step 5 while at step 3, a peer says "wait" and keeps the
    target for its trainer; its snapshot of step 5 answers it, an older one does not."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=Config(**NET, chunk_bytes=CHUNK), clock=clock) as (a, b):
            server, client = StateSync(a), StateSync(b)
            server.publish(b"three", {"k": 0, "step": 3})
            got: dict[Any, Any] = {}

            async def ask() -> None:
                got.update(
                    await client.manifests(
                        ["p0"], [(0, 5)], timeout_s=5.0, enough=lambda g: bool(g)
                    )
                )

            fut = asyncio.ensure_future(drive(clock, ask()))
            await wait_until(lambda: server.wanted_at(0) == 5, 2, clock=clock)
            assert not got
            server.publish(b"five", {"k": 0, "step": 5})
            await fut
            assert got[("p0", (0, 5))]["m"]["step"] == 5
            assert server.wanted_at(0) is None

    run_async(main())


@pytest.mark.timeout(30)
def test_a_chunk_that_does_not_hash_to_the_vouched_digest_is_taken_from_another_holder(
    run_async: Callable[..., Any], cluster: Any, drive: Any
) -> None:
    """p0 lists the right digests but serves other bytes for chunk 2 (a liar, or
    memory corruption); the chunk is refused and counted, and p1 serves it."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=Config(**NET, chunk_bytes=CHUNK), clock=clock) as nodes:
            donors = [StateSync(n, stall_timeout_s=0.3) for n in nodes[:2]]
            data = bytes(range(256)) * 16  # 4 chunks
            snaps = [d.publish(data, {"k": 0, "step": 1}) for d in donors]
            bad = bytearray(data)
            bad[2 * CHUNK] ^= 0xFF
            donors[0].snapshots[-1] = dataclasses.replace(snaps[0], data=bytes(bad))
            client = StateSync(nodes[2], stall_timeout_s=0.3)
            mans = await drive(
                clock,
                client.manifests(
                    ["p0", "p1"], [(0, 1)], timeout_s=2.0, enough=lambda g: len(g) == 2
                ),
            )
            holders = [(p, mans[(p, (0, 1))]) for p in ("p0", "p1")]
            wanted = {c: snaps[1].digests[16 * c : 16 * (c + 1)] for c in range(4)}
            parts, rep = await drive(clock, client.fetch_chunks(wanted, holders, timeout_s=3.0))
            assert b"".join(parts[c] for c in range(4)) == data
            assert rep.ok
            assert rep.chunks_corrupt >= 1
            assert rep.sources_tried == ("p0", "p1")

    run_async(main())
