"""The public test kit drives the real runtime: clusters under an autojumping clock.

What a user of :mod:`gossipnet.testing` relies on: :func:`cluster` starts nodes
that find each other, :func:`autojump` lets membership timers run with no test
stepping the clock, and a run replays exactly (the same virtual detection time
twice).  :func:`run_peers` runs joined peers in threads on a memory network.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gossipnet
from gossipnet import Config, FakeClock
from gossipnet.testing import autojump, cluster, loopback_addresses, run, run_peers

from ..conftest import FAST

pytestmark = pytest.mark.timeout(60)


def _detection_time() -> float:
    """Virtual seconds until two nodes see a third one, closed silently, as dead."""
    clock = FakeClock()

    async def main() -> float:
        with autojump(clock):
            async with cluster(3, config=Config(**FAST), clock=clock) as nodes:
                await nodes[2].close(announce=False)
                t0 = clock.now()
                while any(len(n.alive_peers()) != 2 for n in nodes[:2]):
                    await clock.sleep(0.01)
                return clock.now() - t0

    return run(main())


def test_autojump_runs_membership_timers_and_replays_exactly() -> None:
    first = _detection_time()
    assert FAST["failure_timeout_s"] <= first <= 2 * FAST["failure_timeout_s"]
    assert _detection_time() == first


def test_run_peers_averages_over_a_memory_network() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> Any:
        assert peer.wait_for_peers(3, 10.0)
        t = torch.full((4,), float(rank))
        report = peer.all_reduce([t], timeout=10.0)
        return report.participants, t.tolist()

    out = run_peers(3, body, timeout_s=30, **FAST)
    assert all(members == ("p0", "p1", "p2") for members, _ in out)
    assert all(values == [1.0] * 4 for _, values in out)  # the mean of 0, 1, 2


def test_loopback_addresses_are_distinct_and_concrete() -> None:
    addrs = loopback_addresses(3)
    assert len(set(addrs)) == 3
    assert all(a.startswith("tcp://127.0.0.1:") and not a.endswith(":0") for a in addrs)
    assert loopback_addresses(1, "udp")[0].startswith("udp://127.0.0.1:")
    with pytest.raises(ValueError, match="tcp:// or udp://"):
        loopback_addresses(1, "mem")
