"""Hierarchical all-reduce: Blink inside islands (CPU executor), lossy across peers."""

from __future__ import annotations

import pytest
import torch

import gossipnet
from gossipnet.collectives.blink.executor import CpuExecutor
from gossipnet.collectives.blink.topology import parse_topo_matrix
from gossipnet.collectives.island.hierarchical import IslandAverager
from gossipnet.testing import run_peers

from ._blink_fixtures import FIXTURES

SEED = 31
NET = {
    "heartbeat_interval_s": 0.05,
    "failure_timeout_s": 2.0,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 5.0,
    "collective_timeout_s": 3.0,
}


def _replicas(seed: int, n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(4, 3, generator=g), torch.randn(7, generator=g)] for _ in range(n)]


def _mean(reps: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack([r[j] for r in reps]).mean(0) for j in range(len(reps[0]))]


@pytest.mark.parametrize("gpus", [(0, 1, 2, 3, 5), (0, 1, 6), (4, 5)])
def test_local_average_over_islands_matches_the_mean(gpus: tuple[int, ...]) -> None:
    topo = parse_topo_matrix((FIXTURES / "dgx1-v100.txt").read_text())
    avg = IslandAverager(gpus, topo, chunks=3, cuda=False)
    multi = [isl for isl in avg.islands if len(isl) > 1]
    assert all(isinstance(avg.executors[isl], CpuExecutor) for isl in multi)
    reps = _replicas(SEED, len(gpus))
    want = _mean(reps)
    assert avg.average(reps) is None
    for r in reps:
        for got, w in zip(r, want, strict=True):
            torch.testing.assert_close(got, w)


def test_without_topology_falls_back_to_plain_means() -> None:
    avg = IslandAverager((0, 1, 2), None)
    assert avg.executors == {}
    reps = _replicas(SEED + 1, 3)
    want = _mean(reps)
    avg.average(reps)
    for r in reps:
        for got, w in zip(r, want, strict=True):
            torch.testing.assert_close(got, w)


@pytest.mark.timeout(30)
def test_two_peers_average_every_replica_weighted_by_count() -> None:
    """Peer 0 drives 3 replicas (one NVLink island of a DGX-1V, CPU executor), peer 1
    drives 1 (CPU fallback, through the public Peer.island_all_reduce); all 4 end
    with the mean of the 4 replicas."""
    topo = parse_topo_matrix((FIXTURES / "dgx1-v100.txt").read_text())
    reps = [_replicas(SEED + 2, 3), _replicas(SEED + 3, 1)]
    want = _mean(reps[0] + reps[1])

    def body(rank: int, peer: gossipnet.Peer) -> gossipnet.CollectiveReport:
        assert peer.wait_for_peers(2, 5.0)
        if rank == 0:
            report = IslandAverager((0, 1, 3), topo, cuda=False).average(reps[0], peer, 3.0)
            assert report is not None
            return report
        return peer.island_all_reduce(reps[1], timeout=3.0)

    reports = run_peers(2, body, timeout_s=20, **NET)
    assert all(len(r.contributors) == 2 for r in reports)
    for r in reps[0] + reps[1]:
        for got, w in zip(r, want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
