"""The all-gather half of a round: broadcast our averaged shard, keep stale on loss.

Split from :mod:`gossipnet.collectives.lossy.engine`, which drives the round (the
reduce-scatter is :mod:`.scatter`); this module holds what the second phase
does.  Each owner writes the values to broadcast for its shard (the averages,
or what ``on_reduced`` made of them, e.g. stepped parameters) into its own
``dst``, then sends every owned chunk to every other participant: one encoding
(one MAC) per chunk for all destinations, from read-only memory private to the
round, so ZeroMQ sends it without a copy.  A receiver writes each chunk that
arrives into ``dst`` and marks it; a chunk whose broadcast was lost keeps the
value ``dst`` already held (stale, never zero), and the round's report counts
it (``chunks_stale``).  Why stale, never zero, and never waited for: a peer's
own value keeps the drift between replicas bounded (Weintraub et al. 2025),
while a retransmission would make every round as slow as its worst link.
Resyncs, which must leave every peer identical, re-request lost chunks
(:mod:`.repair`), answered from the bytes kept in ``Round.broadcast``.
A compressed parameter round (the optimizer's, ``ChunkCodec.param_mode``) sends
each chunk's update from the value every replica holds and the receivers add it
(:mod:`gossipnet.collectives.compress.sparse`); a lost update leaves the
receiver's chunk where it was until the next resync.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
from collections.abc import Iterator

import torch

from gossipnet.collectives.chunks import as_bytes
from gossipnet.collectives.lossy import bundle
from gossipnet.collectives.lossy.context import PhaseContext
from gossipnet.collectives.lossy.cut import wait_phase
from gossipnet.collectives.lossy.packets import (
    COPY_LAG,
    YIELD_EVERY,
    Send,
    bundled,
    chunk_ids,
    chunk_of,
    compressed_fields,
    send_copies,
    send_copy,
    unbundle,
)
from gossipnet.collectives.lossy.parity import on_parity, send_parity
from gossipnet.collectives.lossy.reducer import OwnedShard, ShardReducer
from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.rows import ChunkRows, write_rows
from gossipnet.collectives.lossy.stale_step import StaleStep
from gossipnet.collectives.lossy.wirebytes import count_sent
from gossipnet.transport.base import Buffer
from gossipnet.transport.wire import DTYPE_CODES, Packet

__all__ = ("all_gather", "announce_ag_end", "on_ag", "on_ag_batch", "replay_ag", "send_ag")


async def all_gather(
    ctx: PhaseContext,
    rnd: Round,
    shards: list[OwnedShard],
    values: list[torch.Tensor],
    deadline: float,
) -> bool:
    """Broadcast ``values`` for our ``shards``, then wait for the others'; True if complete.

    Returns False when the phase was cut (lost ENDs, a silent or dead owner) or
    ``deadline`` passed; the chunks still missing then keep their stale values.
    """
    rnd.ag.start = ctx.node.clock.now()
    await send_ag(ctx, rnd, shards, values)
    return await wait_phase(
        ctx.node,
        rnd.ag,
        ctx.spans("ag"),
        deadline,
        rnd.ag_expected,
        lambda: announce_ag_end(ctx, rnd),
        lambda: ctx.quiet_wait(rnd),
    )


def _encode_shard(
    rnd: Round, shard: OwnedShard, value: torch.Tensor
) -> dict[int, tuple[int, bytes]]:
    """Our compressed broadcasts of ``shard``'s chunks, by chunk; ``value`` becomes
    what the receivers decode (so our own copy is bit-identical to theirs).

    A chunk the codec leaves dense is not in the result.  In a parameter round
    (the optimizer's: the codec sends each chunk's update from ``dst``) a chunk
    that is not sent (no weight arrived) keeps ``dst``'s value here too, as it
    does on every receiver: the update waits in the caller's residual.
    """
    codec = rnd.codec
    assert codec is not None
    b = shard.bucket
    plan, red = rnd.plans[b], rnd.reducers[b]
    owned = rnd.owned[b]
    out: dict[int, tuple[int, bytes]] = {}
    for c in owned:
        off, count = plan.chunk(c)
        view = value.narrow(0, off - shard.start, count)
        if shard.weights[c - owned.start] <= 0:
            if codec.param_mode and value is not shard.average:
                view.copy_(plan.view(rnd.dst[b], c))
            continue
        got = codec.encode_ag(rnd, b, c, view, functools.partial(_has, red, c))
        if got is not None:
            z, payload, decoded = got
            if decoded is not view:
                view.copy_(decoded)
            out[c] = (z, payload)
    return out


def _has(red: ShardReducer, c: int, sender: str) -> bool:
    return red.has(sender, c)


def _broadcast_bytes(rnd: Round, shard: OwnedShard, value: torch.Tensor) -> memoryview:
    """Write ``value`` into our ``dst`` shard; return read-only bytes to send it from.

    Sent from memory private to the round (``dst`` changes after the round,
    queued sends must not), read-only so that ZeroMQ sends it to every
    destination without copying.  The pooled accumulator itself when it is what
    we broadcast (a plain all-reduce): no copy at all.  Averaged in place
    (``dst`` is ``src``, see ``Round``), the average already is ``dst``, which the
    caller overwrites as soon as we return, while our broadcast may still sit in
    ZeroMQ's queues (our round ends when the others' shards have arrived, not
    ours): one copy then, measured: sending from ``dst`` left chunks stale at 0%
    loss.  (The reduce-scatter may send from ``src``: a round cannot end before
    the owners had our contributions or cut us.)  Kept in ``rnd.broadcast`` for
    repair requests.
    """
    b = shard.bucket
    out = rnd.dst[b].narrow(0, shard.start, value.numel())
    in_dst = value.numel() > 0 and value.data_ptr() == out.data_ptr()
    if not in_dst:
        out.copy_(value)  # cast to the bucket dtype
    if value is shard.average and value.dtype == out.dtype and not in_dst:
        private = value
    else:
        private = rnd.pool.get(rnd.parity, "bcast", b, out.numel(), out.dtype)
        private.copy_(out)
    raw = as_bytes(private).toreadonly()
    rnd.broadcast.append(raw)
    return raw


async def send_ag(
    ctx: PhaseContext, rnd: Round, shards: list[OwnedShard], values: list[torch.Tensor]
) -> None:
    """Send each owned chunk that has an average to every other participant, then ENDs.

    A chunk no weighted contribution arrived for is not sent: no average exists
    to share, and the receivers keep their own values for it.
    """
    node = ctx.node
    others = [p for p in rnd.participants if p != rnd.me]
    sent = 0
    # (ag_redundancy is 1 or the round's redundancy: send_copy sends the latter)
    copies: collections.deque[Send] | None = collections.deque() if rnd.ag_redundancy > 1 else None
    for shard, value in zip(shards, values, strict=True):
        b = shard.bucket
        encoded = _encode_shard(rnd, shard, value) if rnd.codec is not None else {}
        raw = _broadcast_bytes(rnd, shard, value)
        packets = _compressed_ag(ctx, rnd, shard, encoded, others) if encoded else []
        for frames in itertools.chain(packets, _dense_ag(ctx, rnd, shard, raw, encoded, others)):
            n = node.send_frames(others, frames, group_bytes=rnd.group_bytes)
            rnd.sent += n
            count_sent(rnd, frames, n, phase="ag")
            if copies is not None:
                copies.append((others, frames))
                if len(copies) > COPY_LAG:
                    send_copy(node, rnd, copies.popleft())
            sent += len(others)
            if sent >= YIELD_EVERY:
                sent = 0
                await asyncio.sleep(0)
        owned = rnd.owned[b]
        # parity over the whole range, so only where every chunk of it was sent
        if rnd.fec_k and bool((shard.weights > 0).all()) and len(owned):
            fields = dict(rnd.ident)
            rnd.sent += send_parity(ctx, rnd, ctx.k.ag_data, others, b, owned, raw, fields)
    await send_copies(node, rnd, copies)
    ends = ctx.end_copies(rnd)
    if not ends and rnd.ag_chunks_sent < rnd.expect_rs:  # expect_rs: the chunks we own
        ends = 1  # chunks withheld (no weight arrived): receivers need the count
    announce_ag_end(ctx, rnd, ends)


def _dense_ag(
    ctx: PhaseContext,
    rnd: Round,
    shard: OwnedShard,
    raw: memoryview,
    encoded: dict[int, tuple[int, bytes]],
    others: list[str],
) -> Iterator[list[Buffer]]:
    """The packets of our dense broadcast of ``shard``'s chunks with an average and
    not in ``encoded`` (sent compressed); one encoding (one MAC) for every destination."""
    b = shard.bucket
    plan, owned = rnd.plans[b], rnd.owned[b]
    code = DTYPE_CODES[rnd.dst[b].dtype]
    base = shard.start * plan.itemsize
    for c in owned:
        if shard.weights[c - owned.start] <= 0 or c in encoded:
            continue  # no average exists to share (no weight arrived), or sent compressed
        rnd.ag_chunks_sent += 1
        count = plan.chunk(c)[1]
        span = plan.byte_slice(c)
        fields = {**rnd.ident, "b": b, "c": c, "dt": code, "n": count}
        frames = ctx.node.encode_for(
            others, ctx.k.ag_data, fields, raw[span.start - base : span.stop - base]
        )
        yield frames


def _compressed_ag(
    ctx: PhaseContext,
    rnd: Round,
    shard: OwnedShard,
    encoded: dict[int, tuple[int, bytes]],
    others: list[str],
) -> list[list[Buffer]]:
    """The packets of our compressed broadcast of ``shard``: ``encoded`` (its chunks
    with an average, in chunk order, :func:`_encode_shard`), consecutive ones sharing
    a packet while they fit (:mod:`.bundle`); one encoding (one MAC) for every
    destination."""
    b = shard.bucket
    records = [(c, z, payload) for c, (z, payload) in encoded.items()]
    rnd.ag_chunks_sent += len(records)
    fields: dict[str, object] = {**rnd.ident, "b": b, "dt": "u8"}
    return bundled(ctx.node, ctx.k.ag_data, others, fields, records)


def announce_ag_end(ctx: PhaseContext, rnd: Round, copies: int = 1) -> None:
    """END of our all-gather to every other participant (one encoding for all)."""
    if copies < 1:  # a quiet network: no END at all, so none to encode (and sign)
        return
    node = ctx.node
    others = [p for p in rnd.participants if p != rnd.me]
    if not others:
        return
    end = {
        **rnd.ident,
        "n": rnd.ag_chunks_sent,
        "l": int(ctx.loss.recent),
    }
    frames = node.encode_for(others, ctx.k.ag_end, end)
    sent = 0
    for _ in range(copies):
        sent += node.send_frames(others, frames, group_bytes=rnd.group_bytes)
    count_sent(rnd, frames, sent, control=True)


def on_ag(ctx: PhaseContext, rnd: Round, pkt: Packet) -> None:
    """Write one broadcast chunk into ``dst`` and mark it arrived (not stale).

    A parity packet (``"g"`` in its fields) may rebuild one lost chunk.
    """
    if pkt.fields.get("z") == bundle.BUNDLE:  # record by record, each as a packet
        for one in unbundle(ctx.dropped, pkt):
            on_ag(ctx, rnd, one)
        return
    src = pkt.src
    overtaken = src in rnd.ag.ended  # by its sender's END: learn by how much
    if "g" in pkt.fields:
        if overtaken:
            ctx.note_after_end(rnd, pkt)
        on_parity(
            ctx,
            rnd,
            pkt,
            lambda b: rnd.maps[b].chunks_of(src),
            lambda b, c: bool(rnd.got_np[b][c]),
            lambda b, c: as_bytes(rnd.plans[b].view(rnd.dst[b], c)),  # as it arrived
            lambda b, c, values: _accept_ag(ctx, rnd, src, b, c, values),
        )
        return
    got = _compressed_chunk(ctx, rnd, pkt) if "z" in pkt.fields else chunk_of(rnd, pkt, ctx.dropped)
    if got is None:
        return
    b, c, values = got
    if c in rnd.owned[b]:
        ctx.dropped["not_owner"] += 1
        return
    if rnd.got_np[b][c]:
        ctx.dropped["duplicate"] += 1
        return
    if overtaken:
        ctx.note_after_end(rnd, pkt)
    _accept_ag(ctx, rnd, src, b, c, values)


def _compressed_chunk(
    ctx: PhaseContext, rnd: Round, pkt: Packet
) -> tuple[int, int, torch.Tensor] | None:
    """A compressed broadcast chunk decoded to its dense values, or None (counted).

    Checked for ownership and duplicates before decoding: decoding acts on the
    compressor's state (the next index set, the answers about our contributions).
    """
    got = compressed_fields(ctx.dropped, rnd, pkt)
    if got is None or rnd.codec is None:
        return None
    b, c, z = got
    codec = rnd.codec
    if c in rnd.owned[b] or c not in rnd.maps[b].chunks_of(pkt.src):
        ctx.dropped["not_owner"] += 1
        return None
    if rnd.got_np[b][c]:
        ctx.dropped["duplicate"] += 1
        return None
    values = codec.decode_ag(rnd, pkt.src, b, c, z, pkt.payload)
    if isinstance(values, str):
        ctx.dropped[values] += 1
        return None
    return b, c, values


def on_ag_batch(ctx: PhaseContext, rnd: Round, pkts: list[Packet]) -> None:
    """:func:`on_ag` for consecutive data packets (no parity) of one drain, in order.

    Why: per chunk, a payload view, a finiteness reduction and a ``copy_`` cost
    ~2 us of dispatch each.  Here each bucket's full-length chunks are joined
    into one block once (:class:`.rows.ChunkRows`), checked with one row sum and
    written with one ``index_copy_``; every check is decided per packet in
    :func:`on_ag`'s order (finiteness is a function of the packet alone, so
    computing it first changes no decision), and the bytes written are the same.
    Rounds that measure steps (``rnd.step_mag``, optimizer rounds) measure the
    block's rows together (:meth:`.stale_step.StaleStep.measure_rows`).
    """
    items = []
    for pkt in pkts:
        ids = chunk_ids(rnd, pkt, ctx.dropped)
        if ids is not None:
            items.append((pkt, *ids))
    vals = ChunkRows(rnd, items)
    writes: dict[int, list[tuple[int, int]]] = {}
    for i, ((pkt, b, c), ok) in enumerate(zip(items, vals.finite(), strict=True)):
        if not ok:
            ctx.dropped["non_finite"] += 1
        elif c in rnd.owned[b]:
            ctx.dropped["not_owner"] += 1
        elif rnd.got_np[b][c]:
            ctx.dropped["duplicate"] += 1
        else:
            if pkt.src in rnd.ag.ended:
                ctx.note_after_end(rnd, pkt)
            writes.setdefault(b, []).append((c, i))
            _counted_ag(ctx, rnd, pkt.src, b, c)
    for b, chunks in writes.items():
        write_rows(rnd, b, chunks, vals)


def replay_ag(ctx: PhaseContext, rnd: Round, pkts: list[Packet]) -> None:
    """The all-gather packets held while we were still sending, in arrival order.

    Why in runs: on a paced or busy link most of a round's broadcast can arrive
    before our own reduce-scatter is out, and these were then taken one call
    chain per packet.  Plain chunks go through :func:`on_ag_batch` in runs;
    parity and compressed packets (``"g"``, ``"z"``) through :func:`on_ag`.
    """
    run: list[Packet] = []
    for pkt in pkts:
        if "g" in pkt.fields or "z" in pkt.fields:
            if run:
                on_ag_batch(ctx, rnd, run)
                run = []
            on_ag(ctx, rnd, pkt)
        else:
            run.append(pkt)
    if run:
        on_ag_batch(ctx, rnd, run)


def _accept_ag(
    ctx: PhaseContext, rnd: Round, src: str, b: int, c: int, values: torch.Tensor
) -> None:
    """Write one chunk (arrived or rebuilt from parity) into ``dst``."""
    if rnd.step_mag is not None:
        StaleStep.measure(rnd, b, c, values)
    rnd.plans[b].view(rnd.dst[b], c).copy_(values)
    _counted_ag(ctx, rnd, src, b, c)


def _counted_ag(ctx: PhaseContext, rnd: Round, src: str, b: int, c: int) -> None:
    """The bookkeeping of one chunk written: arrived, and its sender complete?"""
    rnd.got_np[b][c] = True
    ag = rnd.ag
    ag.received[src] += 1
    ag.arrived(src, ctx.node.clock.now())
    if src not in ag.done and (
        ag.received[src] >= rnd.ag_expected(src)
        or (src in ag.hold and not ag.held_back(src, ag.declared[src]))
    ):
        ctx.spans("ag").append(ag.finish(src, ctx.node.clock.now()))
