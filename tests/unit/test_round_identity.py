"""Rounds identified by what they are (issue: a replica silently diverged).

Each test shows one way peers used to fall out of step unnoticed: a call more on
one peer, a replica a resync left wrong, another tensor layout, a round number
out of range; and that now it is noticed, repaired or raised, and reported.
MemoryNetwork peers in threads (``gossipnet.testing.run_peers``), seeded, bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.collectives.chunks import ChunkPlan
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.collectives.lossy.round_id import (
    GRADIENTS,
    alignment,
    layout_of,
    optimizer_round,
    step_of_round,
    valid_round,
)
from gossipnet.runtime.kinds import NodeKind
from gossipnet.testing import run_peers
from gossipnet.training.allreduce import AllReduceStrategy

from ..conftest import FAST

# Each test runs at most a few dozen 2 s rounds: 120 s bounds a hang, not slowness.
pytestmark = pytest.mark.timeout(120)
N_PARAMS = 3000
FREEZE_BOUND_S = 60.0  # a frozen peer thaws at the latest after this: a hang guard


def _train(
    peer: gossipnet.Peer,
    steps: int,
    seed: int,
    freeze_at: int = -1,
    thaw: threading.Event | None = None,
    reached: Callable[[int], None] | None = None,
) -> Any:
    """``steps`` SGD steps on a seeded random walk.  At step ``freeze_at`` the whole
    peer (its event loop too, so no heartbeat goes out: an overloaded or swapping host)
    stops until ``thaw`` is set;
    ``reached(step)`` is told every step count this peer reaches."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(N_PARAMS))
    opt = peer.optimizer(torch.optim.SGD([p], lr=0.1), resync_every_steps=10)
    gen = torch.Generator().manual_seed(seed)
    reports = []

    async def freeze() -> None:
        assert thaw is not None
        thaw.wait(FREEZE_BOUND_S)  # blocks the loop thread: silent, not slow

    while opt.step_count < steps:
        if opt.step_count == freeze_at:
            peer._call(freeze(), FREEZE_BOUND_S + 30)
            freeze_at = -1
        p.grad = torch.randn(N_PARAMS, generator=gen)
        reports.append(opt.step())
        if reached is not None:
            reached(opt.step_count)
    opt.resync()
    check = peer.replicas_agree(timeout=5.0)
    return p.detach().clone(), reports, check, opt


def test_round_ids_follow_the_step() -> None:
    assert optimizer_round(7, GRADIENTS) == 23
    assert step_of_round(optimizer_round(7, GRADIENTS)) == 7
    assert [valid_round(x) for x in (0, 2**53 - 1, 2**53, -1, True)] == [1, 1, 0, 0, 0]
    a = alignment("me", {"x"}, {"y": 50, "z": 2}, 10)
    assert (a.in_sync, a.ahead, a.behind) == ({"me", "x"}, {"y": 50}, {"z": 2})
    assert (a.we_are_behind, a.we_are_ahead) == (False, False)
    assert alignment("me", set(), {"y": 50}, 10).we_are_behind  # two peers: progress wins
    assert not alignment("me", set(), {"y": 5}, 10).we_are_ahead


def test_a_peer_frozen_past_the_failure_timeout_realigns() -> None:
    """p2 stops at step 10 until p0 is at step 40 (the others declared it dead and
    trained on).  Before, a thawed peer could run rounds off the others' for the rest
    of the run.  Now its first round shows it behind: it downloads a live peer's
    state and step count, and every replica ends bit-identical, at the same step."""
    thaw = threading.Event()

    def body(rank: int, peer: gossipnet.Peer) -> Any:
        if rank == 2:
            return _train(peer, 80, 102, freeze_at=10, thaw=thaw)
        on_step = (lambda s: thaw.set() if s >= 40 else None) if rank == 0 else None
        return _train(peer, 80, 100 + rank, reached=on_step)

    out = run_peers(3, body, **FAST)
    realigned = [sum(r.extra.get("realigned", 0.0) for r in o[1]) for o in out]
    assert realigned[2] >= 1, realigned
    assert realigned[0] == realigned[1] == 0, realigned
    assert len(out[2][1]) < len(out[0][1])  # it skipped the steps it missed
    finals = [o[0] for o in out]
    assert all(torch.equal(finals[0], f) for f in finals[1:])
    for _, _, check, opt in out:
        assert check.agree, check
        assert opt.step_count == 80


def test_a_replica_outvoted_after_a_resync_repairs_itself(monkeypatch: Any) -> None:
    """A resync that leaves one replica wrong (here: p2 corrupts its result) is caught
    by the digest check: p2 downloads the majority's state and says so in a report.
    Chunks of 1 KiB, so that every peer owns some and hears every other in each
    round (a digest counts only from a peer heard taking part in the resync)."""
    real_resync = AllReduceStrategy._resync
    corrupted = []

    async def bad_resync(self: Any, params: list[torch.Tensor], round_id: int) -> Any:
        if self.host.peer_id == "p2" and round_id == optimizer_round(10, 1):
            # the resync's own result, wrong on p2 only (as a stale chunk would be)
            orig = self._engine().run

            async def run(*args: Any, **kwargs: Any) -> Any:
                rep = await orig(*args, **kwargs)
                args[1].dst[0][:100] += 1.0  # run(src, RoundOptions(dst=params, ...))
                corrupted.append(round_id)
                return rep

            self._engine().run = run  # type: ignore[method-assign]
            try:
                return await real_resync(self, params, round_id)
            finally:
                del self._engine().run
        return await real_resync(self, params, round_id)

    monkeypatch.setattr(AllReduceStrategy, "_resync", bad_resync)

    def body(rank: int, peer: gossipnet.Peer) -> Any:
        return _train(peer, 16, 200 + rank)

    out = run_peers(3, body, **FAST, chunk_bytes=1024)
    assert corrupted
    repaired = [sum(r.extra.get("replica_repaired", 0.0) for r in o[1]) for o in out]
    assert repaired[2] >= 1, repaired
    assert repaired[0] == repaired[1] == 0, repaired
    disagree = [max(r.extra.get("replicas_disagree", 0.0) for r in o[1]) for o in out]
    assert disagree == [1.0, 1.0, 1.0], disagree  # every peer saw it and said so
    finals = [o[0] for o in out]
    assert all(torch.equal(finals[0], f) for f in finals[1:])
    assert all(o[2].agree for o in out)


def test_replicas_agree_before_any_resync_says_what_to_do() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> str:
        with pytest.raises(gossipnet.ConfigError, match="resync"):
            peer.replicas_agree(timeout=0.1)
        return "ok"

    assert run_peers(2, body, **FAST) == ["ok", "ok"]


def test_another_layout_raises_naming_the_peer_and_both_layouts() -> None:
    """Before: no message, timeouts, one peer never learns.  Now both peers raise at
    the first collective, each naming the other and both layouts."""

    def body(rank: int, peer: gossipnet.Peer) -> str:
        t = torch.zeros(1000 + 200 * rank)
        with pytest.raises(gossipnet.LayoutMismatchError) as err:
            peer.all_reduce([t], timeout=2.0)
        return str(err.value)

    msgs = run_peers(2, body, **FAST)
    expected = (("p1: f32[1200]", 1000), ("p0: f32[1000]", 1200))
    for msg, (theirs, ours) in zip(msgs, expected, strict=True):
        assert theirs in msg, msg
        assert f"Ours: f32[{ours}]" in msg, msg


def test_another_layout_in_the_optimizer_raises_too() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> str:
        model = torch.nn.Linear(4, 3 + rank)
        opt = peer.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(2, 4)).sum().backward()
        with pytest.raises(gossipnet.LayoutMismatchError, match=r"f32\[\d+\]") as err:
            opt.step()
        return str(err.value)

    msgs = run_peers(2, body, **FAST)
    assert "p1" in msgs[0]
    assert "p0" in msgs[1]


@pytest.mark.parametrize("where", ["data", "heartbeat", "heartbeat-2**60"])
def test_out_of_range_round_fields_are_counted_and_harmless(where: str) -> None:
    """A round number of 2**64 - 1 in a data packet or a heartbeat: before, the next
    round was 2**64, msgpack could not encode it and every all_reduce raised
    OverflowError on both peers.  Now it is dropped (``bad_round``) and rounds go on."""

    def body(rank: int, peer: gossipnet.Peer) -> tuple[list[float], int]:
        if rank == 1:
            node = peer.node
            plan = ChunkPlan(64, torch.float32, 64 * 1024)
            if where == "data":
                fields = {"r": 2**64 - 1, "m": 0, "L": layout_of([plan])[0], "b": 0, "c": 0}
                fields |= {"w": 1.0, "dt": "f32", "n": 64}
                kind, payload = LossyKind.RS_DATA, bytes(256)
            else:  # 2**64 - 1 is past every int field's range; 2**60 past a round's
                big = 2**64 - 1 if where == "heartbeat" else 2**60
                fields, kind, payload = {"ar": big}, NodeKind.HEARTBEAT, b""

            async def forge() -> None:
                node.send("p0", kind, fields, payload)

            peer._call(forge())
        means = []
        for i in range(3):
            t = torch.full((64,), float(rank + i))
            rep = peer.all_reduce([t], timeout=2.0)
            assert rep.ok, rep
            means.append(float(t[0]))
        # the node drops a beacon past any int field's range, the engine a bad round id
        counted = peer._engine().dropped["bad_round"] + peer.node.codec.rejects["beacon_range"]
        return means, counted

    out = run_peers(2, body, **FAST)
    assert out[0][0] == out[1][0] == [0.5, 1.5, 2.5]
    assert out[0][1] >= 1  # p0 counted the forged field
