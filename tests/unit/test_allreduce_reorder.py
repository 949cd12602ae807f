"""Reordered packets: a sender's END overtaking its own data must not make chunks stale.

Why: a phase used to end for a sender the moment its END marker arrived, so a data
packet delayed behind that END (reordering, no loss at all) came too late and left
its chunk stale.  The END declares how many packets it closes; when some are still
missing, the engine now waits for them as long as packets have recently been seen
to arrive after their sender's END (a window learned from arrival times), and not
at all while none has: under pure loss the missing packets never come, so waiting
would only make lossy rounds slower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gossipnet.collectives.lossy.cut import ReorderWindow
from gossipnet.config import Config
from gossipnet.testing import FaultPlan

from .test_allreduce import N, allreduce, engines_of


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    return fast_config.replace(chunk_bytes=1024, heartbeat_interval_s=0.1, failure_timeout_s=5.0)


def _rounds(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, plan: FaultPlan, n: int
) -> tuple[list[int], list[Any]]:
    """``n`` rounds of 4 peers under ``plan`` (per-peer seeds); stale chunks per round."""
    stale: list[int] = []

    async def main() -> list[Any]:
        def faults(i: int) -> FaultPlan:
            return dataclasses.replace(plan, seed=plan.seed + i)

        async with cluster(N, config=cfg, faults=faults) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(5)
            for _ in range(n):
                inputs = [[torch.randn(8192, generator=gen)] for _ in range(N)]
                reports = await allreduce(drive, None, engines, inputs, timeout_s=5.0)
                stale.append(sum(r.chunks_stale for r in reports))
            return engines

    engines = run_async(main())
    return stale, engines


@pytest.mark.timeout(60)
def test_reordered_packets_stop_going_stale_once_the_window_is_learned(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """20% of packets delayed 5 ms behind later ones, nothing lost: after the first
    rounds teach the window, no chunk is stale; rounds stay far from the timeout."""
    plan = FaultPlan(reorder=0.2, reorder_delay_s=0.005, seed=11)
    stale, engines = _rounds(run_async, cluster, drive, cfg, plan, 12)
    assert sum(stale[4:]) == 0, stale
    assert any(e._reorder.allowance(e.next_round) > 0 for e in engines)


@pytest.mark.timeout(60)
def test_pure_loss_teaches_no_window(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Lost packets never arrive after an END: the window stays 0, so a lossy round
    still ends on its END markers instead of waiting for what was lost."""
    plan = FaultPlan(loss=0.2, seed=3)
    stale, engines = _rounds(run_async, cluster, drive, cfg, plan, 6)
    assert sum(stale) > 0  # the loss did bite
    assert all(e._reorder.allowance(e.next_round) == 0.0 for e in engines)


def test_window_is_learned_capped_and_forgotten() -> None:
    w = ReorderWindow(cap_s=0.05, memory_rounds=4)
    assert w.allowance(0) == 0.0
    w.observe(0.004, round_=3)
    assert w.allowance(3) == pytest.approx(1.5 * 0.004)
    w.observe(1.0, round_=4)  # an outage, not a reorder: capped
    assert w.allowance(5) == 0.05
    assert w.allowance(9) == 0.0  # nothing seen within the last 4 rounds
    with pytest.raises(ValueError, match="cap_s"):
        ReorderWindow(cap_s=-1.0)
