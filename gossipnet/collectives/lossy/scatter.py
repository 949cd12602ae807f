"""The reduce-scatter half of a round: send contributions, add up what arrives.

Split from :mod:`gossipnet.collectives.lossy.engine`, which drives the round and
routes packets; this module holds what the first phase does.  Each peer sends
every chunk it does not own to the chunk's owner, once, in a staggered
round-robin over the owners, from a read-only view of ``src`` (no copy), then
an END marker per owner saying how many it sent.  The owner keeps each
contribution (:mod:`.reducer`), and at the phase's end adds them up weighted by
their senders' weights, in a fixed order (arrival order would change the bits
from run to run), and divides each chunk by the weights that arrived for it:
unbiased under random loss, where dividing by N would be biased low by about (1 - p).
The second phase, the all-gather, is :mod:`gossipnet.collectives.lossy.gather`.
"""

from __future__ import annotations

import asyncio
import collections

import torch

from gossipnet.collectives.chunks import as_bytes, from_bytes
from gossipnet.collectives.lossy import bundle
from gossipnet.collectives.lossy.context import PhaseContext
from gossipnet.collectives.lossy.packets import (
    COPY_LAG,
    YIELD_EVERY,
    Send,
    bundled,
    chunk_ids,
    compressed_fields,
    send_copies,
    send_copy,
    unbundle,
)
from gossipnet.collectives.lossy.parity import group_count, on_parity, send_parity
from gossipnet.collectives.lossy.reducer import OwnedShard, valid_weight
from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.rows import ChunkRows
from gossipnet.collectives.lossy.wirebytes import count_sent, count_sent_run
from gossipnet.transport.base import Buffer
from gossipnet.transport.wire import DTYPE_CODES, Packet

__all__ = (
    "RsPart",
    "accept_rs_batch",
    "announce_rs_end",
    "finish_rs",
    "on_rs",
    "rs_order",
    "rs_part",
    "rs_parts",
    "send_rs",
)


async def send_rs(ctx: PhaseContext, rnd: Round, weight: float) -> None:
    """Send each chunk we do not own to its owner (and its copies), then our ENDs."""
    node = ctx.node
    kind = ctx.k.rs_data
    per_dest: collections.Counter[str] = collections.Counter()
    copies: collections.deque[Send] | None = collections.deque() if rnd.redundancy > 1 else None
    codes = [DTYPE_CODES[buf.dtype] for buf in rnd.src]
    # Sliced per chunk: no per-chunk copy.  Read-only = frozen (transport.base.is_frozen):
    # sent without a copy, as ``src`` does not change while the round runs.  What can
    # change it is our own all-gather writing a chunk whose owner already cut us
    # (dst is src for an in-place call) or the caller's next step while a packet to
    # a peer we cut still sits in a queue; such a packet is useless to its owner by
    # then, and fails its MAC there (counted, never used) instead of arriving stale.
    raws = [as_bytes(buf).toreadonly() for buf in rnd.src]
    # streams (owner, bucket) long enough for a parity group: only their payloads
    # are worth keeping at the receiver
    k = rnd.fec_k
    fec = {
        (owner, b)
        for b, smap in enumerate(rnd.maps) if k
        for owner in smap.participants
        if group_count(len(smap.chunks_of(owner)), k)
    }  # fmt: skip
    order = rs_order(rnd)
    for start in range(0, len(order), YIELD_EVERY):
        # a slice of the round-robin, sent per (owner, bucket) as one run
        groups: dict[tuple[str, int], list[int]] = {}
        for owner, b, c in order[start : start + YIELD_EVERY]:
            groups.setdefault((owner, b), []).append(c)
        for (owner, b), chunks in groups.items():
            if rnd.codec is not None:
                packets = compressed_rs(ctx, rnd, owner, b, chunks, weight)
            else:
                plan, raw = rnd.plans[b], raws[b]
                common = {**rnd.ident, "w": weight, "dt": codes[b]}
                if (owner, b) in fec:
                    common["x"] = rnd.fec_k  # parity follows: keep this payload to recover with
                rows = [(b, c, plan.chunk(c)[1]) for c in chunks]
                payloads = [raw[plan.byte_slice(c)] for c in chunks]
                packets = node.encode_run((owner,), kind, common, rows, payloads)
            n = node.send_batch((owner,), packets, group_bytes=rnd.group_bytes)
            rnd.sent += n
            count_sent_run(rnd, packets, n, 1, "rs")
            per_dest[owner] += len(chunks)  # ENDs count chunks (a bundle holds several)
            if copies is not None:
                for frames in packets:
                    copies.append(((owner,), frames))
                    if len(copies) > COPY_LAG:
                        send_copy(node, rnd, copies.popleft())
        if len(order) - start >= YIELD_EVERY:  # after every YIELD_EVERY packets
            await asyncio.sleep(0)
    if rnd.fec_k:
        await _send_rs_parity(ctx, rnd, raws, codes, weight)
    await send_copies(node, rnd, copies)
    rnd.rs_sent_to = per_dest
    announce_rs_end(ctx, rnd, ctx.end_copies(rnd))


async def _send_rs_parity(
    ctx: PhaseContext, rnd: Round, raws: list[memoryview], codes: list[str], weight: float
) -> None:
    """Parity packets of every stream we sent: each owner's range of each bucket."""
    for b, smap in enumerate(rnd.maps):
        plan = rnd.plans[b]
        for owner in smap.participants:
            chunks = smap.chunks_of(owner)
            if owner == rnd.me or not len(chunks):
                continue
            span = slice(plan.byte_slice(chunks.start).start, plan.byte_slice(chunks.stop - 1).stop)
            fields = {**rnd.ident, "w": weight}
            kind = ctx.k.rs_data
            rnd.sent += send_parity(ctx, rnd, kind, (owner,), b, chunks, raws[b][span], fields)
            await asyncio.sleep(0)


def compressed_rs(
    ctx: PhaseContext, rnd: Round, owner: str, b: int, chunks: list[int], weight: float
) -> list[list[Buffer]]:
    """The packets of our compressed contributions to ``owner``'s ``chunks`` of
    bucket ``b``: consecutive ones share a packet while they fit (:mod:`.bundle`)."""
    codec = rnd.codec
    assert codec is not None
    records = [(c, *codec.encode_rs(rnd, owner, b, c)) for c in chunks]
    fields: dict[str, object] = {**rnd.ident, "b": b, "w": weight, "dt": "u8"}
    return bundled(ctx.node, ctx.k.rs_data, (owner,), fields, records)


def announce_rs_end(ctx: PhaseContext, rnd: Round, copies: int = 1) -> None:
    """END of our reduce-scatter to each other participant: how many we sent it.

    ``copies`` are the same packet (one encoding): the first to arrive counts,
    the receiver's replay window drops the others.
    """
    if copies < 1:  # a quiet network: no END at all, so none to encode (and sign)
        return
    node = ctx.node
    lossy = int(ctx.loss.recent)
    for peer in rnd.participants:
        if peer != rnd.me:
            end = {
                **rnd.ident,
                "n": rnd.rs_sent_to[peer],
                "l": lossy,
            }
            frames = node.encode_for((peer,), ctx.k.rs_end, end)
            sent = 0
            for _ in range(copies):
                sent += node.send_frames((peer,), frames, group_bytes=rnd.group_bytes)
            count_sent(rnd, frames, sent, control=True)


def rs_order(rnd: Round) -> list[tuple[str, int, int]]:
    """(owner, bucket, chunk) in sending order: round-robin over the owners,
    each peer starting at the owner after itself.

    Why: shards are contiguous, so chunk order would make every peer send to
    the first owner at once, then all to the second: one receiver's buffers
    overflow while the others idle.  Staggered round-robin spreads the load
    over all receivers at every moment (and over a paced link's queues).
    """
    per_owner: dict[str, list[tuple[str, int, int]]] = {}
    for b, smap in enumerate(rnd.maps):
        for p in smap.participants:
            if p == rnd.me:
                continue
            chunks = smap.chunks_of(p)
            if len(chunks):
                per_owner.setdefault(p, []).extend((p, b, c) for c in chunks)
    parts = rnd.participants
    me = parts.index(rnd.me) if rnd.me in parts else 0
    ring = [parts[(me + i) % len(parts)] for i in range(1, len(parts))]
    queues = [per_owner[p] for p in ring if p in per_owner]
    longest = max((len(q) for q in queues), default=0)
    return [q[i] for i in range(longest) for q in queues if i < len(q)]


def finish_rs(rnd: Round) -> list[OwnedShard]:
    """Average every bucket's owned shard (:meth:`.reducer.ShardReducer.average`).

    In place in the accumulators (one pass, no copy); later contributions are late.
    """
    shards = []
    for b, red in enumerate(rnd.reducers):
        span = rnd.maps[b].owned_range(rnd.me)
        avg = red.average(rnd.src[b].narrow(0, span.start, len(span)))
        shards.append(OwnedShard(b, span.start, avg, red.weights, red.contributors))
    rnd.rs_closed = True
    return shards


def on_rs(ctx: PhaseContext, rnd: Round, pkt: Packet) -> None:
    """Add one contribution into our accumulator (weighted), once per (sender, chunk).

    A parity packet (``"g"`` in its fields) may rebuild one lost contribution; a
    bundle (:mod:`.bundle`) is taken record by record, each as a packet.
    """
    if pkt.fields.get("z") == bundle.BUNDLE:
        for one in unbundle(ctx.dropped, pkt):
            on_rs(ctx, rnd, one)
        return
    part = rs_part(ctx, rnd, pkt)
    if part is not None:
        src, b, c, values, w, keep = part
        if values is not None:  # always: rs_part views by default
            _accept_rs(ctx, rnd, src, b, c, values, w, keep)


#: A checked contribution: (sender, bucket, chunk, values, weight, payload to keep);
#: values None only from ``rs_part(view=False)``: a dense chunk not yet viewed.
RsPart = tuple[str, int, int, torch.Tensor | None, float, memoryview | None]


def rs_part(ctx: PhaseContext, rnd: Round, pkt: Packet, *, view: bool = True) -> RsPart | None:
    """What :func:`on_rs` does before adding: the checks of ``pkt`` as a contribution.

    ``view``: False leaves a dense chunk's values None (:func:`rs_parts` makes
    them for a whole run at once).

    Returns the contribution, or None where the packet was dropped (counted) or
    was a parity packet (handled here, as :func:`on_rs` does).
    """
    w = pkt.fields.get("w", 1.0)
    if not valid_weight(w):  # in [0, MAX_WEIGHT]: no weighted sum can overflow
        ctx.dropped["bad_weight"] += 1
        return None
    if pkt.src in rnd.rs.ended:  # it was overtaken by its sender's END: learn by how much
        ctx.note_after_end(rnd, pkt)
    if rnd.rs_closed:  # our averages are taken (and may be on the wire): too late
        ctx.dropped["late"] += 1
        ctx.note_stall(rnd, pkt)
        rnd.late += 1
        return None
    src = pkt.src
    if "g" in pkt.fields:
        on_parity(
            ctx,
            rnd,
            pkt,
            lambda b: rnd.owned[b],
            lambda b, c: rnd.reducers[b].has(src, c),
            lambda b, c: rnd.fec_held.get((src, b, c)),
            lambda b, c, values: _accept_rs(ctx, rnd, src, b, c, values, float(w), None),
        )
        return None
    if "z" in pkt.fields:
        return _compressed_part(ctx, rnd, pkt, float(w))
    if rnd.codec is not None:  # a dense contribution to a compressed round: another setting
        ctx.dropped["compressed_kind"] += 1
        return None
    ids = chunk_ids(rnd, pkt, ctx.dropped)  # the reducer checks the values
    if ids is None:
        return None
    b, c = ids
    plan = rnd.plans[b]
    values = from_bytes(pkt.payload, plan.dtype, plan.chunk(c)[1]) if view else None
    keep = pkt.payload if pkt.fields.get("x") else None
    return src, b, c, values, float(w), keep


def rs_parts(
    ctx: PhaseContext, rnd: Round, pkts: list[Packet]
) -> tuple[list[RsPart], ChunkRows | None, list[int]]:
    """:func:`rs_part` for a run of one drain, the dense chunks' values made together.

    Returns the parts, the run's :class:`.rows.ChunkRows` (None where no part
    is a dense chunk) and, per row item, its part's index.  Parts whose values
    are a row of a block keep None as values (:func:`accept_rs_batch` passes
    the block); the others are viewed as before.
    """
    parts: list[RsPart] = []
    items: list[tuple[Packet, int, int]] = []
    where: list[int] = []
    for pkt in pkts:
        part = rs_part(ctx, rnd, pkt, view=False)
        if part is None:
            continue
        if part[3] is None:
            items.append((pkt, part[1], part[2]))
            where.append(len(parts))
        parts.append(part)
    if not items:
        return parts, None, where
    vals = ChunkRows(rnd, items)
    for k, i in enumerate(where):
        if vals.row[k] < 0:
            src, b, c, _, w, keep = parts[i]
            parts[i] = (src, b, c, vals.values(k), w, keep)
    return parts, vals, where


def _compressed_part(ctx: PhaseContext, rnd: Round, pkt: Packet, w: float) -> RsPart | None:
    """A compressed contribution decoded to its chunk's dense values (or a counted drop).

    One without usable values (only a sketch, another index set) still arrives,
    with weight 0: its sender is complete, and nothing of it is added.
    """
    fields = compressed_fields(ctx.dropped, rnd, pkt)
    if fields is None or rnd.codec is None:
        return None
    b, c, z = fields
    codec = rnd.codec
    if c not in rnd.owned[b]:
        ctx.dropped["not_owner"] += 1
        return None
    if rnd.reducers[b].has(pkt.src, c):
        ctx.dropped["duplicate"] += 1
        return None
    got = codec.decode_rs(rnd, pkt.src, b, c, z, pkt.payload, w)
    if isinstance(got, str):
        ctx.dropped[got] += 1
        return None
    values, weight = got
    return pkt.src, b, c, values, w if weight is None else weight, None


def accept_rs_batch(
    ctx: PhaseContext,
    rnd: Round,
    parts: list[RsPart],
    vals: ChunkRows | None = None,
    where: list[int] | None = None,
) -> None:
    """:func:`_accept_rs` for each of ``parts`` in order, adding per bucket in one call.

    The reducer (:meth:`.reducer.ShardReducer.accumulate_batch`) decides each part
    as it would one by one; the bookkeeping then follows in arrival order.
    ``vals``/``where``: from :func:`rs_parts`, the blocks the parts' rows are in.
    """
    if len(parts) == 1 and parts[0][3] is not None:  # one part: no batch to build
        src, b, c, values, w, keep = parts[0]
        if values is not None:
            _accept_rs(ctx, rnd, src, b, c, values, w, keep)
        return
    reasons: list[str | None] = [None] * len(parts)
    buckets: dict[int, list[int]] = {}
    for i, part in enumerate(parts):
        buckets.setdefault(part[1], []).append(i)
    for b, idx in buckets.items():
        got = rnd.reducers[b].accumulate_batch(
            [(parts[i][0], parts[i][2], parts[i][3], parts[i][4]) for i in idx],
            stacked=_stacked(vals, where, b, idx),
        )
        for i, reason in zip(idx, got, strict=True):
            reasons[i] = reason
    for (src, b, c, _, _, keep), reason in zip(parts, reasons, strict=True):
        if reason is not None:
            ctx.dropped[reason] += 1
        else:
            _counted_rs(ctx, rnd, src, b, c, keep)


def _stacked(
    vals: ChunkRows | None, where: list[int] | None, b: int, idx: list[int]
) -> tuple[torch.Tensor, list[int]] | None:
    """Bucket ``b``'s block as the reducer takes it: rows and their parts' places in ``idx``."""
    if vals is None or where is None or b not in vals.blocks:
        return None
    local = {i: n for n, i in enumerate(idx)}
    members = [local[where[k]] for k, r in enumerate(vals.row) if r >= 0 and where[k] in local]
    return vals.blocks[b], members


def _accept_rs(
    ctx: PhaseContext,
    rnd: Round,
    src: str,
    b: int,
    c: int,
    values: torch.Tensor,
    w: float,
    keep: memoryview | None,
) -> None:
    """Count one contribution (arrived, or rebuilt from parity) into our average.

    ``keep``: its payload, kept to rebuild a lost member of its parity group.
    """
    refused = rnd.reducers[b].accumulate(src, c, values, w)
    if refused is not None:  # not ours, a duplicate, non-finite: counted, never added
        ctx.dropped[refused] += 1
        return
    _counted_rs(ctx, rnd, src, b, c, keep)


def _counted_rs(
    ctx: PhaseContext, rnd: Round, src: str, b: int, c: int, keep: memoryview | None
) -> None:
    """The bookkeeping of one added contribution: kept payload, arrivals, completion."""
    if keep is not None:
        rnd.fec_held[(src, b, c)] = keep
    rs = rnd.rs
    rs.received[src] += 1
    now = ctx.node.clock.now()
    rs.arrived(src, now)
    if src not in rs.done and (
        rs.received[src] >= rnd.expect_rs
        or (src in rs.hold and not rs.held_back(src, rs.declared[src]))
    ):
        ctx.spans("rs").append(rs.finish(src, now))
