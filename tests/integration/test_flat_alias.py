"""Two all-reduces of different tensors with one layout: each keeps its own result.

Why: the facade caches one flat buffer per layout, and a single contiguous tensor
*is* its bucket (zero-copy).  Reusing that buffer for another tensor of the same
shape copied the second tensor into the first one's memory: ``a`` silently took
``b``'s values.  Found while building compression (#22); a DDP-style loop that
reduces several same-shaped tensors in turn was corrupted without any error.
"""

from __future__ import annotations

import pytest
import torch

from gossipnet.testing import run_peers

pytestmark = pytest.mark.timeout(60)  # two peers on a memory network: seconds


def test_same_layout_different_tensors_keep_their_own_results() -> None:
    def body(rank: int, peer: object) -> tuple[list[float], list[float]]:
        a = torch.full((1000,), float(rank))
        b = torch.full((1000,), 10.0 * rank)
        peer.all_reduce([a])  # type: ignore[attr-defined]
        peer.all_reduce([b])  # type: ignore[attr-defined]
        return a[:3].tolist(), b[:3].tolist()

    for a, b in run_peers(2, body, timeout_s=30, collective_timeout_s=5.0):
        assert a == [0.5] * 3  # the mean of 0 and 1, untouched by b's round
        assert b == [5.0] * 3
