"""CPU seconds per collective in the report (``extra["cpu_s"]``, ``extra["cpu_caller_s"]``).

Peers run in threads over the in-process MemoryNetwork (no sockets, no loss:
nothing random to seed), as in test_optim.  CPU time is not a timing that a
loaded machine stretches the way wall time is: a 4M-element all-reduce moves
1000x the bytes of a 4K one, so its loop thread's CPU is larger on any load.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import gossipnet
from gossipnet.reports import CollectiveReport
from gossipnet.testing import run_peers

FAST = {"heartbeat_interval_s": 0.05, "failure_timeout_s": 5.0, "collective_timeout_s": 20.0}
KEYS = ("cpu_s", "cpu_caller_s")


def assert_cpu_keys(rep: CollectiveReport) -> None:
    for key in KEYS:
        assert key in rep.extra, (key, rep)
        assert rep.extra[key] >= 0.0, (key, rep.extra)


@pytest.mark.timeout(120)  # 16 MB per peer through the memory network, 2 busy cores
def test_all_reduce_reports_loop_cpu_that_grows_with_the_tensor() -> None:
    """4M floats cost the loop thread more CPU than 4K floats (3 rounds each, summed)."""

    def body(rank: int, peer: gossipnet.Peer) -> dict[int, float]:
        out: dict[int, float] = {}
        for numel in (4096, 4 * 1024 * 1024):
            x = torch.full((numel,), float(rank))
            out[numel] = 0.0
            for _ in range(3):
                rep = peer.all_reduce([x])
                assert rep.ok, rep
                assert_cpu_keys(rep)
                out[numel] += rep.extra["cpu_s"]
            assert torch.allclose(x, torch.full_like(x, 0.5))
        return out

    for cpu in run_peers(2, body, timeout_s=100, **FAST):
        assert cpu[4 * 1024 * 1024] > 2 * cpu[4096] > 0.0, cpu


def test_optimizer_steps_and_resyncs_report_cpu() -> None:
    """The step-0 resync, every gradient round and an explicit resync carry both keys."""

    def body(rank: int, peer: gossipnet.Peer) -> list[CollectiveReport]:
        torch.manual_seed(rank)
        model = torch.nn.Linear(16, 4)
        opt = peer.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        reps = []
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).square().mean().backward()
            reps.append(opt.step())
        reps.append(opt.resync())
        return reps

    for reps in run_peers(2, body, timeout_s=60, **FAST):
        assert [r.method for r in reps][-1] == "resync"
        for rep in reps:
            assert rep.ok, rep
            assert_cpu_keys(rep)


@pytest.mark.parametrize("method", ["moshpit", "route"])
def test_moshpit_and_route_averages_report_cpu(method: str) -> None:
    """``average`` reports both keys, whatever the method (route: two peers parked
    10 m apart, in radio range)."""

    def body(rank: int, peer: gossipnet.Peer) -> Any:
        if method == "route":
            spot = np.array([[10.0 * rank, 0.0]])
            peer.set_route(gossipnet.Route(np.array([0.0]), spot), radio=gossipnet.RadioModel())
        x = torch.full((1000,), float(rank))
        return peer.average([x], method=method, rounds=1)

    for rep in run_peers(2, body, timeout_s=60, **FAST):
        assert rep.method == method, rep
        assert_cpu_keys(rep)
