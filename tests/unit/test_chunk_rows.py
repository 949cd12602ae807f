"""A run's chunks as one block per bucket (``collectives/lossy/rows.py``) against
one view and one ``copy_`` per chunk: the same values, finiteness and bytes written."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gossipnet.collectives.chunks import ChunkPlan, all_finite, from_bytes
from gossipnet.collectives.lossy.rows import ChunkRows, write_rows
from gossipnet.transport.wire import Packet


def _round(dtype: torch.dtype, numel: int = 37, chunk_bytes: int = 32) -> Any:
    plan = ChunkPlan(numel=numel, dtype=dtype, chunk_bytes=chunk_bytes)
    return SimpleNamespace(plans=[plan], dst=[torch.zeros(numel, dtype=dtype)], step_mag=None)


def _items(rnd: Any, chunks: list[int], seed: int) -> list[tuple[Packet, int, int]]:
    plan, gen = rnd.plans[0], torch.Generator().manual_seed(seed)
    out = []
    for c in chunks:
        values = torch.randn(plan.chunk(c)[1], generator=gen).to(plan.dtype)
        payload = memoryview(values.numpy().tobytes())
        out.append((Packet("p", 1, c, 0, {}, payload), 0, c))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_values_and_writes_are_the_per_chunk_ones(dtype: torch.dtype) -> None:
    rnd = _round(dtype)  # 8 float32 (4 float64) per chunk, a short last chunk
    last = rnd.plans[0].nchunks - 1
    items = _items(rnd, [3, 0, last, 1, 2], seed=1)
    rows = ChunkRows(rnd, items)
    assert sorted(r for r in rows.row if r >= 0) == [0, 1, 2, 3]  # the short one apart
    assert rows.row[2] == -1
    for i, (pkt, b, c) in enumerate(items):
        want = from_bytes(pkt.payload, dtype, rnd.plans[b].chunk(c)[1])
        assert torch.equal(rows.values(i), want)
    assert rows.finite() == [True] * 5
    one = _round(dtype)
    for pkt, b, c in items:
        one.plans[b].view(one.dst[b], c).copy_(
            from_bytes(pkt.payload, dtype, one.plans[b].chunk(c)[1])
        )
    write_rows(rnd, 0, [(c, i) for i, (_, _, c) in enumerate(items)], rows)
    assert torch.equal(rnd.dst[0], one.dst[0])


def test_a_bad_chunk_in_a_block_is_only_itself() -> None:
    """A non-finite row is found by its row sum; writing a subset of the block (the
    others refused) moves exactly those rows (index_select), bit for bit."""
    rnd = _round(torch.float32)
    items = _items(rnd, [0, 1, 2, 3], seed=2)
    bad = bytearray(items[1][0].payload)
    bad[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    items[1] = (Packet("p", 1, 1, 0, {}, memoryview(bytes(bad))), 0, 1)
    rows = ChunkRows(rnd, items)
    assert rows.finite() == [True, False, True, True]
    assert [all_finite(rows.values(i)) for i in range(4)] == rows.finite()
    write_rows(rnd, 0, [(0, 0), (3, 3)], rows)  # 1 refused (NaN), 2 refused (say, duplicate)
    dst, step = rnd.dst[0], rnd.plans[0].chunk_elems
    assert torch.equal(dst[:step], rows.values(0))
    assert torch.equal(dst[3 * step : 4 * step], rows.values(3))
    assert not dst[step : 3 * step].any()


def test_a_lone_chunk_is_viewed_not_stacked() -> None:
    rnd = _round(torch.float32)
    items = _items(rnd, [2], seed=3)
    rows = ChunkRows(rnd, items)
    assert rows.row == [-1]
    assert not rows.blocks
    write_rows(rnd, 0, [(2, 0)], rows)
    step = rnd.plans[0].chunk_elems
    assert torch.equal(rnd.dst[0][2 * step : 3 * step], rows.values(0))
