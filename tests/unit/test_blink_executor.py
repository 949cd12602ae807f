"""Blink schedules and the CPU reference executor (ALGORITHMS.md 5.1 steps 5-6, 5.4)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from gossipnet.collectives.blink import packing as P
from gossipnet.collectives.blink.executor import CpuExecutor, CudaExecutor
from gossipnet.collectives.blink.schedule import Op, build_schedule, split_by_rate
from gossipnet.collectives.blink.topology import parse_topo_matrix

from ._blink_fixtures import FIXTURES, allocation

SEED = 8
CHUNKS = (1, 2, 7, 64)
FIXTURE_FILES = (
    "dgx1-v100.txt",
    "dgx1-p100.txt",
    "dgx-a100-nvswitch.txt",
    "rtx-a6000-partial-nvlink.txt",
)


@functools.cache
def _islands() -> list[tuple[str, P.Packing]]:
    out = []
    for name in FIXTURE_FILES:
        topo = parse_topo_matrix((FIXTURES / name).read_text())
        for island in topo.islands():
            if len(island) > 1:
                out.append((f"{name}:{island}", P.pack_allreduce(topo.capacity_matrix(island))))
    # partial DGX-1 allocations, and a broadcast packing used for an all-reduce
    for sub in ((0, 1, 5), (0, 1, 2, 4, 5), (1, 3, 5, 6, 7)):
        out.append((f"v100{sub}", P.pack_allreduce(allocation("v100", sub))))
    out.append(("v100-bcast", P.pack_broadcast(allocation("v100", tuple(range(8))), 3)))
    return out


def _inputs(k: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + k + n)
    if dtype.is_floating_point:
        return [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for _ in range(k)]
    return [torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype) for _ in range(k)]


@pytest.mark.parametrize("chunks", CHUNKS)
def test_cpu_all_reduce_equals_stack_mean(chunks: int) -> None:
    for label, packing in _islands():
        ex = CpuExecutor(packing, chunks=chunks)
        for n, dtype, rtol in ((1003, torch.float64, 1e-12), (517, torch.float32, 1e-6)):
            xs = _inputs(packing.k, n, dtype)
            want = torch.stack(xs).mean(0)
            ex.all_reduce(xs, op="mean")
            for i, x in enumerate(xs):
                torch.testing.assert_close(x, want, rtol=rtol, atol=rtol, msg=f"{label} {i}")
        ints = _inputs(packing.k, 333, torch.int64)
        want_i = torch.stack(ints).sum(0)
        ex.all_reduce(ints, op="sum")
        for x in ints:
            assert torch.equal(x, want_i), label


def test_replicas_and_tiny_buffers() -> None:
    packing = P.pack_allreduce(allocation("v100", (0, 1, 2, 3)))
    ex = CpuExecutor(packing, chunks=7)
    g = torch.Generator().manual_seed(SEED)
    reps = [[torch.randn(3, 4, generator=g), torch.randn(5, generator=g)] for _ in range(4)]
    want = [torch.stack([r[j] for r in reps]).mean(0) for j in range(2)]
    ex.all_reduce_replicas(reps)
    for r in reps:
        for got, w in zip(r, want, strict=True):
            torch.testing.assert_close(got, w)
    for n in (0, 1, 3):  # fewer elements than trees x chunks
        xs = _inputs(4, n, torch.float64)
        want_t = torch.stack(xs).mean(0)
        ex.all_reduce(xs)
        for x in xs:
            torch.testing.assert_close(x, want_t)


@pytest.mark.parametrize("chunks", CHUNKS)
def test_schedule_respects_pipelining_dependencies(chunks: int) -> None:
    for label, packing in _islands():
        sched = build_schedule(packing, 4099, chunks)
        arrive: dict[tuple[int, int, int], int] = {}  # (tree, chunk, node) -> last add slot
        final: dict[tuple[int, int], int] = {}
        got: dict[tuple[int, int, int], int] = {}  # (tree, chunk, node) -> complete slot
        sent_up: dict[tuple[int, int, int], int] = {}
        per_link_slot: set[tuple[int, int, int, int]] = set()
        for s in sched.steps:
            key = (s.tree, s.chunk)
            if s.op is Op.REDUCE:
                # all of the sender's children were added in earlier slots
                assert arrive.get((*key, s.src), -1) < s.slot, label
                arrive[(*key, s.dst)] = max(arrive.get((*key, s.dst), -1), s.slot)
                sent_up[(*key, s.src)] = s.slot
            elif s.op is Op.FINAL:
                assert arrive[(*key, s.src)] < s.slot, label
                final[key] = s.slot
                got[(*key, s.dst)] = s.slot
            else:
                assert got[(*key, s.src)] < s.slot, label  # parent has the total
                assert sent_up.get((*key, s.dst), -1) < s.slot  # child's value was sent
                got[(*key, s.dst)] = s.slot
            link = (s.tree, s.src, s.dst, s.slot)
            assert link not in per_link_slot, f"{label}: two chunks on one hop in one slot"
            per_link_slot.add(link)
        # every node ends with every chunk of every tree
        for t, (lo, hi) in enumerate(sched.segments):
            n_chunks = len({s.chunk for s in sched.steps if s.tree == t})
            assert n_chunks == min(chunks, hi - lo)
            for c in {s.chunk for s in sched.steps if s.tree == t}:
                assert all((t, c, v) in got for v in range(packing.k)), label
        tallest = max(t.height for t in packing.trees)
        assert sched.slots <= chunks + 2 * tallest


def test_split_by_rate_is_proportional_and_complete() -> None:
    segs = split_by_rate(1000, [50.0, 25.0, 25.0])
    assert segs == [(0, 500), (500, 750), (750, 1000)]
    segs = split_by_rate(1001, [1.0, 2.0], align=64)
    assert segs[-1][1] == 1001
    assert (segs[0][1] - segs[0][0]) % 64 == 0
    with pytest.raises(ValueError, match="rates"):
        split_by_rate(10, [1.0, 0.0])


def test_executor_rejects_bad_input() -> None:
    ex = CpuExecutor(P.pack_allreduce(allocation("v100", (0, 1, 2))))
    with pytest.raises(ValueError, match="expected 3 tensors"):
        ex.all_reduce([torch.zeros(4)] * 2)
    with pytest.raises(ValueError, match="1-D"):
        ex.all_reduce([torch.zeros(4), torch.zeros(4), torch.zeros(5)])
    with pytest.raises(ValueError, match="floating"):
        ex.all_reduce([torch.zeros(4, dtype=torch.int32)] * 3)
    with pytest.raises(ValueError, match="op"):
        ex.all_reduce([torch.zeros(4)] * 3, op="max")
    disconnected = P.pack_allreduce(allocation("v100", (0, 1, 6)))
    with pytest.raises(ValueError, match="not connected"):
        CpuExecutor(disconnected).all_reduce([torch.zeros(4)] * 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_executor_says_what_to_use_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="CpuExecutor"):
        CudaExecutor(P.pack_allreduce(np.full((2, 2), 25.0)))
