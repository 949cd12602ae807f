"""ARC-Top-K's pure functions: block sketches, set selection, values at a set.

An index set is a sorted tensor of *block* ids: block ``k`` of a chunk is its
elements ``[k * B, min((k + 1) * B, n))``.  Why blocks: the set travels in the
owner's broadcast (4 bytes per block, not per element) and the sketch that
chooses it is one number per block, so both cost ``1/B`` of the chunk; the
values then go without indices.  Choosing the blocks of largest norm keeps at
least ``k / m`` of the energy of ``m`` blocks, so ``C(x)`` (``x`` at the set of its
own top blocks) is contractive: ``||x - C(x)||^2 <= (1 - k/m) ||x||^2``.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = (
    "block_count",
    "block_mean",
    "block_sums",
    "block_indices",
    "bootstrap_blocks",
    "choose_blocks",
    "compress_at",
    "nblocks_for",
    "per_element",
    "sketch",
)


def block_count(n: int, block: int) -> int:
    """Blocks of ``block`` elements in a chunk of ``n`` (the last may be short)."""
    return -(-n // block)


def nblocks_for(n: int, block: int, density: float) -> int:
    """Blocks to send for ``density`` of ``n`` elements: at least one, at most all."""
    m = block_count(n, block)
    return max(1, min(m, round(density * n / block + 0.4999)))


def block_sums(x: torch.Tensor, block: int) -> torch.Tensor:
    """The sum of ``x`` over each block of ``block`` elements (the last may be short)."""
    n = x.numel()
    m = block_count(n, block)
    pad = m * block - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(m, block).sum(dim=1)


def sketch(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block L2 norms of ``x`` (float32, one per block)."""
    return block_sums(x.to(torch.float32).square(), block).sqrt_()


def block_mean(x: torch.Tensor, block: int) -> torch.Tensor:
    """The mean of ``x`` over each block (the last, if short, over its own elements)."""
    counts = torch.full((block_count(x.numel(), block),), float(block))
    if x.numel() % block:
        counts[-1] = x.numel() % block
    return block_sums(x, block) / counts


def choose_blocks(energy: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` blocks of largest ``energy``, sorted ascending (int64).

    Ties break by the lower block id (a stable sort), so every peer that sums
    the same sketches picks the same set.
    """
    k = max(0, min(k, energy.numel()))
    order = torch.sort(energy, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def bootstrap_blocks(round_id: int, bucket: int, chunk: int, m: int, k: int) -> torch.Tensor:
    """The deterministic set of a chunk without an announced one (round 0, a new
    owner): ``k`` of ``m`` blocks drawn from a seed every peer derives from
    ``(round, bucket, chunk)``, so all peers use the same set with no message."""
    seed = int.from_bytes(
        hashlib.blake2b(f"{round_id}:{bucket}:{chunk}".encode(), digest_size=8).digest(), "little"
    )
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.sort(torch.randperm(m, generator=gen)[: max(1, min(k, m))]).values


def block_indices(blocks: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Element indices of ``blocks`` in a chunk of ``n`` (int64, ascending)."""
    idx = blocks.to(torch.int64)[:, None] * block + torch.arange(block, device=blocks.device)
    idx = idx.flatten()
    return idx[idx < n]


def per_element(per_block: torch.Tensor, blocks: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """``per_block`` (one value per block of ``blocks``) spread over the elements
    :func:`block_indices` gives, in the same order."""
    if not blocks.numel():
        return per_block[:0]
    spread = per_block[:, None].expand(-1, block).flatten()
    idx = (blocks.to(torch.int64)[:, None] * block + torch.arange(block)).flatten()
    return spread[idx < n]


def compress_at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``C(x)`` as a dense tensor: ``x`` at ``idx``, zero elsewhere."""
    out = torch.zeros_like(x)
    out[idx] = x[idx]
    return out
