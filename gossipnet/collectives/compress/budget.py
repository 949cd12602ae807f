"""What fits one compressed packet, per family and value codec.

Why one module: a compressed chunk is sized so its payload fills about one
packet (``Config.chunk_bytes`` or the transport's size, the session's
``base_chunk``), and three places must agree on the bytes each part costs: the
chunk size itself (:func:`chunk_elems`), how many blocks an owner may put in a
chunk's next ARC-Top-K set (:func:`next_size`), and how many sketch proposals
still fit beside a sender's values (:func:`proposals`).  Values cost
:func:`.quant.value_cost` each (4, 2 or 1 and 1/16; int8 also one scale per packet), so a
smaller codec gives larger chunks and fewer packets.  64 bytes are left for each
payload's own header.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gossipnet.collectives.compress import topk
from gossipnet.collectives.compress.quant import coded_bytes, value_cost
from gossipnet.collectives.compress.state import SessionState

__all__ = ("chunk_elems", "dct_cap", "next_size", "proposals")


def chunk_elems(sess: SessionState, base: int, participants: int) -> int:
    """Elements of a sparse family's chunk so its packets fit ``base`` bytes.

    ARC-Top-K: room for 3x the density in a chunk (:func:`next_size` shares the
    bucket's budget unevenly); DCT: every sender's entries must fit the owner's
    broadcast together.
    """
    n = max(1, participants)
    vb = value_cost(sess.values)
    room = base - 64 - 2 * math.ceil(n / 8) - coded_bytes(sess.values, 0)
    if sess.family == "topk":
        d, blk = 3 * sess.max_density(), sess.block
        per_elem = vb * d + 8 * d / blk + 6 * d / blk  # values, sets, proposals
        return int((room - (vb + 8) * blk) / per_elem)
    cap = room // ((4 + vb) * n)  # a u32 index and a value per entry
    return int(cap / (2 * sess.max_density()))


def dct_cap(sess: SessionState, n: int) -> int:
    """Entries a DCT chunk of ``n`` may carry (the chunk was sized for it)."""
    return max(1, min(n, math.ceil(2 * sess.max_density() * n)))


def top_cut(sess: SessionState, b: int, own: torch.Tensor, mult: int) -> float | torch.Tensor:
    """The value a block of bucket ``b`` (block energies ``own``) must reach to be
    among the top ``mult x density`` of the bucket: one number, or under Accordion
    one per block (the top of each density group of layers, so a critical layer
    gets its light setting's budget and a calm one its heavy setting's)."""
    m = own.numel()
    dens = sess.block_densities(b, m)
    if dens is None:
        k = max(1, min(m, mult * round(sess.density(b) * m)))
        return float(torch.topk(own, k).values[-1])
    cut = torch.empty(m)
    for d in torch.unique(dens):
        sel = dens == d
        group = own[sel]
        k = max(1, min(group.numel(), mult * round(float(d) * group.numel())))
        cut[sel] = torch.topk(group, k).values[-1]
    return cut


def proposals(
    sess: SessionState, b: int, off: int, res: torch.Tensor, nvals: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our sketch of a chunk: the blocks of its residual (block norms ``res``) among
    the top ``2K`` of our whole bucket, as (ids, norms): a sparse sketch.

    Why sparse: a norm per block of every chunk cost 2/B bytes per element, three
    times the values themselves at density 0.01; the owner only ranks the
    largest blocks, so the candidates near the top are all it needs (blocks
    nobody proposes sum to 0).  Capped by what still fits the packet.
    """
    tau = sess.tau2.get(b)
    if tau is None:
        tau = sess.tau2[b] = top_cut(sess, b, sess.sketch(b, 0, sess.u[b]), 2)
    if isinstance(tau, torch.Tensor):  # per block of the bucket: this chunk's blocks
        first = off // sess.block
        tau = tau[first : first + res.numel()]
    ids = torch.nonzero((res >= tau) & (res > 0)).flatten()
    room = max(0, (sess.base_chunk - 64 - coded_bytes(sess.values, nvals)) // 6)
    if ids.numel() > room:
        ids = torch.sort(ids[torch.topk(res[ids], room).indices]).values
    return ids, res[ids]


def next_size(sess: SessionState, rnd: Any, b: int, off: int, n: int) -> int:
    """How many blocks the next set of chunk ``[off, off + n)`` holds: its share of
    the bucket's budget, at least one, at most what fits a packet.

    Why not ``density`` of every chunk: gradient mass is not spread evenly over a
    bucket (a layer's bias, the last layer), and an equal budget per chunk
    wasted it (measured on a regression: held-out MSE 0.117 with a budget per
    chunk, 0.046 with one for the bucket, dense 0.036).  The share: how many of
    the top ``K = density x blocks`` blocks of our *own* whole-bucket sketch fall
    in the chunk (the owner sees only its chunks' summed sketches; where the
    mass sits is what peers share).  Which blocks: the chunk's top by the summed sketch.
    """
    blk = sess.block
    hot = sess.hot.get(b)
    if hot is None:
        own = sess.sketch(b, 0, sess.e[b] + sess.m[b]).square_()
        tau = top_cut(sess, b, own, 1)
        hot = sess.hot[b] = torch.cumsum(((own >= tau) & (own > 0)).to(torch.int64), 0)
    lo, hi = -(-off // blk), -(-(off + n) // blk)
    share = int(hot[hi - 1]) - (int(hot[lo - 1]) if lo > 0 else 0) if hi > lo else 0
    m = topk.block_count(n, blk)
    nparts = len(rnd.participants)
    room = sess.base_chunk - 64 - 2 * m - 2 * math.ceil(nparts / 8) - coded_bytes(sess.values, 0)
    # values (int8: a shift per 16 of them), two set ids, an age per block
    cap = int(room // (math.ceil(value_cost(sess.values) * blk) + 9))
    return max(1, min(share, cap, m))
