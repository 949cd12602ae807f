"""A run of data chunks as tensor rows: one copy per bucket instead of a view per chunk.

Why: a drain of the receive socket hands the all-gather tens of 8 KiB chunks.
Viewing each payload as a tensor (``from_bytes``) and stacking the views for
the row-wise finiteness check and for the ``index_copy_`` cost ~1.3 us of
dispatch per chunk and two copies of its bytes (one stack for the check, one
for the write; measured on 48 chunks of 8 KiB: 1.27 us per chunk for
``from_bytes`` + ``torch.stack`` against 0.13 us for one ``bytes.join`` of the
payloads, one ``frombuffer`` and a ``view``).  :class:`ChunkRows` joins the
payloads of each bucket's full-length chunks once, in arrival order, and the
checks and writes use that block; the bytes are the same bytes, so what is
written is bit for bit what one ``copy_`` per chunk writes.  Short chunks (a
bucket's last), chunks too large to stack (:func:`~gossipnet.collectives.chunks.worth_stacking`)
and a bucket's only chunk of the run are viewed one by one, as before.

Every packet is still decided on its own (each carries its own MAC, checked by
the codec, and each is counted once: accepted or dropped with its reason);
the block only changes how the accepted bytes are moved.
"""

from __future__ import annotations

import torch

from gossipnet.collectives.chunks import all_finite, from_bytes, worth_stacking
from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.stale_step import StaleStep
from gossipnet.transport.wire import Packet

__all__ = ("ChunkRows", "write_rows")

#: Dtypes whose finiteness a row sum tells (``chunks.all_finite``'s rule).
_SUM_CHECKED = (torch.float32, torch.float64)

#: One checked data chunk: ``(packet, bucket, chunk)`` (:func:`.packets.chunk_ids`).
Item = tuple[Packet, int, int]


class ChunkRows:
    """The values of checked chunks ``items`` of ``rnd``, in order.

    ``row[i]`` is item ``i``'s row in ``blocks[bucket]`` (a ``[k, chunk_elems]``
    tensor over one joined copy of the payloads), or -1 where the item is viewed
    on its own (:meth:`values`).  The blocks are read-only in effect (their
    memory is a ``bytes`` object): read them, never write them.
    """

    __slots__ = ("_items", "_members", "_rnd", "blocks", "row")

    def __init__(self, rnd: Round, items: list[Item]) -> None:
        self._rnd, self._items = rnd, items
        self.row = [-1] * len(items)
        self.blocks: dict[int, torch.Tensor] = {}
        self._members: dict[int, list[int]] = {}  # bucket -> items in its block, in order
        groups: dict[int, list[int]] = {}
        for i, (_, b, c) in enumerate(items):
            plan = rnd.plans[b]
            step = plan.chunk_elems
            if (c + 1) * step <= plan.numel and worth_stacking(step, plan.dtype):
                groups.setdefault(b, []).append(i)
        for b, idx in groups.items():
            if len(idx) < 2:
                continue
            plan = rnd.plans[b]
            joined = b"".join([items[i][0].payload for i in idx])
            block = from_bytes(joined, plan.dtype, len(idx) * plan.chunk_elems)
            self.blocks[b] = block.view(len(idx), plan.chunk_elems)
            self._members[b] = idx
            for r, i in enumerate(idx):
                self.row[i] = r

    def values(self, i: int) -> torch.Tensor:
        """Item ``i``'s values (a row of its block, or a view of its payload)."""
        pkt, b, c = self._items[i]
        r = self.row[i]
        if r >= 0:
            return self.blocks[b][r]
        plan = self._rnd.plans[b]
        return from_bytes(pkt.payload, plan.dtype, plan.chunk(c)[1])

    def rows(self, b: int, idx: list[int]) -> torch.Tensor:
        """The block rows of items ``idx`` (all in bucket ``b``'s block), in that
        order: the block itself where ``idx`` is all of it, in order (no copy)."""
        block = self.blocks[b]
        if idx == self._members[b]:
            return block
        return block.index_select(0, torch.tensor([self.row[i] for i in idx]))

    def finite(self) -> list[bool]:
        """Per item, whether its values are all finite: one row sum per block for
        float32/float64 (:func:`~gossipnet.collectives.chunks.all_finite`'s rule),
        else per item."""
        out = [True] * len(self._items)
        for b, block in self.blocks.items():
            idx = self._members[b]
            if block.dtype in _SUM_CHECKED:
                ok = torch.isfinite(block.sum(dim=1)).tolist()
            else:
                ok = [all_finite(row) for row in block.unbind(0)]
            for i, fine in zip(idx, ok, strict=True):
                out[i] = fine
        for i, r in enumerate(self.row):
            if r < 0:
                out[i] = all_finite(self.values(i))
        return out


def write_rows(rnd: Round, b: int, chunks: list[tuple[int, int]], vals: ChunkRows) -> None:
    """Copy accepted chunks ``(chunk, item)`` of bucket ``b`` into ``rnd.dst[b]``:
    those of the block with one ``index_copy_``, the others one ``copy_`` each.

    Rounds that measure steps (``rnd.step_mag``) measure before writing, the
    block's rows together (:meth:`.stale_step.StaleStep.measure_rows`).
    """
    plan, dst = rnd.plans[b], rnd.dst[b]
    step = plan.chunk_elems
    stacked = [(c, i) for c, i in chunks if vals.row[i] >= 0]
    if len(stacked) > 1:
        grid = dst[: (dst.numel() // step) * step].view(-1, step)
        rows = vals.rows(b, [i for _, i in stacked]).to(dst.dtype)
        idx = torch.tensor([c for c, _ in stacked])
        if rnd.step_mag is not None:
            StaleStep.measure_rows(rnd, b, idx, rows)
        grid.index_copy_(0, idx, rows)
    else:
        stacked = []
    for c, i in chunks:
        if stacked and vals.row[i] >= 0:
            continue
        values = vals.values(i)
        if rnd.step_mag is not None:
            StaleStep.measure(rnd, b, c, values)
        plan.view(dst, c).copy_(values)
