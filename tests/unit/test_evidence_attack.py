"""Evidence before adopting state: attacks on realignment and replica repair.

Each test plays one way a key holder, or a fault, used to set honest replicas:
ids that never took part in a round announcing a round far ahead and serving a
poisoned model; a participant serving other parameters than the others; state that
does not fit or is not finite.  Before, the honest peers adopted what came (every
parameter 7.0, lr 1e6) or raised out of ``opt.step()``; now nothing is adopted that
a quorum of verified participants does not vouch for, what is refused is counted
and reported, and training goes on.  MemoryNetwork peers in threads
(``gossipnet.testing.run_peers``), seeded, bounded.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.collectives.statesync.snapshot import Snapshot
from gossipnet.collectives.statesync.sync import StateSync, pack_state, unpack_state
from gossipnet.testing import MemoryNetwork, run_peers
from gossipnet.training.kinds import TrainingKind
from gossipnet.training.replicas import DIGEST_KEY

from ..conftest import FAST

# A few dozen 2 s rounds at most, and a realignment's crawl: 180 s bounds a hang.
pytestmark = pytest.mark.timeout(180)
DIM, OUT, LR = 16, 4, 0.05
POISON = 7.0
#: A round id far ahead of any the honest peers run (a valid id, a valid beacon).
FAR = 3 * 10**9
FREEZE_BOUND_S = 60.0  # a frozen peer thaws at the latest after this: a hang guard


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A seeded least-squares problem: (inputs, targets, the weights that fit them)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, OUT, generator=g)
    x = torch.randn(128, DIM, generator=g)
    return x, x @ w, w


def _train(
    peer: gossipnet.Peer,
    steps: int,
    seed: int,
    *,
    lr: float = LR,
    freeze_at: int = -1,
    thaw: threading.Event | None = None,
    reached: Callable[[int], None] | None = None,
    made: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """``steps`` SGD steps of a linear model on a seeded problem, then a resync and
    the replica verdict.  At step ``freeze_at`` the whole peer (its loop too) stops
    until ``thaw``; ``reached(step)`` hears every step count reached; ``made(opt)``
    the optimizer once built."""
    x_eval, y_eval, w_true = _data(99)
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, OUT)
    with torch.no_grad():
        first_loss = float(torch.nn.functional.mse_loss(model(x_eval), y_eval))
    opt = peer.optimizer(torch.optim.SGD(model.parameters(), lr=lr), resync_every_steps=5)
    if made is not None:
        made(opt)
    gen = torch.Generator().manual_seed(seed)
    extra: dict[str, float] = {}

    async def freeze() -> None:
        assert thaw is not None
        thaw.wait(FREEZE_BOUND_S)  # blocks the loop thread: silent, not slow

    while opt.step_count < steps:
        if opt.step_count == freeze_at:
            peer._call(freeze(), FREEZE_BOUND_S + 30)
            freeze_at = -1
        xb = torch.randn(32, DIM, generator=gen)
        loss = torch.nn.functional.mse_loss(model(xb), xb @ w_true)
        opt.zero_grad()
        loss.backward()
        rep = opt.step()  # nothing a peer sends may raise out of here
        for k in ("realigned", "replica_repaired", "state_rejected", "unwitnessed"):
            extra[k] = extra.get(k, 0.0) + rep.extra.get(k, 0.0)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            extra["non_finite_steps"] = extra.get("non_finite_steps", 0.0) + 1.0
        if reached is not None:
            reached(opt.step_count)
    opt.resync()
    check = peer.replicas_agree(timeout=5.0)
    with torch.no_grad():
        eval_loss = float(torch.nn.functional.mse_loss(model(x_eval), y_eval))
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "params": params,
        "eval_loss": eval_loss,
        "first_loss": first_loss,
        "lr": opt.base.param_groups[0]["lr"],
        "agree": bool(check),
        "steps": opt.step_count,
        **extra,
    }


def _poisoned_state(layout: list[tuple[torch.dtype, int]]) -> bytes:
    """A whole state as a donor used to serve it (params, optimizer state, step), with
    every parameter 7.0 and a learning rate of 1e6."""
    sgd = {"lr": 1e6, "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False}
    sgd |= {"maximize": False, "foreach": None, "differentiable": False, "fused": None}
    optim = {
        "step_count": FAR // 3,
        "round_base": 0,
        "param_groups": [sgd],
        "sharded": {"buckets": {}, "scalars": {}},
    }
    params = [torch.full((n,), POISON, dtype=dt) for dt, n in layout]
    return pack_state({"params": params, "optim": optim, "step": FAR // 3})


def _arm_made_up_id(
    peer: gossipnet.Peer, layout: list[tuple[torch.dtype, int]], attack: str
) -> None:
    """Make ``peer`` (a key holder that takes part in no round) announce an optimizer
    round far ahead and serve a poisoned state to whoever asks, at once; with
    ``"digests"`` also answer every resync digest it hears with another."""
    blob = _poisoned_state(layout)

    def echo(pkt: Any) -> None:  # loop thread
        heard = pkt.fields.get(DIGEST_KEY)
        if isinstance(heard, list) and len(heard) == 2 and isinstance(heard[1], str):
            ours = [heard[0], "e" * len(heard[1])]
            peer._node.beacon[DIGEST_KEY] = ours
            peer._node.send(pkt.src, TrainingKind.DIGEST, {DIGEST_KEY: ours})

    async def arm() -> None:
        sync: StateSync = peer._statesync
        # "I am in round FAR" in every heartbeat (also what lets the honest peers' rounds
        # stop waiting for a member that sends nothing)
        peer._node.beacon["opt"] = FAR
        if attack == "digests":
            peer._node.on_heartbeat(echo)
        sync.on_wanted = lambda: sync.publish(blob, {"step": FAR // 3})
        sync.publish(blob, {"step": FAR // 3})

    peer._call(arm())


@pytest.mark.parametrize(("attack", "made_up"), [("ahead", 3), ("digests", 4)])
def test_made_up_ids_are_neither_behind_nor_donors_nor_voters(attack: str, made_up: int) -> None:
    """Three honest peers train; one key holder runs ``made_up`` more ids that never
    take part in a round and serve every parameter 7.0 with lr 1e6.  "ahead": they
    announce a round far ahead; before, each honest peer found itself behind (3 ahead
    against 3 in its round), downloaded a made-up id's state and adopted it.
    "digests": they also answer every resync digest with another, 4 against 3, which
    outvoted the honest peers.  Now ids never heard in a round carry no weight:
    nobody realigns or repairs, and training ends where it would have without them."""
    honest, steps = 3, 20
    layout: list[tuple[torch.dtype, int]] = []
    ready = threading.Event()
    finished = threading.Barrier(honest + made_up, timeout=FREEZE_BOUND_S * 2)

    def made(opt: Any) -> None:
        if not ready.is_set():
            layout.extend((b.dtype, b.numel()) for b in opt.strategy.param_buckets())
            ready.set()

    def body(rank: int, peer: gossipnet.Peer) -> Any:
        if rank >= honest:
            assert ready.wait(FREEZE_BOUND_S)
            _arm_made_up_id(peer, layout, attack)
            finished.wait()
            return None
        try:
            return _train(peer, steps, 300 + rank, made=made)
        finally:
            finished.wait()

    out = run_peers(honest + made_up, body, **FAST)[:honest]
    for res in out:
        assert res["realigned"] == 0, res
        assert res["replica_repaired"] == 0, res
        assert res["lr"] == LR
        assert not torch.any(res["params"] == POISON)
        # trained (from ~21 to ~7), not poisoned (every parameter 7.0: ~700)
        assert res["eval_loss"] < res["first_loss"] / 2, res
        assert res["steps"] == steps
        assert res["agree"]  # made-up ids never vote on a resync either
    assert all(torch.equal(out[0]["params"], r["params"]) for r in out[1:])


# ---------------------------------------------------------------------- a frozen peer
def _frozen_run(steps: int = 24, lrs: tuple[float, ...] = (LR, LR, LR)) -> list[dict[str, Any]]:
    """Three peers; p2 stops at step 6 (loop included) until p0 is at step 14, then
    thaws behind the others and must realign."""
    thaw = threading.Event()

    def body(rank: int, peer: gossipnet.Peer) -> Any:
        if rank == 2:
            return _train(peer, steps, 402, lr=lrs[2], freeze_at=6, thaw=thaw)
        on_step = (lambda s: thaw.set() if s >= 14 else None) if rank == 0 else None
        return _train(peer, steps, 400 + rank, lr=lrs[rank], reached=on_step)

    return run_peers(3, body, **FAST)


def _corrupt(data: bytes, how: str) -> bytes:
    """``data`` (a served state: raw float32 parameters, or a pickled state dict) made
    wrong: "poison" (every parameter 7.0), "nan", "long"/"short" (random bytes, 4 KiB
    more, or 8 B fewer)."""
    gen = torch.Generator().manual_seed(len(data))
    if how in ("long", "short"):
        n = len(data) + 4096 if how == "long" else len(data) - 8
        return bytes(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).numpy())
    value = POISON if how == "poison" else float("nan")
    try:
        state = unpack_state(data)  # the whole pickled state a donor used to serve
    except Exception:  # raw float32 parameters
        return bytes(torch.full((len(data) // 4,), value).numpy())
    state["params"] = [torch.full_like(t, value) for t in state["params"]]
    return pack_state(state)


def _corrupt_served(monkeypatch: pytest.MonkeyPatch, liars: set[str], how: str, times: int) -> None:
    """Make each of ``liars`` serve its next ``times`` published states corrupted."""
    real = StateSync.install
    done: collections.Counter[str] = collections.Counter()

    def install(self: StateSync, snap: Snapshot) -> None:
        me = self.node.peer_id
        if me in liars and done[me] < times:
            done[me] += 1
            snap = Snapshot.of(_corrupt(snap.data, how), snap.chunk_bytes, snap.meta, snap.created)
        real(self, snap)

    monkeypatch.setattr(StateSync, "install", install)


def test_a_frozen_peer_realigns_and_keeps_its_own_hyperparameters() -> None:
    """p2 (lr 0.02; the others 0.05) is frozen past the failure timeout and thaws
    behind.  It realigns on what both others vouch for (their position, the chunks
    they agree on) and keeps its learning rate: a donor's hyperparameters never come
    along (before, p2 took the donor's param groups, lr included)."""
    out = _frozen_run(lrs=(LR, LR, 0.02))
    assert out[2]["realigned"] >= 1, out[2]
    assert out[0]["realigned"] == out[1]["realigned"] == 0
    assert [r["lr"] for r in out] == [LR, LR, 0.02]
    assert all(r["steps"] == 24 and r["agree"] for r in out)
    assert all(torch.equal(out[0]["params"], r["params"]) for r in out[1:])


def test_a_participant_serving_other_parameters_is_outvoted_chunk_by_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """p0, a participant, serves every parameter 7.0 under an honest-looking claim when
    p2 realigns.  Before, p2 downloaded the first donor's state whole and adopted it.
    Now p0's chunks differ from p1's, so no quorum vouches for them: p2 takes the
    position both claim, keeps its own parameters there, and is never 7.0."""
    _corrupt_served(monkeypatch, {"p0"}, "poison", times=10**6)
    out = _frozen_run()
    assert out[2]["realigned"] >= 1, out[2]
    for res in out:
        assert not torch.any(res["params"] == POISON)
        assert res["eval_loss"] < res["first_loss"] / 2, res
        assert res["steps"] == 24
        assert res["agree"]
    assert all(torch.equal(out[0]["params"], r["params"]) for r in out[1:])


@pytest.mark.parametrize("how", ["long", "nan"])  # a short state meets the same size test
def test_bad_state_from_every_donor_is_counted_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Both donors serve p2 a state that is too long, too short or not finite the first
    time it asks.  Before, the unpickling or the layout check raised out of p2's
    ``opt.step()`` (or NaN parameters were adopted).  Now the download is refused,
    counted and reported; p2 trains on, asks again and realigns."""
    _corrupt_served(monkeypatch, {"p0", "p1"}, how, times=1)
    out = _frozen_run()
    assert out[2].get("non_finite_steps", 0.0) == 0, out[2]
    assert out[2]["state_rejected"] >= 1, out[2]
    assert out[2]["realigned"] >= 1, out[2]
    for res in out:
        assert res.get("non_finite_steps", 0.0) == 0, res  # never held a NaN, not even once
        assert torch.isfinite(res["params"]).all()
        assert res["steps"] == 24
        assert res["agree"]
    assert all(torch.equal(out[0]["params"], r["params"]) for r in out[1:])


def test_a_peer_that_joins_a_run_under_way_realigns_and_keeps_its_own_hyperparameters() -> None:
    """p3 starts when the others are at step 10 (a restarted process: step 0, its own
    initialisation, lr 0.02).  No round of its own was shared yet, so the peers that
    count are those whose round packets it holds for rounds ahead (never ids known
    from heartbeats alone); all three vouch for their position and parameters, and it
    realigns.  Before, it took a donor's whole optimizer state, lr included."""
    network = MemoryNetwork()
    late: dict[str, Any] = {}

    def join_late() -> None:
        addrs = [f"mem://p{i}" for i in range(4)]
        with gossipnet.join(
            addrs, listen=addrs[3], secret=b"t", peer_id="p3", network=network, **FAST
        ) as peer:
            late.update(_train(peer, 30, 503, lr=0.02))

    thread = threading.Thread(target=join_late, name="peer-p3")

    def body(rank: int, peer: gossipnet.Peer) -> Any:
        if rank != 0:
            return _train(peer, 30, 500 + rank)
        start = lambda s: thread.start() if s == 10 else None  # noqa: E731
        try:
            return _train(peer, 30, 500, reached=start)
        finally:
            thread.join(FREEZE_BOUND_S * 2)  # stay until the late peer is done

    out = run_peers(3, body, network=network, **FAST)
    assert not thread.is_alive()
    assert late["realigned"] >= 1, late
    assert late["lr"] == 0.02
    assert late["steps"] == 30
    assert late["agree"]
    assert all(torch.equal(late["params"], r["params"]) for r in out)


def test_with_one_other_participant_its_word_is_taken_and_said() -> None:
    """Two peers: no third can witness p0's state, so p1, thawed behind, takes it on
    p0's word (``_evidence.ADOPT_ON_ONE_WORD``) and its report says so."""
    thaw = threading.Event()

    def body(rank: int, peer: gossipnet.Peer) -> Any:
        if rank == 1:
            return _train(peer, 20, 601, freeze_at=4, thaw=thaw)
        return _train(peer, 20, 600, reached=lambda s: thaw.set() if s >= 10 else None)

    out = run_peers(2, body, **FAST)
    assert out[1]["realigned"] >= 1, out[1]
    assert out[1]["unwitnessed"] >= 1, out[1]
    assert out[0]["unwitnessed"] == 0
    assert torch.equal(out[0]["params"], out[1]["params"])
