"""Compressed training end to end: joined peers (own loop threads) on a memory network.

``net.optimizer(base, compress=...)`` and ``net.all_reduce(..., compress=...)``
with a local step, at 0% and seeded 10% loss: the loss falls, replicas agree
after a resync (optimizer) or stay bit-identical (lossless all-reduce), the
report carries bytes and the ratio, and bad arguments are ConfigErrors.
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
STEPS = 40


def run_peers(n: int, body: Callable[[int, gossipnet.Peer], Any], **config: Any) -> list[Any]:
    return _run_peers(n, body, timeout_s=90, **{**FAST, **config})


def _task(rank: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        x = torch.randn(64, 16, generator=gen)
        return torch.nn.functional.mse_loss(model(x), x @ w)

    return model, loss


@pytest.mark.timeout(120)  # ~5 s on 2 idle cores; bounds a hang
@pytest.mark.parametrize(
    "spec",
    [
        gossipnet.ArcTopK(density=0.05),
        gossipnet.ArcTopK(density=0.05, values="int8"),  # int8 gradients, float32 parameters
        "bf16",
        gossipnet.Int8(),
    ],
    ids=str,
)
def test_optimizer_trains_with_compression_under_loss(spec: Any) -> None:
    def body(rank: int, peer: gossipnet.Peer) -> tuple[list[float], list[dict[str, float]]]:
        model, loss_fn = _task(rank)
        opt = peer.optimizer(torch.optim.SGD(model.parameters(), lr=0.05), compress=spec)
        losses, extras = [], []
        for _ in range(STEPS):
            loss = loss_fn()
            opt.zero_grad()
            loss.backward()
            rep = opt.step()
            losses.append(float(loss.detach()))
            extras.append(dict(rep.extra))
        return losses, extras

    out = run_peers(3, body, faults=gossipnet.FaultPlan(loss=0.1, seed=5), collective_timeout_s=2.0)
    for losses, extras in out:
        assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
        grads = [x for x in extras if "compression_ratio" in x]
        assert len(grads) >= STEPS - 1  # the step-0 resync is dense
        assert all(x["bytes_sent"] > 0 for x in grads)
        assert max(x["compression_ratio"] for x in grads) > 1.0
        # a lost update is not estimated: no later broadcast would overwrite the estimate
        assert sum(x.get("estimated", 0.0) for x in grads) == 0
        if isinstance(spec, gossipnet.ArcTopK):
            assert all(x["index_mismatch"] >= 0 for x in grads)


@pytest.mark.timeout(120)  # ~5 s on 2 idle cores; bounds a hang
@pytest.mark.parametrize("adam", [False, True], ids=["sgd-then-step", "adamw-step-in-call"])
def test_all_reduce_with_local_step_lossless_is_bit_identical(adam: bool) -> None:
    """A DDP-style loop (compressed gradient all-reduce, then a local step) from one
    init: without loss every replica applies the same values, bit for bit.  With
    ``all_reduce(..., step=AdamW)`` the catch-up step runs every round (each value
    stepped as the rounds it stands for, the ages from the owners' broadcasts,
    which every peer received)."""

    # the same init everywhere, made once here: torch's global RNG is shared by the
    # peers' threads, so seeding it in each body raced (replicas started apart)
    init = _task(0)[0].state_dict()

    def body(
        rank: int, peer: gossipnet.Peer
    ) -> tuple[torch.Tensor, float, float, list[dict[str, float]]]:
        model, _ = _task(0)
        model.load_state_dict(init)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=0.01) if adam else torch.optim.SGD(params, lr=0.05)
        w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
        spec = gossipnet.ArcTopK(density=0.1, values="int8" if adam else "fp32")
        losses, extras = [], []
        for step in range(STEPS):
            x = torch.randn(64, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
            loss = torch.nn.functional.mse_loss(model(x), x @ w)
            losses.append(float(loss.detach()))
            opt.zero_grad()
            loss.backward()
            grads = [p.grad for p in params]
            rep = peer.all_reduce(grads, compress=spec, step=opt if adam else None)  # type: ignore[arg-type]
            assert rep.chunks_stale == 0
            extras.append(dict(rep.extra))
            if not adam:
                opt.step()
        flat = torch.cat([p.detach().flatten() for p in params])
        return flat, sum(losses[:5]), sum(losses[-5:]), extras

    out = run_peers(4, body)
    for flat, first, last, extras in out:
        assert torch.equal(flat, out[0][0])
        assert last < 0.5 * first
        assert extras[-1]["compression_ratio"] > 2.0
        assert [x.get("catch_up", 0.0) for x in extras] == [float(adam)] * STEPS
    with pytest.raises(gossipnet.ConfigError, match="'bf16', 'fp16'"):
        gossipnet.AllReduceOptions(compress="topk")


@pytest.mark.timeout(120)  # ~5 s on 2 idle cores; bounds a hang
def test_optimizer_adamw_takes_the_catch_up_step_under_loss() -> None:
    """``net.optimizer(AdamW, compress=ArcTopK)`` at seeded 10% loss: the owners step
    their shards with the catch-up rule (``extra["catch_up"]``) and the loss falls;
    with ``catch_up=False`` the stock step runs."""

    def body(rank: int, peer: gossipnet.Peer) -> tuple[list[float], list[float], list[float]]:
        model, loss_fn = _task(rank)
        losses, caught, plain = [], [], []
        for flag, sink in ((True, caught), (False, plain)):
            base = torch.optim.AdamW(model.parameters(), lr=0.01)
            spec = gossipnet.ArcTopK(density=0.05, catch_up=flag)
            opt = peer.optimizer(base, compress=spec)
            for _ in range(STEPS // 2):
                loss = loss_fn()
                opt.zero_grad()
                loss.backward()
                rep = opt.step()
                losses.append(float(loss.detach()))
                if "catch_up" in rep.extra:
                    sink.append(rep.extra["catch_up"])
        return losses, caught, plain

    out = run_peers(3, body, faults=gossipnet.FaultPlan(loss=0.1, seed=7), collective_timeout_s=2.0)
    for losses, caught, plain in out:
        assert sum(losses[STEPS // 2 - 5 : STEPS // 2]) < 0.5 * sum(losses[:5]), losses
        assert caught
        assert sum(caught) >= len(caught) - 2
        assert plain
        assert sum(plain) == 0


def test_compress_arguments_are_checked() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> None:
        with pytest.raises(gossipnet.ConfigError, match=r"gossipnet\.ArcTopK"):
            peer.all_reduce([torch.zeros(4)], compress="int4")
        with pytest.raises(gossipnet.ConfigError, match=r"accepts compress=gossipnet\.SparQ"):
            peer.optimizer(
                torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
                strategy="moshpit",
                compress="bf16",
            )
        with pytest.raises(gossipnet.ConfigError, match="method='allreduce'"):
            peer.average([torch.zeros(4)], method="moshpit", compress="bf16")

    run_peers(2, body)
