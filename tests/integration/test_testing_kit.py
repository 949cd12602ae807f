"""The kit's cluster helper runs joined peers on real loopback sockets too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing import loopback_addresses, run_peers

pytestmark = pytest.mark.timeout(60)

NET = {"heartbeat_interval_s": 0.1, "failure_timeout_s": 2.0, "join_timeout_s": 10.0}


@pytest.mark.parametrize("scheme", ["tcp", "udp"])
def test_run_peers_on_loopback_addresses(scheme: str) -> None:
    def body(rank: int, peer: gossipnet.Peer) -> Any:
        assert peer.wait_for_peers(2, 10.0)
        t = torch.full((8,), float(rank))
        peer.all_reduce([t], timeout=10.0)
        return peer.address, t.tolist()

    addresses = loopback_addresses(2, scheme)
    out = run_peers(2, body, timeout_s=30, addresses=addresses, **NET)
    assert [a for a, _ in out] == addresses
    assert all(values == [0.5] * 8 for _, values in out)
