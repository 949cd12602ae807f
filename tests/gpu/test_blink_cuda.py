"""CudaExecutor against the CPU reference (same schedule) and torch's mean.

Skipped without CUDA. The one-device test runs every replica on cuda:0, which still
exercises the per-link streams and the event ordering; the multi-device tests need
>= 2 GPUs (peer-to-peer copies).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossipnet.collectives.blink import packing as P
from gossipnet.collectives.blink.detect import detect
from gossipnet.collectives.blink.executor import CpuExecutor, CudaExecutor
from gossipnet.collectives.island.hierarchical import IslandAverager

pytestmark = pytest.mark.timeout(120)
SEED = 5
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices")


def _dgx1v(k: int) -> np.ndarray:
    links = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (1, 2): 2, (1, 3): 1, (2, 3): 2, (0, 4): 2}
    cap = np.zeros((8, 8))
    for (a, b), n in links.items():
        cap[a, b] = cap[b, a] = 25.0 * n
    return cap[:k, :k] if k <= 4 else np.full((k, k), 25.0) - 25.0 * np.eye(k)


def _check(devices: list[str], chunks: int) -> None:
    k = len(devices)
    packing = P.pack_allreduce(_dgx1v(k))
    g = torch.Generator().manual_seed(SEED + k + chunks)
    host = [torch.randn(100_003, generator=g) for _ in range(k)]
    ref = [h.clone() for h in host]
    CpuExecutor(packing, chunks).all_reduce(ref)
    xs = [h.to(d) for h, d in zip(host, devices, strict=True)]
    CudaExecutor(packing, chunks).all_reduce(xs)
    want = torch.stack(host).mean(0)
    for x, r in zip(xs, ref, strict=True):
        torch.testing.assert_close(x.cpu(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.cpu(), r, rtol=1e-5, atol=1e-6)
    ints = [torch.randint(-99, 99, (4099,), generator=g).to(d) for d in devices]
    want_i = torch.stack([i.cpu() for i in ints]).sum(0)
    CudaExecutor(packing, chunks).all_reduce(ints, op="sum")
    for i in ints:
        assert torch.equal(i.cpu(), want_i)


@one_gpu
@pytest.mark.parametrize("chunks", [1, 7, 64])
def test_streams_and_events_on_one_device(chunks: int) -> None:
    _check(["cuda:0"] * 4, chunks)


@two_gpus
@pytest.mark.parametrize("chunks", [1, 2, 7, 64])
def test_all_reduce_across_devices(chunks: int) -> None:
    n = min(torch.cuda.device_count(), 8)
    for k in range(2, n + 1):
        _check([f"cuda:{i}" for i in range(k)], chunks)


@two_gpus
def test_island_averager_on_gpus() -> None:
    n = min(torch.cuda.device_count(), 4)
    avg = IslandAverager(tuple(range(n)), detect())  # None: the plain-mean fallback
    g = torch.Generator().manual_seed(SEED)
    host = [[torch.randn(33, 5, generator=g)] for _ in range(n)]
    reps = [[t.to(f"cuda:{i}") for t in r] for i, r in enumerate(host)]
    avg.average(reps)
    want = torch.stack([r[0] for r in host]).mean(0)
    for r in reps:
        torch.testing.assert_close(r[0].cpu(), want)
