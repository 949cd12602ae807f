"""GossipOptimizer: sharded steps, bounded drift under loss, exact resync.

Peers run in threads over the in-process MemoryNetwork (no sockets), each
with its own event-loop thread, as under ``gossipnet.join``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing import run_peers as _run_peers

FAST = {
    "heartbeat_interval_s": 0.05,
    "failure_timeout_s": 1.0,
    "chunk_bytes": 1024,
    "collective_timeout_s": 5.0,
}


def run_peers(n: int, body: Callable[[int, gossipnet.Peer], Any], **config: Any) -> list[Any]:
    """``gossipnet.testing.run_peers`` with this module's fast settings."""
    return _run_peers(n, body, timeout_s=60, **{**FAST, **config})


def run_lossy_trio(
    body: Callable[[int, gossipnet.Peer], Any], seed: int, **config: Any
) -> list[Any]:
    """Three peers over 20% seeded random loss, 1 KiB chunks, 2 s collectives."""
    faults = gossipnet.FaultPlan(loss=0.2, seed=seed)
    return run_peers(3, body, faults=faults, collective_timeout_s=2.0, chunk_bytes=1024, **config)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).clone()


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_lossless_training_keeps_replicas_identical(opt_cls: type) -> None:
    """Different initial seeds, round-0 resync, then identical replicas every step."""

    def body(rank: int, peer: gossipnet.Peer) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = peer.optimizer(opt_cls(model.parameters(), lr=0.01))
        gen = torch.Generator().manual_seed(100 + rank)
        w = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
        snaps = []
        losses = []
        for _ in range(30):
            x = torch.randn(32, 8, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x @ w)
            opt.zero_grad()
            loss.backward()
            rep = opt.step()
            assert rep.ok, rep
            snaps.append(flat_params(model))
            losses.append(float(loss.detach()))
        return snaps, losses

    out = run_peers(3, body)
    for step in range(30):
        ref = out[0][0][step]
        for rank in (1, 2):
            assert torch.equal(out[rank][0][step], ref), f"replicas differ at step {step}"
    assert all(sum(o[1][-5:]) < sum(o[1][:5]) for o in out), "training did not reduce the loss"


def test_sharded_step_equals_single_process_step() -> None:
    """Averaged gradients stepped shard by shard equal a plain optimizer on the mean."""
    torch.manual_seed(0)
    init = torch.randn(5000)
    grads = [torch.randn(5000) for _ in range(3)]

    def body(rank: int, peer: gossipnet.Peer) -> torch.Tensor:
        p = torch.nn.Parameter(init.clone())
        opt = peer.optimizer(torch.optim.Adam([p], lr=0.1, betas=(0.8, 0.9)))
        for _ in range(3):
            p.grad = grads[rank].clone()
            opt.step()
        return p.detach().clone()

    out = run_peers(3, body)
    ref = torch.nn.Parameter(init.clone())
    base = torch.optim.Adam([ref], lr=0.1, betas=(0.8, 0.9))
    for _ in range(3):
        ref.grad = torch.stack(grads).mean(0)
        base.step()
    for got in out:
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)


def test_param_groups_and_mixed_dtypes() -> None:
    """Two groups with different lr and a bfloat16 parameter train and stay equal."""

    def body(rank: int, peer: gossipnet.Peer) -> list[torch.Tensor]:
        torch.manual_seed(rank)
        a = torch.nn.Parameter(torch.randn(300))
        b = torch.nn.Parameter(torch.randn(200).to(torch.bfloat16))
        c = torch.nn.Parameter(torch.randn(50))
        opt = peer.optimizer(
            torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
        )
        c_start = None
        for step in range(5):
            a.grad = torch.full_like(a, 1.0 + rank)
            b.grad = torch.full_like(b, 2.0)
            c.grad = torch.full_like(c, float(step))
            opt.step()
            if step == 0:
                c_start = c.detach().clone()  # after the round-0 resync; grad 0 moved nothing
        assert c_start is not None
        return [a.detach().clone(), b.detach().float().clone(), c.detach().clone(), c_start]

    out = run_peers(3, body)
    for k in range(3):
        assert torch.equal(out[0][k], out[1][k])
        assert torch.equal(out[0][k], out[2][k])
    # group 2 has its own lr 0.5: gradients 1..4 move c by 0.5 * 10 = 5
    torch.testing.assert_close(out[0][3] - out[0][2], torch.full((50,), 5.0))


def test_state_dict_round_trip() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(2000))
        opt = peer.optimizer(torch.optim.Adam([p], lr=0.05))
        for _ in range(3):
            p.grad = torch.ones_like(p) * (rank + 1)
            opt.step()
        state = opt.state_dict()
        snapshot = p.detach().clone()
        # continue two steps, then restore and redo them: same result
        for _ in range(2):
            p.grad = torch.ones_like(p)
            opt.step()
        after = p.detach().clone()
        with torch.no_grad():
            p.copy_(snapshot)
        opt.load_state_dict(state)
        for _ in range(2):
            p.grad = torch.ones_like(p)
            opt.step()
        return after, p.detach().clone()

    for after, redo in run_peers(2, body, resync_every_steps=0):
        torch.testing.assert_close(redo, after)


@pytest.mark.parametrize("stale_step", [True, False], ids=["estimate", "keep"])
def test_lost_parameter_broadcasts_take_an_estimated_step(stale_step: bool) -> None:
    """Config.stale_step (default): chunks whose broadcast was lost move by their
    last arrived step against our own gradient (counted in ``extra["estimated"]``);
    off, they keep their values and the report has no such figure."""
    n_params = 2048

    def body(rank: int, peer: gossipnet.Peer) -> tuple[float, bool]:
        p = torch.nn.Parameter(torch.zeros(n_params))
        opt = peer.optimizer(torch.optim.SGD([p], lr=0.1), resync_every_steps=0)
        gen = torch.Generator().manual_seed(2000 + rank)
        estimated, seen = 0.0, False
        for _ in range(40):
            p.grad = torch.randn(n_params, generator=gen) + 1.0  # drifts one way
            rep = opt.step()
            seen = seen or "estimated" in rep.extra
            estimated += rep.extra.get("estimated", 0.0)
        assert bool(torch.isfinite(p).all())
        return estimated, seen

    out = run_lossy_trio(body, seed=12, stale_step=stale_step)
    if stale_step:
        assert sum(e for e, _ in out) > 0, out
    else:
        assert not any(seen for _, seen in out), out


@pytest.mark.parametrize("parity_group", [None, 0], ids=["default", "off"])
def test_optimizer_rounds_send_parity_under_loss_by_default(parity_group: int | None) -> None:
    """Config.parity_group=None: the optimizer's rounds send XOR parity while loss is
    seen and rebuild lost chunks with it; a plain all_reduce on the same network sends
    none; parity_group=0 turns it off for the optimizer too."""
    n_params = 3 * 8 * 256  # 1 KiB chunks: 8 per owner, two parity groups of 4 per stream

    def body(rank: int, peer: gossipnet.Peer) -> tuple[float, float, float]:
        p = torch.nn.Parameter(torch.zeros(n_params))
        opt = peer.optimizer(torch.optim.SGD([p], lr=0.1), resync_every_steps=0)
        gen = torch.Generator().manual_seed(3000 + rank)
        sent = recovered = 0.0
        for _ in range(20):
            p.grad = torch.randn(n_params, generator=gen)
            rep = opt.step()
            sent += rep.extra["parity_sent"]
            recovered += rep.extra["recovered"]
        plain = sum(
            peer.all_reduce([torch.ones(n_params)], timeout=2.0).extra["parity_sent"]
            for _ in range(5)
        )
        return sent, recovered, plain

    out = run_lossy_trio(body, seed=13, parity_group=parity_group)
    assert all(plain == 0 for _, _, plain in out), out
    if parity_group is None:
        assert all(sent > 0 for sent, _, _ in out), out
        assert sum(rec for _, rec, _ in out) > 0, out  # some lost chunk came back
    else:
        assert all(sent == 0 and rec == 0 for sent, rec, _ in out), out


# ~10 s on 2 idle cores, ~60 s measured at a load of 12: 300 s bounds a hang, not slowness.
@pytest.mark.timeout(300)
def test_drift_bounded_under_loss_and_zero_after_resync() -> None:
    """1000 steps at 10% loss: the replica gap does not grow with t; resync zeroes it.

    The drift measured is the one packet loss causes, so no peer may be cut from a
    round for being slow: on a loaded machine a peer's thread starved past a 2 s
    collective timeout (or 1 s of heartbeats) was cut from one round and, since
    rounds are paired by call count (issue 19 part 1,
    ``test_optim_stall.py``), its final resync met the others' gradient round
    (``chunks_stale == 6``).  The timeouts here are therefore far above any
    starvation; no round reaches them at 10% loss (END markers end every phase),
    so the run is no longer for it.
    """
    steps, n_params = 1000, 4096

    def body(rank: int, peer: gossipnet.Peer) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.nn.Parameter(torch.zeros(n_params))
        opt = peer.optimizer(torch.optim.SGD([p], lr=0.1), resync_every_steps=0)
        gen = torch.Generator().manual_seed(1000 + rank)
        history = torch.empty(steps, n_params)
        for t in range(steps):
            p.grad = torch.randn(n_params, generator=gen)  # zero-mean noise: a random walk
            opt.step()
            history[t] = p.detach()
        rep = opt.resync()
        assert rep.chunks_stale == 0, rep
        return history, p.detach().clone()

    out = run_peers(
        3,
        body,
        faults=gossipnet.FaultPlan(loss=0.1, seed=11),
        collective_timeout_s=30.0,
        failure_timeout_s=30.0,
    )
    hist = torch.stack([o[0] for o in out])  # peers x steps x params
    gap = (hist.max(0).values - hist.min(0).values).max(-1).values  # per step
    early, late = gap[100:500].mean(), gap[500:].mean()
    assert gap[100:].max() > 0, "loss never caused drift: the fault plan did not apply"
    # bounded: the second half is not larger than the first (a random walk would grow ~sqrt(t))
    assert late < 1.5 * early, (float(early), float(late))
    finals = [o[1] for o in out]
    assert all(torch.equal(finals[0], f) for f in finals[1:]), "resync left a gap"


def test_a_replacement_optimizer_trains_on_and_stepping_two_in_turn_is_refused() -> None:
    """Its rounds are numbered by its steps on the peer's one engine, so two optimizers
    stepping in turn would claim each other's rounds (this failed inside a step, with
    'round id 2 was already run').  A replacement (a new stage, a checkpoint loaded
    into a fresh optimizer) trains on with identical replicas; going back to the first
    raises ConfigError at once, naming the fix."""

    def body(rank: int, peer: gossipnet.Peer) -> tuple[str, list[torch.Tensor]]:
        torch.manual_seed(rank)
        p = torch.nn.Parameter(torch.randn(300))
        first = peer.optimizer(torch.optim.SGD([p], lr=0.1))
        for _ in range(2):
            p.grad = torch.full_like(p, float(rank))
            assert first.step().ok
        second = peer.optimizer(torch.optim.SGD([p], lr=0.05))  # the first still alive
        snaps = []
        for _ in range(3):
            p.grad = torch.full_like(p, float(rank))
            rep = second.step()
            assert rep.ok, rep
            snaps.append(p.detach().clone())
        with pytest.raises(gossipnet.ConfigError, match="another optimizer stepped") as err:
            first.step()
        return str(err.value), snaps

    out = run_peers(3, body)
    assert "param groups" in out[0][0]
    for step in range(3):
        assert torch.equal(out[0][1][step], out[1][1][step])
        assert torch.equal(out[0][1][step], out[2][1][step])


@pytest.mark.timeout(60)
def test_the_sharded_step_is_the_base_optimizers_step_for_hooks_and_schedulers() -> None:
    """The all-reduce strategy never calls ``base.step()`` (each peer steps its shard);
    its step still runs as ``base``'s: a post-hook on ``base`` sees every step, after
    the new parameters are in place, and an LR scheduler on ``base`` does not warn
    that it ran before ``optimizer.step()`` (pytest turns warnings into errors)."""

    def body(rank: int, peer: gossipnet.Peer) -> tuple[int, list[bool], list[float]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        base = torch.optim.Adam(model.parameters(), lr=0.1)
        opt = peer.optimizer(base)
        sched = torch.optim.lr_scheduler.LambdaLR(base, lambda s: 0.5**s)
        hooked, moved = [0], []
        before = [flat_params(model)]

        def post(*_: Any) -> None:
            hooked[0] += 1
            moved.append(not torch.equal(flat_params(model), before[0]))

        base.register_step_post_hook(post)
        gen = torch.Generator().manual_seed(rank)
        lrs = []
        for _ in range(3):
            before[0] = flat_params(model)
            opt.zero_grad()
            model(torch.randn(4, 8, generator=gen)).square().sum().backward()
            opt.step()
            lrs.append(base.param_groups[0]["lr"])
            sched.step()
        return hooked[0], moved, lrs

    for hooked, moved, lrs in run_peers(3, body):
        assert hooked == 3
        assert moved == [True, True, True]
        assert lrs == pytest.approx([0.1, 0.05, 0.025])
