"""Networked route gossip parts: time-varying link loss, radio fault plans, route sharing.

Memory network and FakeClock: no sockets, and waits cost no real time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from gossipnet import Config, ConfigError, FakeClock, FaultPlan, RadioModel, Route
from gossipnet.collectives.route.averager import RouteAverager, decode_route, encode_route
from gossipnet.collectives.route.kinds import RouteKind
from gossipnet.testing import radio_faults
from tests.unit.test_faults import faulty, send_seq, seqs, within_binomial


def test_link_loss_replaces_loss_with_the_same_draws() -> None:
    fixed, inner_fixed = faulty(FaultPlan(loss=0.3, seed=4))
    dynamic, inner_dynamic = faulty(FaultPlan(seed=4, link_loss=lambda s, d, t: 0.3))
    for t in (fixed, dynamic):
        send_seq(t, "b", 3000)
    assert seqs(inner_dynamic) == seqs(inner_fixed)  # same seed, same fates
    assert within_binomial(len(inner_dynamic.sent), 3000, 0.7)


def test_link_loss_follows_link_and_plan_time() -> None:
    clock = FakeClock()
    calls: list[tuple[str, str]] = []

    def loss(src: str, dst: str, t: float) -> float:
        calls.append((src, dst))
        return 1.0 if dst == "b" and t < 1.0 else 0.0

    t, inner = faulty(FaultPlan(seed=1, link_loss=loss), clock)
    send_seq(t, "b", 50)
    send_seq(t, "c", 50, start=50)
    clock.advance(1.0)
    send_seq(t, "b", 50, start=100)
    assert seqs(inner, "b") == list(range(100, 150))
    assert seqs(inner, "c") == list(range(50, 100))
    assert set(calls) == {("a", "b"), ("a", "c")}


def test_link_loss_is_checked() -> None:
    with pytest.raises(ConfigError, match="link_loss"):
        FaultPlan(link_loss=0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="link_loss"):
        FaultPlan(links={("a", "b"): FaultPlan(link_loss=lambda s, d, t: 0.1)})


def test_radio_faults_lose_more_with_distance() -> None:
    routes = {
        "a": Route(np.array([0.0]), np.array([[0.0, 0.0]])),
        "b": Route(np.array([0.0, 10.0]), np.array([[20.0, 0.0], [140.0, 0.0]])),
        "c": Route(np.array([0.0]), np.array([[400.0, 0.0]])),
    }
    plan = radio_faults(routes, RadioModel(), seed=3, loss=0.05)
    assert plan.link_loss is not None
    near, far = plan.link_loss("a", "b", 0.0), plan.link_loss("a", "b", 10.0)
    assert near < 0.01 < 0.5 < far < 1.0
    assert plan.link_loss("a", "c", 0.0) == 1.0  # out of range
    assert plan.link_loss("a", "zz", 0.0) == 0.05  # not in the table: the plan's loss
    moved = radio_faults(lambda: routes, route_time=lambda t: 10.0)
    assert moved.link_loss is not None
    assert moved.link_loss("b", "a", 0.0) == pytest.approx(far)


def test_route_codec_round_trips_and_rejects_garbage() -> None:
    route = Route(np.array([0.0, 5.0, 9.0]), np.array([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]))
    back = decode_route(encode_route(route), 3)
    assert back is not None
    np.testing.assert_array_equal(back.times_s, route.times_s)
    np.testing.assert_array_equal(back.points_m, route.points_m)
    assert decode_route(encode_route(route), 2) is None  # wrong size
    assert decode_route(np.array([0.0, 0.0, 1, 1, 2, 2]).tobytes(), 2) is None  # times repeat
    assert decode_route(np.full(3, np.nan).tobytes(), 1) is None


def parked(x: float) -> Route:
    return Route(np.array([0.0]), np.array([[x, 0.0]]))


@pytest.mark.timeout(30)
def test_routes_are_shared_updated_and_a_lone_peer_keeps_its_values(
    run_async: Any, cluster: Any, wait_until: Any, drive: Any, fast_config: Config
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=fast_config, clock=clock) as nodes:
            avg = [RouteAverager(n) for n in nodes]
            for a, x in zip(avg, (0.0, 40.0, 900.0), strict=True):
                await a.configure(parked(x), None, None, None)

            def everyone_knows() -> bool:
                return all(len(a.routes) == 2 for a in avg)

            await wait_until(everyone_knows, 5.0, clock=clock, what="routes shared")
            await avg[1].configure(parked(50.0), None, None, None)  # a new plan
            await wait_until(
                lambda: avg[0].routes["p1"].route.points_m[0, 0] == 50.0, 5.0, clock=clock
            )
            # garbage is dropped and counted, and does not replace a held route
            nodes[2].send("p0", RouteKind.SHARE, {"rv": 9, "m": 3, "w": 0}, b"xx")
            nodes[2].send("p0", RouteKind.SHARE, {"rv": "x", "m": 1}, b"")
            await wait_until(lambda: sum(avg[0].rejects.values()) == 2, 1.0, clock=clock)
            assert avg[0].routes["p2"].route.points_m[0, 0] == 900.0
            # p2 is 850 m from everyone: no feasible link, it keeps its values
            values = [torch.full((100,), float(i)) for i in range(3)]
            runs = [a.average(v, rnd=0) for a, v in zip(avg, values, strict=True)]
            reports = await drive(clock, asyncio.gather(*runs), timeout_s=20.0)
            assert reports[2].extra["isolated"] == 1.0
            assert reports[2].contributors == ("p2",)
            assert torch.equal(values[2], torch.full((100,), 2.0))
            assert torch.allclose(values[0], torch.full((100,), 0.5))
            assert reports[0].contributors == ("p0", "p1")

    run_async(main())
