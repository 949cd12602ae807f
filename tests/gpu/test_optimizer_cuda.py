"""``net.optimizer`` (strategy ``"allreduce"``) with a CUDA model trains as the CPU one
does, dense and with ``compress=``: the owners step the parameters the replicas
hold now (the round's CPU copies of the device buckets are kept across steps, so
the shard optimizer's views see every resync and, compressed, the residual).
Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing import run_peers

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 30


def _run(device: str, spec: Any) -> list[torch.Tensor]:
    def body(rank: int, peer: gossipnet.Peer) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
        )
        with torch.no_grad():
            for p in model.parameters():
                p.copy_((torch.rand(p.shape, generator=gen) - 0.5) * 0.4)
        model.to(device)
        opt = peer.optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), compress=spec)
        data = torch.Generator().manual_seed(10 + rank)
        w = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        first = last = 0.0
        for step in range(STEPS):
            x = torch.randn(64, 32, generator=data)
            loss = torch.nn.functional.mse_loss(model(x.to(device)), (x @ w).to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = float(loss.detach())
            first = last if step == 0 else first
        assert last < 0.5 * first, (first, last)
        return torch.cat([p.detach().cpu().flatten() for p in model.parameters()])

    # a resync every 5 steps: the owners must step what the resyncs left
    return run_peers(3, body, timeout_s=120, resync_every_steps=5)


@pytest.mark.parametrize("spec", [None, gossipnet.ArcTopK(density=0.1, values="int8")], ids=str)
def test_cuda_model_trains_as_the_cpu_one(spec: Any) -> None:
    cpu, cuda = _run("cpu", spec), _run("cuda", spec)
    for flat in cuda:
        assert torch.equal(flat, cuda[0])  # one model on every peer (lossless)
    # the same steps, up to CUDA's float arithmetic in the forward and backward passes
    torch.testing.assert_close(cuda[0], cpu[0], rtol=1e-3, atol=1e-4)
