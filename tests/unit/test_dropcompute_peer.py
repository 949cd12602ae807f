"""``net.microbatches`` + ``opt.step()`` over the real lossy all-reduce (MemoryNetwork).

Known per-micro-batch gradients and counts go in; with SGD at lr 1 the
parameter change is exactly the averaged gradient, which must equal the
weighted mean (ALGORITHMS.md 3.5.1).  Each peer drives its cut with its own
FakeClock; the network runs on real time in the peers' loop threads.  Under a
stalled peer the steps last about tau, not the stall, and the stalled peer
contributes exactly what it completed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import gossipnet
from gossipnet.clock import FakeClock
from gossipnet.testing import run_peers as _run_peers
from gossipnet.testing.noise import LogNormalDelay, NoisePlan, Stall
from gossipnet.training.autotau import AutoTau, AutoTauConfig
from gossipnet.training.dropcompute import Normalise
from gossipnet.training.microbatch import gather_rows

FAST = {"heartbeat_interval_s": 0.05, "failure_timeout_s": 1.0, "collective_timeout_s": 5.0}
K = 4


def run_peers(n: int, body: Callable[[int, gossipnet.Peer], Any], **config: Any) -> list[Any]:
    """``gossipnet.testing.run_peers`` with this module's fast settings."""
    return _run_peers(n, body, timeout_s=30, **{**FAST, **config})


def grads_of(rank: int) -> torch.Tensor:
    """Per-micro-batch gradients of peer ``rank``: [K, 6], multiples of 1/8 (exact in fp32)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-16, 16, (K, 6), generator=g).float() / 8


def one_step(
    peer: gossipnet.Peer, items: int, tau: float | None, normalise: Normalise
) -> tuple[torch.Tensor, gossipnet.CollectiveReport]:
    """One step of w <- w - mean grad with loss_m = <w, c_m>, so grad_m = c_m."""
    w = torch.nn.Parameter(torch.zeros(6))
    opt = peer.optimizer(torch.optim.SGD([w], lr=1.0))
    clock = FakeClock()
    rank = int(peer.peer_id[1:])
    for c in peer.microbatches(
        grads_of(rank)[:items],
        max_microbatches=K,
        tau=tau,
        normalise=normalise,
        clock=clock,
    ):
        (w * c).sum().backward()  # the micro-batch's mean loss, no 1/K
        clock.advance(1.0)
    rep = opt.step()
    return -w.detach().clone(), rep


# peer 0: all K; peer 1: cut by tau after 2; peer 2: an empty step (weight 0)
SETUP = {0: (K, None), 1: (K, 1.5), 2: (0, None)}
DONE = {0: K, 1: 2, 2: 0}


@pytest.mark.parametrize("normalise", ["completed", "full"])
def test_normalisation_is_exact(normalise: Normalise) -> None:
    def body(rank: int, peer: gossipnet.Peer) -> tuple[torch.Tensor, dict[str, float]]:
        items, tau = SETUP[rank]
        g, rep = one_step(peer, items, tau, normalise)
        assert peer.last_microbatch_report is not None
        return g, rep.extra

    out = run_peers(3, body)
    total = sum(grads_of(r)[: DONE[r]].sum(0) for r in range(3))
    denom = sum(DONE.values()) if normalise == "completed" else 3 * K
    for g, extra in out:
        torch.testing.assert_close(g, total / denom, rtol=1e-6, atol=1e-7)
        assert np.isfinite(list(extra.values())).all() or extra["tau_s"] == float("inf")
    extras = [e for _, e in out]
    assert [e["mb_completed"] for e in extras] == [4.0, 2.0, 0.0]
    assert extras[1]["tau_s"] == 1.5
    assert extras[1]["mb_drop_rate"] == 0.5
    assert extras[0]["tau_s"] == float("inf")
    want_w = [4.0, 2.0, 0.0] if normalise == "completed" else [1.0, 1.0, 1.0]
    assert [e["mb_weight"] for e in extras] == want_w


def test_all_peers_with_no_microbatch_change_nothing() -> None:
    out = run_peers(2, lambda r, p: one_step(p, 0, None, "completed")[0])
    for g in out:
        assert torch.equal(g, torch.zeros(6))  # all weights 0: own (zero) values kept, no NaN


def test_explicit_weight_and_plain_steps_are_unchanged() -> None:
    """step(weight=...) sends gradients as they are; a step without a loop has weight 1."""

    def body(rank: int, peer: gossipnet.Peer) -> list[torch.Tensor]:
        w = torch.nn.Parameter(torch.zeros(2))
        opt = peer.optimizer(torch.optim.SGD([w], lr=1.0))
        out = []
        for weight in (None, 3.0 if rank else 1.0):
            before = w.detach().clone()
            w.grad = torch.full((2,), float(rank + 1))
            opt.step(weight=weight)
            opt.zero_grad()
            out.append(before - w.detach())
        return out

    a, b = run_peers(2, body)
    for res in (a, b):
        torch.testing.assert_close(res[0], torch.full((2,), 1.5))  # (1 + 2) / 2
        torch.testing.assert_close(res[1], torch.full((2,), (1 + 3 * 2) / 4))


def test_gather_rows_recovers_every_peers_timings() -> None:
    def rows_of(rank: int) -> np.ndarray:
        r = np.arange(30, dtype=float).reshape(10, 3) * 0.001 + rank
        r[rank, 1:] = np.nan  # a cut step
        return r[3:] if rank == 2 else r  # a shorter history: padded to the capacity

    def body(rank: int, peer: gossipnet.Peer) -> list[np.ndarray]:
        return gather_rows(peer._training_host, rows_of(rank), capacity=10)

    # 64-byte chunks: each slot spans several chunks, each piece with its chunk's marker
    for got in run_peers(3, body, chunk_bytes=64):
        assert len(got) == 3
        by_rank = sorted(got, key=lambda r: r[0, 0])
        for rank, rows in enumerate(by_rank):
            np.testing.assert_allclose(rows, rows_of(rank), rtol=1e-6, equal_nan=True)


def test_auto_tau_is_the_same_on_every_peer() -> None:
    """Warm-up, timed window, then one tau from everyone's timings; per-step reports."""
    plan = NoisePlan(base_s=1.0, lognormal=LogNormalDelay(delay_factor=4.0, sigma=1.5), seed=1)
    cfg = AutoTauConfig(
        warmup_steps=1, window_steps=6, reestimate_every_steps=3, min_microbatches=1
    )

    spent = [0.0] * 3
    lockstep = threading.Barrier(3, timeout=30)

    def body(rank: int, peer: gossipnet.Peer) -> tuple[list[float | None], list[float]]:
        clock = FakeClock()
        auto = AutoTau(cfg)
        w = torch.nn.Parameter(torch.zeros(3))
        opt = peer.optimizer(torch.optim.SGD([w], lr=0.1))
        taus, drops = [], []
        for step in range(12):
            times = plan.times(rank, step, K)
            start = clock.now()
            for i, c in enumerate(peer.microbatches(range(K), K, tau=auto, clock=clock)):
                (w * c).sum().backward()
                clock.advance(float(times[i]))
            opt.step()
            opt.zero_grad()
            spent[rank] = clock.now() - start
            lockstep.wait()  # a step lasts the slowest peer's compute + 1 s, on every peer
            clock.advance(start + max(spent) + 1.0 - clock.now())
            lockstep.wait()
            rep = peer.last_microbatch_report
            assert rep is not None
            taus.append(rep.tau_s)
            drops.append(rep.drop_rate)
        return taus, drops

    out = run_peers(3, body)
    taus0 = out[0][0]
    assert taus0[:7] == [None] * 7
    assert all(t is not None for t in taus0[7:])
    for taus, _ in out[1:]:
        assert taus == pytest.approx(taus0)  # same gathered timings -> same tau
    assert max(d for _, drops in out for d in drops) > 0


# a stalled peer: 20 micro-batches of 40 ms (0.8 s < tau); peer 2's take 125x longer in
# steps 1-2 (5 s each, 100 s per uncut step); steps 0 and 3 are unstalled
STALL_K, STALL_TAU, STALL_STEPS = 20, 1.0, 4
STALL_PLAN = NoisePlan(
    base_s=0.04, seed=7, stalls=(Stall(peer=2, start_step=1, steps=2, factor=125.0),)
)


def stall_grads(rank: int, step: int) -> torch.Tensor:
    """Per-micro-batch gradients [STALL_K, 6], multiples of 1/8 (sums exact in fp32)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(-16, 16, (STALL_K, 6), generator=g).float() / 8


@pytest.mark.timeout(60)
def test_stalled_peer_step_time_stays_near_tau_over_the_network() -> None:
    """Networked twin of test_dropcompute.py's simulate_fleet stall test: 3 peers, fixed
    tau, real all-reduce; a step lasts the slowest peer's compute (lockstep on fake time)."""
    spent = [0.0] * 3
    lockstep = threading.Barrier(3, timeout=30)

    def body(rank: int, peer: gossipnet.Peer) -> list[tuple[float, float, dict[str, float], Any]]:
        clock = FakeClock()
        w = torch.nn.Parameter(torch.zeros(6))
        opt = peer.optimizer(torch.optim.SGD([w], lr=1.0))
        out = []
        for step in range(STALL_STEPS):
            times = STALL_PLAN.times(rank, step, STALL_K)
            start = clock.now()
            loop = peer.microbatches(stall_grads(rank, step), STALL_K, tau=STALL_TAU, clock=clock)
            for i, c in enumerate(loop):
                (w * c).sum().backward()
                clock.advance(float(times[i]))
            before = w.detach().clone()
            extra = dict(opt.step().extra)
            opt.zero_grad()
            spent[rank] = clock.now() - start
            lockstep.wait()  # the synchronous step ends when the slowest peer's compute does
            clock.advance(start + max(spent) - clock.now())
            lockstep.wait()
            out.append((spent[rank], clock.now() - start, extra, before - w.detach()))
        return out

    out = run_peers(3, body)
    for step in range(STALL_STEPS):
        times = [STALL_PLAN.times(r, step, STALL_K) for r in range(3)]
        stalled = step in (1, 2)
        if stalled:
            assert times[2].sum() == pytest.approx(100.0)  # what an uncut step would wait for
        done = [int(out[r][step][2]["mb_completed"]) for r in range(3)]
        assert done == ([STALL_K, STALL_K, 1] if stalled else [STALL_K] * 3)
        longest = max(float(t.max()) for t in times)
        for r in range(3):
            own, step_s, extra, _ = out[r][step]
            assert extra["tau_s"] == STALL_TAU
            assert own <= STALL_TAU + float(times[r].max()) + 1e-6  # one micro-batch past tau
            assert step_s <= STALL_TAU + longest + 1e-6
            assert step_s == pytest.approx(5.0 if stalled else 0.8)  # not the 100 s stall
            # the stalled peer's weight is what it completed (the first micro-batch always runs)
            assert extra["mb_weight"] == float(done[r])
        # every peer applied sum(completed gradients) / (micro-batches done everywhere)
        total = sum(stall_grads(r, step)[: done[r]].sum(0) for r in range(3))
        for r in range(3):
            torch.testing.assert_close(out[r][step][3], total / sum(done), rtol=1e-5, atol=1e-6)
