"""XOR parity packets: forward error correction for a phase's data packets.

Why: a lost gradient contribution costs variance and a lost parameter
broadcast leaves a replica one step stale; both cost model quality (10% loss
from scratch: ~3% perplexity, ``bench/quality.py``).  Copies
(``Config.redundancy``) turn loss p into about p^2 at twice the traffic.  One
parity packet per group of k data packets, the XOR of their bytes, recovers
any single lost packet of the group: a chunk then stays lost only if another
packet of its group is lost too, p * (1 - (1 - p)^k), at 1/k more traffic
(p = 10%, k = 3: 2.7% at +33%).  It is sent once, after the data, and never
waited for: no retransmission, no round trip.

Layout (both ends compute it, nothing but ``k`` travels): a sender's stream of
``n`` consecutive chunks to one receiver (the receiver's owned range in the
reduce-scatter, the sender's own range in the all-gather) is cut into
``G = floor(n / k)`` interleaved groups, chunk ``i`` in group ``i % G``: groups
of k to 2k - 1 chunks, so parity never costs more than 1/k of the traffic, and
a stream of fewer than k chunks gets none (one "group" of a single chunk would
be a full copy, twice its traffic for what ``Config.redundancy=2`` offers
explicitly; measured at 1M elements, one chunk per owner: 1.6x the time).
Interleaving puts neighbours in different groups, so a burst that takes
several consecutive packets costs each group one at most.  Recovered chunks
are bit-identical to what was sent (XOR is exact, any dtype), so an all-reduce
stays exact where anything arrived and unbiased under random loss: whether a
chunk is recovered depends on which packets were lost, never on their values.

To XOR a group's survivors with its parity, the receiver of a reduce-scatter
stream that announces parity (``"x"`` in its data fields) keeps each payload
(a reference to the received frame, no copy) until the round ends, as only
their sum is kept otherwise; an all-gather's survivors are read back from
``dst``, where they were written byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from gossipnet.collectives.chunks import all_finite, from_bytes
from gossipnet.transport.base import Buffer
from gossipnet.transport.wire import Packet

if TYPE_CHECKING:
    from gossipnet.collectives.lossy.context import PhaseContext
    from gossipnet.collectives.lossy.round import Round

from gossipnet.collectives.lossy.wirebytes import count_sent, count_sent_run

__all__ = (
    "MAX_GROUP",
    "group_count",
    "group_length",
    "members",
    "on_parity",
    "parities",
    "parity_bytes",
    "recover",
    "send_parity",
)

#: Largest group size a receiver accepts (``Config.parity_group`` is capped the same).
MAX_GROUP = 64


def group_count(nchunks: int, k: int) -> int:
    """Groups of ``k`` to ``2k - 1`` chunks that ``nchunks`` chunks are cut into
    (0 when fewer than ``k``: such a stream sends no parity)."""
    return nchunks // k


def members(first: int, nchunks: int, k: int, g: int) -> range:
    """Chunk indices of group ``g`` of the stream of chunks ``first .. first + nchunks``
    (``0 <= g < group_count(nchunks, k)``)."""
    return range(first + g, first + nchunks, group_count(nchunks, k))


def group_length(nchunks: int, g: int, chunk_bytes: int, last_bytes: int) -> int:
    """Bytes of group ``g``'s parity: its longest member.  Only the last chunk is
    short, and it is a group's longest member only when alone in it (k = 1, g = n - 1)."""
    return last_bytes if g == nchunks - 1 else chunk_bytes


def parity_bytes(nbytes: int, chunk_bytes: int, k: int) -> int:
    """Bytes :func:`parities` writes for a stream of ``nbytes``: ``G`` chunk widths."""
    return group_count(-(-nbytes // chunk_bytes), k) * chunk_bytes


def parities(
    raw: Buffer, chunk_bytes: int, k: int, out: np.ndarray | None = None
) -> list[memoryview]:
    """The parity of every group of the chunks laid out back to back in ``raw``.

    ``raw`` holds ``n`` chunks of ``chunk_bytes`` (the last may be shorter).  One
    vectorised pass: with the stream viewed as rows of ``G`` chunks, chunk ``i``
    sits in row ``i // G``, column ``i % G``; XOR-reducing the rows gives all G
    parities at once, and the last, partial row is XORed into their front.
    ``out``: a uint8 array of :func:`parity_bytes` to write into (reused memory:
    fresh pages cost a fault each); the views returned are read-only, so a
    transport may send them without a copy.
    """
    data = np.frombuffer(raw, dtype=np.uint8)
    total = data.size
    n = -(-total // chunk_bytes)
    groups = group_count(n, k)
    if not groups:
        return []
    width = groups * chunk_bytes
    rows = total // width
    if out is None:
        out = np.empty(width, dtype=np.uint8)
    if out.shape != (width,) or out.dtype != np.uint8:
        raise ValueError(f"out must be {width} uint8, got {out.shape} {out.dtype}")
    if not rows:
        out.fill(0)
    else:
        # 8 bytes per XOR where the widths allow it (chunk sizes are multiples of 8)
        word = np.uint64 if width % 8 == 0 else np.uint8
        np.bitwise_xor.reduce(
            data[: rows * width].view(word).reshape(rows, -1), axis=0, out=out.view(word)
        )
    tail = data[rows * width :]
    out[: tail.size] ^= tail
    last = total - (n - 1) * chunk_bytes
    view = out.data.cast("B").toreadonly()
    return [
        view[g * chunk_bytes : g * chunk_bytes + group_length(n, g, chunk_bytes, last)]
        for g in range(groups)
    ]


def recover(parity: Buffer, survivors: Sequence[Buffer], length: int) -> memoryview:
    """The one missing member of a group: its parity XOR every member that arrived.

    Raises:
        ValueError: a survivor is longer than the parity (a forged layout).
    """
    acc = np.frombuffer(parity, dtype=np.uint8).copy()
    for s in survivors:
        part = np.frombuffer(s, dtype=np.uint8)
        if part.size > acc.size:
            raise ValueError("a group member is longer than its parity")
        acc[: part.size] ^= part
    return acc[:length].data.cast("B")


# ---------------------------------------------------------------- on the wire
def send_parity(
    ctx: PhaseContext,
    rnd: Round,
    kind: int,
    dests: Sequence[str],
    b: int,
    chunks: range,
    raw: memoryview,
    fields: dict[str, Any],
) -> int:
    """Send the parity packets of one stream: ``chunks`` of bucket ``b``, whose bytes
    are ``raw`` back to back, to ``dests``; returns the packets sent.

    ``fields`` are the stream's data fields (round, mode, dtype, weight); each
    parity adds its group ``g``, the group size ``gs`` and its byte length ``n``.
    """
    node, k = ctx.node, rnd.fec_k
    if not group_count(len(chunks), k):
        return 0  # a stream shorter than one group: no parity (the module's layout)
    plan = rnd.plans[b]
    width = plan.chunk_elems * plan.itemsize
    # round-private memory (the pool's set for this round), as queued sends need
    scratch = rnd.pool.get(
        rnd.parity, f"parity:{dests[0] if len(dests) == 1 else '*'}", b,
        parity_bytes(raw.nbytes, width, k), torch.uint8,
    ).numpy()  # fmt: skip
    groups = parities(raw, width, k, scratch)
    # one run: the first header packed and checked, the rest one struct call each
    packets = node.encode_run(
        dests, kind, {**fields, "gs": k}, [(b, g, p.nbytes) for g, p in enumerate(groups)],
        groups, chunk_key="g",
    )  # fmt: skip
    if len(dests) == 1:
        sent = node.send_batch(dests, packets, group_bytes=rnd.group_bytes)
        count_sent_run(rnd, packets, sent, 1)
    else:  # a broadcast (all-gather): each packet to every destination, framed once
        sent = 0
        for p in packets:
            n = node.send_frames(dests, p, group_bytes=rnd.group_bytes)
            count_sent(rnd, p, n)
            sent += n
    rnd.parity_sent += sent
    return sent


def on_parity(
    ctx: PhaseContext,
    rnd: Round,
    pkt: Packet,
    stream: Callable[[int], range],
    have: Callable[[int, int], bool],
    payload: Callable[[int, int], Buffer | None],
    accept: Callable[[int, int, torch.Tensor], None],
) -> None:
    """Recover the one lost member of ``pkt``'s group, if exactly one is lost.

    ``stream(b)``: the chunks of bucket ``b`` the sender sends us; ``have(b, c)``:
    whether chunk ``c`` already arrived from it; ``payload(b, c)``: the bytes it
    arrived with (None if not kept); ``accept(b, c, values)`` takes a recovered
    chunk as if its packet had arrived.  A parity whose group arrived whole, or
    lost two or more, does nothing.  Malformed ones are counted drops.
    """
    f = pkt.fields
    b, k, g = f.get("b"), f.get("gs"), f.get("g")
    if not (isinstance(b, int) and 0 <= b < len(rnd.plans)):
        ctx.dropped["bad_parity"] += 1
        return
    plan, chunks = rnd.plans[b], stream(b)
    n = len(chunks)
    if not (isinstance(k, int) and 1 <= k <= MAX_GROUP and isinstance(g, int) and n):
        ctx.dropped["bad_parity"] += 1
        return
    last = plan.chunk(chunks.stop - 1)[1] * plan.itemsize
    if not 0 <= g < group_count(n, k) or len(pkt.payload) != group_length(
        n, g, plan.chunk_elems * plan.itemsize, last
    ):
        ctx.dropped["bad_parity"] += 1
        return
    group = members(chunks.start, n, k, g)
    lost = [c for c in group if not have(b, c)]
    if len(lost) != 1:
        return
    (c,) = lost
    survivors = [payload(b, m) for m in group if m != c]
    if any(s is None for s in survivors):
        return  # a member came without "x" (a sender that changed its mind): no copy kept
    _, count = plan.chunk(c)
    values = from_bytes(
        recover(pkt.payload, cast(list[Buffer], survivors), count * plan.itemsize),
        plan.dtype,
        count,
    )
    if not all_finite(values):
        ctx.dropped["non_finite"] += 1
        return
    for m in group:
        rnd.fec_held.pop((pkt.src, b, m), None)
    rnd.recovered += 1
    accept(b, c, values)
