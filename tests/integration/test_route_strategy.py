"""``method="route"`` / ``strategy="route"``: route-aware gossip between joined peers.

Five in-process peers (MemoryNetwork, one event-loop thread each, as under
``gossipnet.join``) drive or park on a 2x2-block grid city (100 m blocks).  They share
their routes over the transport, plan the same matchings from them, and gossip
(ALGORITHMS.md section 4).  The lossless run is checked against the plan's own
mixing matrix, computed here from the same routes: both ends of every link apply
the same Metropolis-Hastings weights, so the mean is kept exactly.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import gossipnet
from gossipnet import ConfigError, RadioModel, Route
from gossipnet.mobility import ScheduleConfig, plan_round, round_mixing_matrix
from gossipnet.testing import radio_faults, run_peers

N = 5
FAST = {
    "heartbeat_interval_s": 0.05,
    "failure_timeout_s": 0.5,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 10.0,
    "handle_sigterm": False,
}
#: A 1 s handshake makes every planned phase >= 1 s: a thread that the busy test machine
#: starts late still finds its partner waiting (1.5 s), so lossless rounds are exact.
#: Lossless phases end as soon as the data is in, so this costs no time.
RADIO = RadioModel(handshake_s=1.0)
SCHEDULE = ScheduleConfig(budget_s=4.0)


def city_routes() -> list[Route]:
    """p0 parked mid-city, p1/p2 crossing it, p3/p4 parked at opposite corners."""
    t = np.array([0.0, 40.0])
    return [
        Route(np.array([0.0]), np.array([[100.0, 100.0]])),
        Route(t, np.array([[0.0, 100.0], [200.0, 100.0]])),
        Route(t, np.array([[100.0, 0.0], [100.0, 200.0]])),
        Route(np.array([0.0]), np.array([[0.0, 0.0]])),
        Route(np.array([0.0]), np.array([[200.0, 200.0]])),
    ]


def start_values(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(40, 25, generator=gen), torch.randn(7, generator=gen)]


def flat(tensors: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([t.reshape(-1) for t in tensors]).double().numpy()


@pytest.mark.timeout(60)
def test_route_average_applies_the_planned_mixing_and_keeps_the_mean() -> None:
    routes = city_routes()
    ready = threading.Barrier(N, timeout=20)

    def body(rank: int, net: gossipnet.Peer) -> Any:
        net.set_route(routes[rank], radio=RADIO, schedule=SCHEDULE, route_time=lambda r: 8.0 * r)
        values = start_values(rank)
        ready.wait()
        reports = [net.average(values, method="route") for _ in range(2)]
        return flat(values), reports

    out = run_peers(N, body, timeout_s=45, **FAST)
    x0 = np.stack([flat(start_values(i)) for i in range(N)])
    x = x0
    for rnd in range(2):  # what every peer planned, recomputed from the same routes
        sched = plan_round(routes, 8.0 * rnd, 4.0 * x0.shape[1], radio=RADIO, schedule=SCHEDULE)
        assert sched.phases, "the city must offer feasible links"
        x = round_mixing_matrix(sched, [np.ones(len(p.edges), bool) for p in sched.phases]) @ x
    got = np.stack([o[0] for o in out])
    np.testing.assert_allclose(got, x, atol=1e-5)
    np.testing.assert_allclose(got.mean(axis=0), x0.mean(axis=0), atol=1e-5)

    def spread(v: np.ndarray) -> float:
        return float(np.mean((v - v.mean(axis=0)) ** 2))

    assert spread(got) < 0.6 * spread(x0)
    for _, reports in out:
        for rep in reports:
            assert rep.method == "route"
            assert rep.packets_lost == rep.chunks_stale == 0
            assert rep.extra["planned_peers"] == N
            assert rep.extra["routes_missing"] == 0
            assert set(rep.contributors) <= set(rep.participants)


@pytest.mark.timeout(60)
def test_radio_loss_rounds_end_within_their_deadline() -> None:
    routes = city_routes()
    by_address = {f"mem://p{i}": r for i, r in enumerate(routes)}
    radio = RadioModel()
    plan = radio_faults(by_address, radio, route_time=lambda t: 2.0, seed=11)
    ready = threading.Barrier(N, timeout=20)
    short = ScheduleConfig(budget_s=0.5)

    def body(rank: int, net: gossipnet.Peer) -> Any:
        net.set_route(routes[rank], radio=radio, schedule=short, route_time=lambda r: 2.0)
        values = start_values(rank)
        ready.wait()
        return [net.average(values, method="route") for _ in range(2)]

    # p4 is out of everyone's reliable range: joining gives up on it after 1.5 s, and
    # says so; p4 itself may hear nobody (min_peers=1: every peer goes on regardless)
    config = {**FAST, "join_timeout_s": 1.5, "control_timeout_s": 0.5, "min_peers": 1}
    out = run_peers(N, body, timeout_s=45, faults=plan, chunk_bytes=512, **config)
    reports = [rep for reps in out for rep in reps]
    assert sum(r.packets_lost for r in reports) > 0, "the radio model must drop packets"
    assert sum(r.packets_received for r in reports) > 0, "and deliver some"
    for rep in reports:
        assert rep.method == "route"
        assert rep.elapsed_s <= rep.extra["deadline_s"] + 1.5  # scheduling slack only
        assert set(rep.missing) <= set(rep.participants)
        assert (rep.extra["isolated"] == 1.0) == (len(rep.participants) == 1)


@pytest.mark.timeout(60)
def test_route_strategy_trains_and_its_state_round_trips() -> None:
    routes = city_routes()
    n, steps = 4, 16
    true_w = torch.tensor([[1.5, -2.0, 0.5]])

    def body(rank: int, net: gossipnet.Peer) -> Any:
        torch.manual_seed(0)  # the same start everywhere
        model = torch.nn.Linear(3, 1)
        net.set_route(routes[rank], radio=RADIO, schedule=SCHEDULE)
        opt = net.optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
            strategy="route",
            average_every=2,
        )
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(64, 3, generator=gen)
        y = x @ true_w.T + 0.3
        losses, reports = [], []
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            reports.append(opt.step())
            losses.append(float(loss.detach()))
        state = opt.state_dict()
        twin = net.optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), strategy="route"
        )
        twin.load_state_dict(state)
        return losses, reports, state, twin.state_dict()

    out = run_peers(n, body, timeout_s=45, **FAST)
    for losses, reports, state, again in out:
        assert losses[-1] < 0.2 * losses[0]
        assert [r.method for r in reports[:2]] == ["local", "route"]
        assert state["step_count"] == again["step_count"] == steps
        buf, buf2 = state["base"]["state"][0]["momentum_buffer"], again["base"]["state"][0]
        torch.testing.assert_close(buf, buf2["momentum_buffer"])
    assert any(len(r.contributors) > 1 for _, reports, _, _ in out for r in reports)


@pytest.mark.timeout(30)
def test_bad_strategy_or_method_is_a_clear_config_error() -> None:
    def body(rank: int, net: gossipnet.Peer) -> None:
        model = torch.nn.Linear(2, 1)
        with pytest.raises(ConfigError, match="'route'"):
            net.average(list(model.parameters()), method="routes")
        with pytest.raises(ConfigError, match="route"):
            net.optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="rout")
        with pytest.raises(ConfigError, match="set_route"):  # no route announced yet
            net.average([p.detach() for p in model.parameters()], method="route")
        with pytest.raises(ConfigError, match="set_route"):
            net.optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="route")
        net.set_route(city_routes()[rank])
        with pytest.raises(ConfigError, match="group_size"):
            net.optimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), strategy="route", group_size=4
            )
        with pytest.raises(ConfigError, match=r"gossipnet\.Route"):
            net.set_route([(0.0, 0.0)])  # type: ignore[arg-type]

    run_peers(1, body, timeout_s=20, **FAST)
