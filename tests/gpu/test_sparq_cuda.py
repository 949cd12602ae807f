"""SparQ with a model on CUDA: the strategy gossips a CPU float32 copy and writes the
consensus back into the CUDA parameters; the result must be the CPU run's exactly.

Skipped without CUDA.  With ``lr=0`` every change to the parameters is SparQ's
(compression, estimates, consensus: CPU arithmetic in both runs), so the CUDA and
CPU runs must agree bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gossipnet
from gossipnet import SparQ
from gossipnet.testing import run_peers
from tests.integration.test_sparq import seeded_linear

pytestmark = pytest.mark.timeout(120)
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FAST = {"heartbeat_interval_s": 0.05, "failure_timeout_s": 2.0, "collective_timeout_s": 5.0}


def _run(device: str) -> list[torch.Tensor]:
    def body(rank: int, net: gossipnet.Peer) -> Any:
        model = seeded_linear(64, 32, rank).to(device)
        opt = net.optimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), strategy="moshpit",
            sync_state=False, compress=SparQ(density=0.2, gamma=0.5),
        )  # fmt: skip
        for _ in range(5):
            opt.step()
        assert all(p.device.type == torch.device(device).type for p in model.parameters())
        return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])

    return run_peers(3, body, timeout_s=60, **FAST)


@one_gpu
def test_sparq_on_cuda_parameters_matches_the_cpu_run() -> None:
    cpu, cuda = _run("cpu"), _run("cuda")
    for a, b in zip(cpu, cuda, strict=True):
        assert torch.equal(a, b)
    assert max(float((x - cpu[0]).norm()) for x in cpu) > 0  # still converging, not frozen
