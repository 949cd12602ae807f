"""NACK repair of a round's all-gather: re-request lost chunks from their owners.

Only resyncs use it (``RoundOptions(repair=True)``): a resync must leave
every peer identical, so a lost broadcast chunk is asked for again, as a plain
lossy packet, until it arrives or the round's deadline passes.  Ordinary rounds
never wait on a retransmission; they keep stale values (or send redundant
copies up front, ``Config.redundancy``).
"""

from __future__ import annotations

import statistics

import torch

from gossipnet.collectives.chunks import as_bytes, from_bytes
from gossipnet.collectives.lossy.context import PhaseContext
from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.wirebytes import count_sent
from gossipnet.transport.wire import DTYPE_CODES, Packet

__all__ = ("missing_chunks", "repair", "serve_repair")

#: Chunk indices per repair request (int32 payload: 16 KiB).
REPAIR_BATCH = 4096


async def repair(ctx: PhaseContext, rnd: Round, deadline: float) -> bool:
    """Re-request missing all-gather chunks from their owners; True when none is left.

    Requests are plain lossy packets (a lost request is simply sent again next
    pass); owners answer from the round's kept broadcast, also after they moved on.
    """
    clock = ctx.node.clock
    spans = ctx.spans("ag")
    interval = max(
        ctx.node.config.phase_min_wait_s, 2 * statistics.median(spans) if spans else 0.05
    )
    while True:
        missing = missing_chunks(ctx, rnd)
        if not missing:  # nothing left that a live owner could still send
            return all(
                bool(rnd.got[b][: o.start].all()) and bool(rnd.got[b][o.stop :].all())
                for b, o in enumerate(rnd.owned)
            )
        if clock.now() >= deadline:
            return False
        node = ctx.node
        for (owner, b), chunks in missing.items():
            for i in range(0, len(chunks), REPAIR_BATCH):
                part = torch.tensor(chunks[i : i + REPAIR_BATCH], dtype=torch.int32)
                fields = {"r": rnd.r, "b": b, "dt": "i32", "n": part.numel()}
                frames = node.encode_for((owner,), ctx.k.repair, fields, as_bytes(part))
                n = node.send_frames((owner,), frames, group_bytes=rnd.group_bytes)
                count_sent(rnd, frames, n, control=True)
        await clock.sleep(min(interval, max(0.0, deadline - clock.now())))


def missing_chunks(ctx: PhaseContext, rnd: Round) -> dict[tuple[str, int], list[int]]:
    """(owner, bucket) -> chunk indices whose all-gather never arrived."""
    out: dict[tuple[str, int], list[int]] = {}
    for b, smap in enumerate(rnd.maps):
        mask = rnd.got[b].clone()
        owned = rnd.owned[b]
        mask[owned.start : owned.stop] = True
        for c in torch.nonzero(~mask).flatten().tolist():
            owner = smap.owner(c)
            if ctx.node.membership is not None and ctx.node.membership.is_alive(owner):
                out.setdefault((owner, b), []).append(c)
    return out


def serve_repair(ctx: PhaseContext, rnd: Round, pkt: Packet) -> None:
    b = pkt.fields.get("b")
    if not isinstance(b, int) or not 0 <= b < len(rnd.broadcast) or pkt.fields.get("dt") != "i32":
        ctx.dropped["bad_repair"] += 1
        return
    chunks = from_bytes(pkt.payload, torch.int32, len(pkt.payload) // 4).tolist()
    plan, owned = rnd.plans[b], rnd.owned[b]
    raw = memoryview(rnd.broadcast[b])
    base = owned.start * plan.chunk_elems * plan.itemsize
    code = DTYPE_CODES[rnd.dst[b].dtype]
    node = ctx.node
    for c in chunks[:REPAIR_BATCH]:
        if c not in owned:
            continue
        _, count = plan.chunk(c)
        span = plan.byte_slice(c)
        fields = {
            **rnd.ident,
            "b": b,
            "c": c,
            "dt": code,
            "n": count,
        }
        payload = raw[span.start - base : span.stop - base]
        frames = node.encode_for((pkt.src,), ctx.k.ag_data, fields, payload)
        n = node.send_frames((pkt.src,), frames, group_bytes=rnd.group_bytes)
        rnd.sent += n
        count_sent(rnd, frames, n)
