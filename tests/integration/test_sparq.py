"""SPARQ-SGD with the gossip strategies, end to end: joined in-memory peers, seeded loss.

Each peer runs its own event-loop thread (``run_peers``) over a MemoryNetwork whose
links drop packets by a seeded ``FaultPlan``.  What must hold: with Moshpit groups,
replicas that start apart reach consensus once loss stops (their copies of each
other exact again, the spread down by 20x); with route gossip, training converges
under 10% loss; the event trigger really withholds sends; reports carry the bytes,
the ratio, the trigger and the resync counters.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet import FaultPlan, SparQ
from gossipnet.testing import run_peers
from tests.integration.test_route_strategy import FAST, RADIO, SCHEDULE, city_routes

KEYS = {"bytes_sent", "bytes_dense", "compression_ratio", "triggered", "stale_neighbours"}


def seeded_linear(n_in: int, n_out: int, seed: int) -> torch.nn.Linear:
    """A Linear layer initialised from its own generator: torch's global RNG is shared
    by the peers' threads, so ``manual_seed`` then ``Linear`` races between them."""
    model = torch.nn.Linear(n_in, n_out)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def spread(xs: list[torch.Tensor]) -> float:
    mean = torch.stack(xs).mean(0)
    return max(float((x - mean).norm()) for x in xs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [3, 4])
def test_moshpit_replicas_reach_consensus_after_loss_stops(seed: int) -> None:
    n, lossy_steps, steps = 4, 12, 40
    calm = threading.Event()  # set once a peer is past the lossy steps
    plan = FaultPlan(seed=seed, link_loss=lambda s, d, t: 0.0 if calm.is_set() else 0.1)
    sparq = SparQ(density=0.2, gamma=0.5, repair_wait_s=0.3)

    def body(rank: int, net: gossipnet.Peer) -> Any:
        torch.manual_seed(rank)  # replicas start apart: only gossip brings them together
        model = torch.nn.Linear(100, 40)
        start = flat(model)
        opt = net.optimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), strategy="moshpit",
            sync_state=False, compress=sparq,
        )  # fmt: skip
        reports = []
        for step in range(steps):
            if step == lossy_steps:
                calm.set()
            reports.append(opt.step())
        return start, flat(model), reports

    out = run_peers(n, body, timeout_s=50, faults=plan, **FAST)
    starts, ends = [o[0] for o in out], [o[1] for o in out]
    assert spread(ends) < 0.05 * spread(starts), (spread(starts), spread(ends))
    for _, _, reports in out:
        assert all(r.method == "sparq" for r in reports)
        assert set(reports[-1].extra) >= KEYS
        assert reports[-1].extra["stale_neighbours"] == 0  # copies exact again
        assert reports[-1].extra["neighbours"] == n - 1  # one group of 4
    last = [r.extra for _, _, reports in out for r in reports[-1:]]
    assert sum(e.get("resync_nacks_sent", 0) for e in last) > n  # loss was repaired


@pytest.mark.timeout(60)
def test_route_sparq_trains_under_loss() -> None:
    routes = city_routes()
    true_w = torch.randn(8, 30, generator=torch.Generator().manual_seed(0))
    sparq = SparQ(density=0.25, gamma=0.5, repair_wait_s=0.2)

    def body(rank: int, net: gossipnet.Peer) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Linear(30, 8)
        net.set_route(routes[rank], radio=RADIO, schedule=SCHEDULE)
        opt = net.optimizer(
            torch.optim.SGD(model.parameters(), lr=0.2), strategy="route",
            average_every=2, compress=sparq,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        losses, reports = [], []
        for _ in range(30):
            x = torch.randn(64, 30, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x @ true_w.T)
            opt.zero_grad()
            loss.backward()
            reports.append(opt.step())
            losses.append(float(loss.detach()))
        return losses, reports

    out = run_peers(4, body, timeout_s=50, faults=FaultPlan(seed=5, loss=0.1), **FAST)
    for losses, reports in out:
        assert losses[-1] < 0.2 * losses[0], losses
        assert [r.method for r in reports[:2]] == ["local", "sparq"]
        gossip = [r for r in reports if r.method == "sparq"]
        assert all(set(r.extra) >= KEYS for r in gossip)
        assert all(r.extra["bytes_sent"] >= 0 for r in gossip)
    assert any(r.extra["neighbours"] > 0 for _, reps in out for r in reps if r.method == "sparq")


@pytest.mark.timeout(60)
def test_the_trigger_withholds_differences() -> None:
    """A threshold no change reaches: nobody sends a DELTA, only ENDs (and the first
    contact's refresh); with c0 = 0 every sync sends."""

    def run(c0: float) -> list[dict[str, float]]:
        def body(rank: int, net: gossipnet.Peer) -> Any:
            torch.manual_seed(0)
            model = torch.nn.Linear(50, 20)
            opt = net.optimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), strategy="moshpit",
                sync_state=False, compress=SparQ(threshold_c0=c0, repair_wait_s=0.1),
            )  # fmt: skip
            gen = torch.Generator().manual_seed(rank)
            reports = []
            for _ in range(6):
                opt.zero_grad()
                model(torch.randn(16, 50, generator=gen)).square().mean().backward()
                reports.append(dict(opt.step().extra))
            return reports

        return [e for reps in run_peers(3, body, timeout_s=40, **FAST) for e in reps]

    never, always = run(1e12), run(0.0)
    assert all(e["triggered"] == 0 and e["delta_packets"] == 0 for e in never)
    assert all(e["triggered"] == 1 and e["delta_packets"] > 0 for e in always)
    assert sum(e["bytes_sent"] for e in never[3:]) < sum(e["bytes_sent"] for e in always[3:])


@pytest.mark.timeout(60)
def test_a_lossless_run_replays_bit_for_bit() -> None:
    """Same seeds, no loss: the same parameters twice.  Why it can fail: a copy first
    refreshed (or repaired) from an estimate that its sender had already moved on, or
    a faster neighbour's next-round DELTA entering this round's mix, would make the
    result depend on thread timing; the introduction round and the parking of later
    rounds' packets exist to prevent exactly that."""

    def run() -> list[torch.Tensor]:
        def body(rank: int, net: gossipnet.Peer) -> torch.Tensor:
            model = seeded_linear(64, 32, rank)
            opt = net.optimizer(
                torch.optim.SGD(model.parameters(), lr=0.01), strategy="moshpit",
                sync_state=False, compress=SparQ(density=0.2, gamma=0.5),
            )  # fmt: skip
            gen = torch.Generator().manual_seed(rank)
            for _ in range(8):
                opt.zero_grad()
                model(torch.randn(8, 64, generator=gen)).square().mean().backward()
                opt.step()
            return flat(model)

        return run_peers(3, body, timeout_s=40, **FAST)

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert spread(first) > 0  # not trivially equal: replicas started apart
