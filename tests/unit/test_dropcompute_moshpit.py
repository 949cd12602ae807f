"""DropCompute composes with ``strategy="moshpit"`` (ALGORITHMS.md: it changes only how
many micro-batches enter the local gradient and, optionally, the normaliser).

Three MemoryNetwork peers form one Moshpit group; with SGD at lr 1, no momentum
and ``average_every=1``, the averaged parameter change must be exactly the
all-reduce strategy's: the sum of every completed micro-batch's gradient divided
by the micro-batches done everywhere (``"completed"``) or by N * K (``"full"``).
Before the fix the moshpit step ignored the loop's count: it applied the raw sum.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.clock import FakeClock
from gossipnet.testing import run_peers
from gossipnet.training.dropcompute import Normalise

pytestmark = pytest.mark.timeout(60)

FAST = {"heartbeat_interval_s": 0.05, "failure_timeout_s": 2.0, "collective_timeout_s": 5.0}
K = 4
# peer 0: all K; peer 1: cut by tau after 2; peer 2: an empty step (weight 0)
SETUP = {0: (K, None), 1: (K, 1.5), 2: (0, None)}
DONE = {0: K, 1: 2, 2: 0}


def grads_of(rank: int) -> torch.Tensor:
    """Per-micro-batch gradients of peer ``rank``: [K, 6], multiples of 1/8 (exact in fp32)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-16, 16, (K, 6), generator=g).float() / 8


@pytest.mark.parametrize("normalise", ["completed", "full"])
def test_moshpit_step_is_normalised_like_the_allreduce(normalise: Normalise) -> None:
    def body(rank: int, peer: gossipnet.Peer) -> tuple[torch.Tensor, dict[str, float], str]:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.zeros(6))
        opt = peer.optimizer(torch.optim.SGD([w], lr=1.0), strategy="moshpit", sync_state=False)
        clock = FakeClock()
        items, tau = SETUP[rank]
        for c in peer.microbatches(
            grads_of(rank)[:items], K, tau=tau, normalise=normalise, clock=clock
        ):
            (w * c).sum().backward()  # the micro-batch's mean loss, no 1/K
            clock.advance(1.0)
        rep = opt.step()
        return -w.detach().clone(), dict(rep.extra), rep.method

    out = run_peers(3, body, timeout_s=40, **FAST)
    total = sum(grads_of(r)[: DONE[r]].sum(0) for r in range(3))
    denom = sum(DONE.values()) if normalise == "completed" else 3 * K
    for g, extra, method in out:
        assert method == "moshpit"
        torch.testing.assert_close(g, total / denom, rtol=1e-6, atol=1e-7)
        assert extra["mb_max"] == K
    assert [e["mb_completed"] for _, e, _ in out] == [4.0, 2.0, 0.0]
    want_w = [4.0, 2.0, 0.0] if normalise == "completed" else [1.0, 1.0, 1.0]
    assert [e["mb_weight"] for _, e, _ in out] == want_w


def test_moshpit_window_weight_is_the_mean_count_and_explicit_weight_is_kept() -> None:
    """average_every=2: the averaging weight is the window's mean micro-batch count; an
    explicit ``weight`` leaves gradients unscaled (as the all-reduce strategy does)."""

    def body(rank: int, peer: gossipnet.Peer) -> list[Any]:
        w = torch.nn.Parameter(torch.zeros(1))
        opt = peer.optimizer(
            torch.optim.SGD([w], lr=1.0), strategy="moshpit", average_every=2, sync_state=False
        )
        for step in range(2):  # peer 0 completes 1 micro-batch per step, peer 1 completes 3
            n = 1 if rank == 0 else 3
            for _ in peer.microbatches(range(n), K):
                (w * float(rank + 1)).sum().backward()
            opt.step()
            opt.zero_grad()
            assert opt.step_count == step + 1
        after_loops = w.detach().clone()
        w.grad = torch.full((1,), 2.0 * (rank + 1))
        opt.step(weight=1.0 + rank)
        w.grad = torch.zeros(1)
        rep = opt.step(weight=1.0 + rank)
        return [after_loops, w.detach().clone(), rep.method]

    a, b = run_peers(2, body, timeout_s=40, **FAST)
    # per step each peer applies its mean gradient (rank + 1), twice; window weights 1 and 3
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[0], torch.tensor([-(2 * 1 * 1 + 2 * 2 * 3) / 4]))
    # explicit weights 1 and 2 (each window mean), raw gradients 2 and 4
    start = a[0]
    want = start - (2.0 * 1 + 4.0 * 2) / 3
    torch.testing.assert_close(a[1], want)
    torch.testing.assert_close(b[1], want)
    assert a[2] == b[2] == "moshpit"


def test_route_step_scales_gradients_by_microbatches_done() -> None:
    """``strategy="route"`` takes the loop's mean gradient too (not the raw sum): two
    parked peers out of radio range of each other are isolated, so each step is
    exactly a local SGD step on sum / done (or sum / K with ``normalise="full"``)."""
    import numpy as np

    from gossipnet import RadioModel, Route

    far = [Route(np.array([0.0]), np.array([[0.0, 0.0]])),
           Route(np.array([0.0]), np.array([[50_000.0, 0.0]]))]  # fmt: skip

    def body(rank: int, peer: gossipnet.Peer) -> tuple[torch.Tensor, torch.Tensor, str]:
        peer.set_route(far[rank], radio=RadioModel())
        w = torch.nn.Parameter(torch.zeros(6))
        opt = peer.optimizer(torch.optim.SGD([w], lr=1.0), strategy="route")
        clock = FakeClock()
        items, tau = SETUP[rank]
        for c in peer.microbatches(grads_of(rank)[:items], K, tau=tau, clock=clock):
            (w * c).sum().backward()
            clock.advance(1.0)
        rep = opt.step()
        return -w.detach().clone(), grads_of(rank)[: DONE[rank]].sum(0), rep.method

    for rank, (g, total, _) in enumerate(run_peers(2, body, timeout_s=40, **FAST)):
        torch.testing.assert_close(g, total / DONE[rank], rtol=1e-6, atol=1e-7)
