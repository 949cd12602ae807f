"""``all_reduce(..., step=opt)`` resyncs the optimizer's parameters (gossipnet/_step_resync.py).

Why these tests: a DDP-style loop over lossy rounds lets replicas drift apart (a lost
broadcast leaves a peer its own gradient), and replicas built from different seeds
never meet; both went unnoticed in the compression benchmark for several sessions.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing import run_peers

FAST = {"heartbeat_interval_s": 0.05, "failure_timeout_s": 1.0, "chunk_bytes": 1024}
SIZE = 3000  # three 1 KiB chunks per peer's share of the layout: loss hits some


def _model(rank: int) -> torch.nn.Parameter:
    """Rank-specific weights: replicas that start apart (no global RNG: peers are threads)."""
    return torch.nn.Parameter(torch.randn(SIZE, generator=torch.Generator().manual_seed(rank)))


def _grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(1000 * rank + step))


@pytest.mark.timeout(60)
def test_the_first_step_makes_replicas_that_started_apart_identical(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def body(rank: int, net: gossipnet.Peer) -> tuple[torch.Tensor, list[dict[str, float]]]:
        w = _model(rank)
        opt = torch.optim.SGD([w], lr=0.1)
        extras = []
        for step in range(3):
            w.grad = _grad(rank, step)
            rep = net.all_reduce([w.grad], step=opt)
            assert rep.ok, rep
            extras.append(rep.extra)
        return w.detach().clone(), extras

    with caplog.at_level(logging.WARNING, logger="gossipnet._step_resync"):
        out = run_peers(3, body, timeout_s=60, collective_timeout_s=5.0, **FAST)
    for w, _ in out[1:]:
        assert torch.equal(w, out[0][0]), "replicas still apart after the resyncs"
    for _, extras in out:
        assert extras[0]["resync"] == 1.0
        assert extras[0]["resync_moved"] > 0.1
        assert "resync" not in extras[1]  # every 100 by default
        assert "resync" not in extras[2]
    assert "started from different parameters" in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("contiguous", [False, True], ids=["params-apart", "params-in-one-storage"])
def test_the_resync_leaves_the_steps_exact(contiguous: bool) -> None:
    """Lossless, one start: each call's step is exactly SGD on the mean gradient, at the
    first call (resync before its round) and at the resync calls (after their step).
    The parameters have the gradients' shapes, so a resync that staged them in the
    call's cached buffer would overwrite the gradients staged there."""
    start = torch.randn(2, SIZE // 2, generator=torch.Generator().manual_seed(5))

    def body(rank: int, net: gossipnet.Peer) -> list[torch.Tensor]:
        if contiguous:  # one storage: the resync's flat buffer is the parameters' memory
            store = start.clone()
            ws = [torch.nn.Parameter(store[0]), torch.nn.Parameter(store[1])]
        else:
            ws = [torch.nn.Parameter(start[i].clone()) for i in range(2)]
        opt = torch.optim.SGD(ws, lr=0.5)
        seen = []
        for step in range(4):
            for i, w in enumerate(ws):
                w.grad = _grad(rank, 10 * step + i)[: SIZE // 2].clone()
            net.all_reduce([w.grad for w in ws], step=opt)
            seen.append(torch.cat([w.detach().reshape(-1) for w in ws]).clone())
        return seen

    out = run_peers(3, body, timeout_s=60, collective_timeout_s=5.0, resync_every_steps=2, **FAST)
    expect = start.reshape(-1).clone()
    for step in range(4):
        mean = (
            sum(
                torch.cat([_grad(r, 10 * step + i)[: SIZE // 2] for i in range(2)])
                for r in range(3)
            )
            / 3
        )
        expect -= 0.5 * mean
        for o in out:
            torch.testing.assert_close(o[step], expect, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "compress", [None, gossipnet.ArcTopK(density=0.2)], ids=["dense", "arctopk"]
)
def test_resyncs_repair_the_drift_of_lossy_rounds(compress: Any) -> None:
    """20% loss: between resyncs the replicas may part; every resync leaves them equal."""
    every, steps = 4, 9  # resyncs before call 0's round, after calls 4 and 8

    def body(rank: int, net: gossipnet.Peer) -> list[tuple[torch.Tensor, dict[str, float]]]:
        w = torch.nn.Parameter(torch.zeros(SIZE))  # the same start everywhere
        opt = torch.optim.Adam([w], lr=0.05)
        seen = []
        for step in range(steps):
            w.grad = _grad(rank, step)
            rep = net.all_reduce([w.grad], compress=compress, step=opt)
            seen.append((w.detach().clone(), dict(rep.extra)))
        return seen

    faults = gossipnet.FaultPlan(loss=0.2, seed=7)
    out = run_peers(
        3, body, timeout_s=90, faults=faults, collective_timeout_s=5.0,
        resync_every_steps=every, **FAST,
    )  # fmt: skip
    for step in range(steps):
        extras = [o[step][1] for o in out]
        due = step % every == 0
        assert all(("resync" in e) == due for e in extras), f"step {step}: {extras}"
        if due:
            assert all(e["resync_chunks_stale"] == 0 for e in extras), extras
        if due and step > 0:  # the first resync comes before its lossy round
            for o in out[1:]:
                assert torch.equal(o[step][0], out[0][step][0]), f"apart after resync {step}"
    assert all(o[0][1]["resync_moved"] == 0 for o in out)  # they started alike
    # the lossy rounds between resyncs did part them: the resyncs had work to do
    assert any(e["resync_moved"] > 0 for o in out for _, e in o[1:] if "resync" in e)


@pytest.mark.timeout(90)
def test_an_explicit_resync_ends_training_with_one_model() -> None:
    """``net.resync(opt)`` after lossy steps (no scheduled resync since the first):
    the replicas had parted, and leave it bit-identical."""

    def body(rank: int, net: gossipnet.Peer) -> tuple[torch.Tensor, torch.Tensor, float]:
        w = torch.nn.Parameter(torch.zeros(SIZE))
        opt = torch.optim.SGD([w], lr=0.1)
        for step in range(6):
            w.grad = _grad(rank, step)
            net.all_reduce([w.grad], step=opt)
        before = w.detach().clone()
        rep = net.resync(opt)
        assert rep.method == "resync"
        assert rep.chunks_stale == 0, rep
        return before, w.detach().clone(), rep.extra["resync_moved"]

    faults = gossipnet.FaultPlan(loss=0.2, seed=11)
    out = run_peers(
        3, body, timeout_s=90, faults=faults, collective_timeout_s=5.0,
        resync_every_steps=0, **FAST,
    )  # fmt: skip
    assert any(not torch.equal(o[0], out[0][0]) for o in out[1:])  # loss had parted them
    for o in out[1:]:
        assert torch.equal(o[1], out[0][1])
    assert max(o[2] for o in out) > 0
    # an average of what arrived (a lost contribution is left out, not repaired;
    # the broadcasts are): every value within the replicas' range, no peer's copy
    before = torch.stack([o[0] for o in out])
    after = out[0][1]
    assert bool((after >= before.min(0).values - 1e-6).all())
    assert bool((after <= before.max(0).values + 1e-6).all())
    assert all(not torch.equal(after, o[0]) for o in out)


@pytest.mark.timeout(90)
def test_replicas_agree_after_an_explicit_resync() -> None:
    """``net.replicas_agree()`` on the ``step=`` path: after ``net.resync(opt)`` every
    peer compares the resync's digests and finds every replica the same (before, it
    raised ``ConfigError`` asking for ``opt.resync()``, which a torch optimizer lacks)."""

    def body(rank: int, net: gossipnet.Peer) -> tuple[Any, str]:
        w = torch.nn.Parameter(torch.zeros(SIZE))
        opt = torch.optim.SGD([w], lr=0.1)
        for step in range(4):
            w.grad = _grad(rank, step)
            net.all_reduce([w.grad], step=opt)
        rep = net.resync(opt)
        check = net.replicas_agree(timeout=10.0)
        return check, str(rep.round)

    faults = gossipnet.FaultPlan(loss=0.2, seed=3)
    out = run_peers(
        3, body, timeout_s=90, faults=faults, collective_timeout_s=5.0,
        resync_every_steps=0, **FAST,
    )  # fmt: skip
    for check, rid in out:
        assert check, check
        assert check.missing == ()
        assert check.disagree == ()
        assert str(check.round_id) == rid  # the digest of that very resync
        assert sorted(check.digests) == ["p0", "p1", "p2"]
    assert len({check.majority for check, _ in out}) == 1


@pytest.mark.timeout(90)
def test_the_catch_up_step_is_the_optimizers_step_for_hooks_and_schedulers() -> None:
    """ArcTopK with Adam takes the catch-up step instead of ``opt.step()``; it runs as
    the optimizer's step: its post-hooks see every call, and an LR scheduler stepped
    after each call does not warn that it ran before ``optimizer.step()`` (pytest
    turns warnings into errors) and moves the learning rate as planned."""

    def body(rank: int, net: gossipnet.Peer) -> tuple[list[float], int, list[float]]:
        w = torch.nn.Parameter(torch.zeros(SIZE))
        opt = torch.optim.Adam([w], lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        hooked = [0]
        opt.register_step_post_hook(lambda *_: hooked.__setitem__(0, hooked[0] + 1))
        lrs, caught = [], []
        for step in range(3):
            w.grad = _grad(rank, step)
            rep = net.all_reduce([w.grad], compress=gossipnet.ArcTopK(density=0.2), step=opt)
            caught.append(rep.extra["catch_up"])
            lrs.append(opt.param_groups[0]["lr"])  # the lr this step used
            sched.step()
        return lrs, hooked[0], caught

    out = run_peers(3, body, timeout_s=90, collective_timeout_s=5.0, **FAST)
    for lrs, hooked, caught in out:
        assert caught == [1.0, 1.0, 1.0]  # the catch-up step ran, not opt.step()
        assert hooked == 3
        assert lrs == pytest.approx([0.1, 0.05, 0.025])


@pytest.mark.timeout(90)
def test_step_rounds_send_parity_while_loss_is_seen() -> None:
    """At 20% loss a dense ``all_reduce(grads, step=opt)`` round is a training step's:
    XOR parity as in ``net.optimizer`` (``Config.parity_for(optimizer=True)``); a
    plain ``all_reduce`` of the same tensors keeps the default of none."""

    def body(rank: int, net: gossipnet.Peer) -> tuple[float, float, float]:
        w = torch.nn.Parameter(torch.zeros(SIZE))
        opt = torch.optim.SGD([w], lr=0.1)
        stepped = plain = recovered = 0.0
        for step in range(4):
            w.grad = _grad(rank, step)
            rep = net.all_reduce([w.grad], step=opt)
            stepped += rep.extra["parity_sent"]
            recovered += rep.extra["recovered"]
            plain += net.all_reduce([_grad(rank, 100 + step)]).extra["parity_sent"]
        return stepped, recovered, plain

    faults = gossipnet.FaultPlan(loss=0.2, seed=5)
    out = run_peers(
        3, body, timeout_s=90, faults=faults, collective_timeout_s=5.0,
        resync_every_steps=0, **FAST,
    )  # fmt: skip
    assert all(stepped > 0 for stepped, _, _ in out), out
    assert sum(recovered for _, recovered, _ in out) > 0, out  # and it rebuilt some
    assert all(plain == 0 for _, _, plain in out), out
