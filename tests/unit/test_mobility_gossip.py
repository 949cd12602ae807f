"""Route gossip for training peers (gossipnet.mobility.gossip), pure parts and over nodes.

The end-to-end tests run real nodes on a MemoryNetwork under a FakeClock, each link's
FaultPlan taken from the radio model at the vehicles' distances (ALGORITHMS.md 4.1).
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gossipnet.mobility
from gossipnet import Config, FakeClock, FaultPlan
from gossipnet.mobility.gossip import (
    RouteGossip,
    partner_of,
    peer_mixing_row,
    plan_round,
    radio_link_faults,
    round_mixing_matrix,
)
from gossipnet.mobility.radio import RadioModel
from gossipnet.mobility.routes import Route
from gossipnet.mobility.schedule import ScheduleConfig

N = 6
#: Six parked vehicles, 35 m apart on two parallel streets: everyone is in range of
#: someone, the far pairs lose packets, the closest barely any.
WHERE = np.array([[0.0, 0.0], [35.0, 0.0], [70.0, 0.0], [0.0, 60.0], [35.0, 60.0], [70.0, 60.0]])
NUMEL = 4096  # 16 KiB of float32: 16 chunks of 1 KiB


def parked_routes() -> list[Route]:
    return [Route(np.array([0.0]), p[None]) for p in WHERE]


def schedule() -> Any:
    return plan_round(parked_routes(), 0.0, NUMEL * 4, schedule=ScheduleConfig(budget_s=5.0))


def test_plan_round_is_the_same_on_every_peer_and_partners_agree() -> None:
    one, two = schedule(), schedule()
    assert len(one.phases) >= 2
    for a, b in zip(one.phases, two.phases, strict=True):
        np.testing.assert_array_equal(a.edges, b.edges)
    for i in range(N):
        for p, j in enumerate(partner_of(one, i)):
            if j is not None:
                assert partner_of(one, j)[p] == i


@pytest.mark.parametrize("mode", ["sequential", "metropolis"])
def test_round_mixing_keeps_the_mean_whatever_fails(mode: str) -> None:
    sched = schedule()
    rng = np.random.default_rng(0)
    for _ in range(20):
        delivered = [rng.random(len(p.edges)) < 0.5 for p in sched.phases]
        mix = round_mixing_matrix(sched, delivered, mode=mode)
        np.testing.assert_allclose(mix.sum(axis=0), 1.0)
        np.testing.assert_allclose(mix.sum(axis=1), 1.0)
        for i in range(N):
            row = peer_mixing_row(sched, i, delivered, mode=mode)
            assert sum(row.values()) == pytest.approx(1.0)
            assert row == pytest.approx({j: mix[i, j] for j in np.flatnonzero(mix[i])})
    with pytest.raises(ValueError, match="mode"):
        round_mixing_matrix(sched, [np.ones(len(p.edges), bool) for p in sched.phases], mode="x")


def test_radio_link_faults_follow_distance() -> None:
    names = [f"mem://p{i}" for i in range(N)]
    faults = radio_link_faults(names, WHERE)
    assert len(faults) == N * (N - 1)
    assert faults[("mem://p0", "mem://p1")]["loss"] < faults[("mem://p0", "mem://p5")]["loss"]
    far = radio_link_faults(["a", "b"], np.array([[0.0, 0.0], [500.0, 0.0]]), RadioModel())
    assert far[("a", "b")] == {"loss": 1.0}
    FaultPlan(links={k: FaultPlan(**v) for k, v in faults.items()})  # valid plan arguments


async def gossip_rounds(
    cluster: Any, drive: Any, config: Config, plan: FaultPlan | None, rounds: int
) -> tuple[list[np.ndarray], list[Any]]:
    clock = FakeClock()
    sched = schedule()
    names = [f"p{i}" for i in range(N)]
    rng = np.random.default_rng(1)
    flats = [torch.from_numpy(rng.standard_normal(NUMEL).astype(np.float32)) for _ in range(N)]
    history = [np.stack([f.numpy().copy() for f in flats])]
    reports = []
    async with cluster(N, config=config, clock=clock, faults=plan) as nodes:
        peers = [RouteGossip(node, names, numel=NUMEL) for node in nodes]
        for rnd in range(rounds):
            runs = [g.run_round(rnd, f, sched) for g, f in zip(peers, flats, strict=True)]
            reports.append(await drive(clock, asyncio.gather(*runs), timeout_s=60.0))
            history.append(np.stack([f.numpy().copy() for f in flats]))
        for g in peers:
            g.close()
    return history, reports


def test_lossless_round_equals_the_planned_mixing(
    run_async: Any, cluster: Any, drive: Any, fast_config: Config
) -> None:
    history, reports = run_async(gossip_rounds(cluster, drive, fast_config, None, 1))
    sched = schedule()
    mix = round_mixing_matrix(sched, [np.ones(len(p.edges), bool) for p in sched.phases])
    np.testing.assert_allclose(history[1], mix @ history[0].astype(np.float64), atol=1e-5)
    assert all(r.ok and r.method == "route" for r in reports[0])


def test_radio_losses_keep_the_sum_and_still_mix(
    run_async: Any, cluster: Any, drive: Any, fast_config: Config
) -> None:
    names = [f"mem://p{i}" for i in range(N)]
    links = {k: FaultPlan(**v) for k, v in radio_link_faults(names, WHERE).items()}
    plan = FaultPlan(seed=7, links=links)
    history, reports = run_async(gossip_rounds(cluster, drive, fast_config, plan, 4))
    total = history[0].astype(np.float64).sum(axis=0)
    for x in history[1:]:
        # chunks are averaged only where both ends got each other's: the sum is kept
        np.testing.assert_allclose(x.astype(np.float64).sum(axis=0), total, atol=1e-3)
    spread = [float(np.mean((x - x.mean(axis=0)) ** 2)) for x in history]
    assert spread[-1] < 0.5 * spread[0]
    lost = sum(r.packets_lost for rs in reports for r in rs)
    stale = sum(r.chunks_stale for rs in reports for r in rs)
    assert lost > 0
    assert stale >= lost


def test_mobility_never_imports_the_transport() -> None:
    """Layering (STYLE.md): mobility plans and mixes; only the node it is handed sends."""
    root = Path(gossipnet.mobility.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert "transport" not in name, f"{path.name}: {name}"
                assert "_node" not in name, f"{path.name}: {name}"


def test_public_names_are_pinned() -> None:
    expected = {
        "STRATEGIES", "CityGrid", "Fleet", "Itinerary", "LinkTable", "Phase", "RadioModel",
        "Route", "RouteGossip", "Schedule", "ScheduleConfig", "SimConfig", "Trace",
        "TrafficConfig", "consensus_error", "contact_windows", "edge_colouring",
        "exchange_probability", "fiedler_value", "laplacian", "link_table",
        "metropolis_weights", "mix_matching", "partner_of", "peer_mixing_row", "plan_round",
        "plan_schedule", "push_sum_step", "radio_link_faults", "round_mixing_matrix",
        "sgp_out_peers", "simulate",
    }  # fmt: skip
    assert isinstance(gossipnet.mobility.__all__, tuple)
    assert set(gossipnet.mobility.__all__) == expected
    for name in expected:
        assert getattr(gossipnet.mobility, name) is not None
