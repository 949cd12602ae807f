"""Per-packet pieces both phases of an all-reduce round share.

Split from :mod:`gossipnet.collectives.lossy.engine` so that the engine, the
reduce-scatter (:mod:`.scatter`) and the all-gather (:mod:`.gather`) use
one copy of them without importing each other: the packet kinds an engine
owns (:class:`EngineKinds`, re-exported by :mod:`.engine`), the redundant
copies that trail a phase's data packets on the send side, and the check that
an incoming data packet fits our round's layout on the receive side.  The
last two run once per packet, so they stay plain functions over the round's
state, with no copies.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gossipnet.collectives.chunks import all_finite, auto_chunk_bytes, from_bytes
from gossipnet.collectives.lossy import bundle
from gossipnet.collectives.lossy.compressed import ChunkCodec
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.wirebytes import count_sent
from gossipnet.runtime.node import Node
from gossipnet.transport.base import Buffer
from gossipnet.transport.wire import DTYPES, Packet

__all__ = (
    "ALLREDUCE_KINDS",
    "COPY_LAG",
    "OPTIMIZER_KINDS",
    "YIELD_EVERY",
    "EngineKinds",
    "Send",
    "bundled",
    "chunk_ids",
    "chunk_of",
    "chunk_sizes",
    "compressed_fields",
    "packet_room",
    "send_copies",
    "send_copy",
    "unbundle",
)

YIELD_EVERY = 32  # packets sent between yields, so receiving never starves
#: Redundant copies trail their originals by this many packets (see ``send_copy``);
#: well inside the default replay window of 8192 sequence numbers.
COPY_LAG = 256

#: One data packet's destinations and encoded frames, kept for redundant copies.
Send = tuple[Sequence[str], list[Buffer]]


@dataclass(frozen=True, slots=True)
class EngineKinds:
    """Packet kinds an engine instance owns, so several engines (the global
    all-reduce, Moshpit's group rounds) can live on one node without mixing."""

    rs_data: int
    ag_data: int
    rs_end: int
    ag_end: int
    repair: int

    def all(self) -> tuple[int, ...]:
        return (self.rs_data, self.ag_data, self.rs_end, self.ag_end, self.repair)


ALLREDUCE_KINDS = EngineKinds(
    LossyKind.RS_DATA, LossyKind.AG_DATA, LossyKind.RS_END, LossyKind.AG_END, LossyKind.REPAIR
)
OPTIMIZER_KINDS = EngineKinds(
    LossyKind.OPT_RS_DATA,
    LossyKind.OPT_AG_DATA,
    LossyKind.OPT_RS_END,
    LossyKind.OPT_AG_END,
    LossyKind.OPT_REPAIR,
)


def send_copy(node: Node, rnd: Round, send: Send) -> None:
    """Send ``redundancy - 1`` more copies of one data packet.

    Why copies trail the originals by ``COPY_LAG`` packets instead of going
    back to back: a burst of loss takes neighbouring packets together, so
    spaced copies are lost together far less often.  Why not a whole second
    pass: the receiver's replay window only spans ``replay_window_packets``
    sequence numbers, and a copy older than that would be dropped even when
    the original was lost.  The copies are the same packets (same sequence
    numbers): whichever arrives first counts, the replay window drops the rest.
    """
    peers, frames = send
    sent = 0
    for _ in range(rnd.redundancy - 1):
        sent += node.send_frames(peers, frames, group_bytes=rnd.group_bytes)
    rnd.sent += sent
    rnd.copies_sent += sent
    count_sent(rnd, frames, sent)


async def send_copies(node: Node, rnd: Round, sends: collections.deque[Send] | None) -> None:
    """Flush the copies still trailing at the end of a phase's sends."""
    sent = 0
    while sends:
        peers, _ = send = sends.popleft()
        send_copy(node, rnd, send)
        sent += len(peers)
        if sent >= YIELD_EVERY:
            sent = 0
            await asyncio.sleep(0)


def chunk_ids(rnd: Round, pkt: Packet, dropped: collections.Counter[str]) -> tuple[int, int] | None:
    """:func:`chunk_of`'s checks without building the values: ``(bucket, chunk)``.

    None when the packet does not fit our plan (counted in ``dropped``: ``bad_chunk``,
    ``layout_mismatch``).  Where it fits, its payload holds exactly the chunk's
    ``plan.chunk(c)`` elements of ``plan.dtype`` (the codec checked the length).
    """
    f = pkt.fields
    b, c = f.get("b"), f.get("c")
    if not (isinstance(b, int) and isinstance(c, int) and 0 <= b < len(rnd.plans)):
        dropped["bad_chunk"] += 1
        return None
    plan = rnd.plans[b]
    if not 0 <= c < plan.nchunks:
        dropped["bad_chunk"] += 1
        return None
    _, count = plan.chunk(c)
    if DTYPES.get(f.get("dt", "")) != plan.dtype or f.get("n") != count:
        dropped["layout_mismatch"] += 1
        return None
    return b, c


def chunk_of(
    rnd: Round, pkt: Packet, dropped: collections.Counter[str], *, finite: bool = True
) -> tuple[int, int, torch.Tensor] | None:
    """Validate (bucket, chunk, dtype, count) against our plan; None = drop.

    ``finite``: also drop non-finite values (False where the receiver checks them
    itself: the reduce-scatter's reducer, after its cheaper duplicate check).

    Returns:
        ``(bucket, chunk, values)``, ``values`` a zero-copy view of the payload;
        None when the packet does not fit, counted in ``dropped`` by reason.
    """
    ids = chunk_ids(rnd, pkt, dropped)
    if ids is None:
        return None
    b, c = ids
    plan = rnd.plans[b]
    values = from_bytes(pkt.payload, plan.dtype, plan.chunk(c)[1])
    if finite and not all_finite(values):
        dropped["non_finite"] += 1
        return None
    return b, c, values


def packet_room(node: Node) -> int:
    """Payload bytes of one compressed packet: ``Config.chunk_bytes`` if set, else
    the transport's packet size (within ``Config.max_payload_bytes``).  A
    compressed chunk is sized to fit it, and so is a bundle of several."""
    transport = node.transport
    base = transport.default_chunk_bytes if transport is not None else 64 * 1024
    return node.config.chunk_bytes or min(base, node.config.max_payload_bytes)


def chunk_sizes(
    node: Node,
    src: Sequence[torch.Tensor],
    participants: int,
    codec: ChunkCodec | None = None,
    param_mode: bool = False,
) -> list[int]:
    """Chunk bytes per bucket: ``Config.chunk_bytes`` if set, else grown with the
    bucket, never past ``Config.max_payload_bytes`` (a receiver would drop it).
    A compressed round (``codec``) sizes chunks so their compressed payload fits
    one packet (``ChunkCodec.chunk_bytes``)."""
    fixed = node.config.chunk_bytes
    transport = node.transport
    limit = node.config.max_payload_bytes
    base = transport.default_chunk_bytes if transport is not None else 64 * 1024
    base = min(base, limit)
    cap = min(getattr(transport, "max_chunk_bytes", base), limit)
    if codec is not None:
        one = packet_room(node)
        return [
            codec.chunk_bytes(one, b.numel(), b.element_size(), participants, param_mode)
            for b in src
        ]
    return [
        fixed or auto_chunk_bytes(b.numel() * b.element_size(), base, cap, participants)
        for b in src
    ]


def bundled(
    node: Node,
    kind: int,
    dsts: Sequence[str],
    fields: dict[str, object],
    records: list[bundle.Record],
) -> list[list[Buffer]]:
    """The encoded packets of ``records`` (compressed chunks of one bucket) for
    ``dsts``: consecutive ones share a packet while they fit (:mod:`.bundle`), a lone
    one goes plain."""
    out = []
    for run in bundle.group(records, packet_room(node)):
        c, z, payload = run[0] if len(run) == 1 else (run[0][0], bundle.BUNDLE, bundle.pack(run))
        fields.update(c=c, n=len(payload), z=int(z))
        out.append(node.encode_for(dsts, kind, fields, payload))
    return out


def unbundle(dropped: collections.Counter[str], pkt: Packet) -> list[Packet]:
    """The records of bundle ``pkt`` (:mod:`.bundle`) as packets; none if it is
    malformed (counted ``bad_bundle``)."""
    parts = bundle.expand(pkt)
    if parts is None:
        dropped["bad_bundle"] += 1
        return []
    return parts


def compressed_fields(
    dropped: collections.Counter[str], rnd: Round, pkt: Packet
) -> tuple[int, int, int] | None:
    """A compressed packet's ``(bucket, chunk, payload kind)``, in range for ``rnd``;
    None (counted: ``compressed_kind``, ``bad_chunk``) where they are not.

    The checks both phases make before their own (ownership, duplicates, decoding).
    """
    f = pkt.fields
    b, c, z = f.get("b"), f.get("c"), f.get("z")
    if rnd.codec is None or not isinstance(z, int):
        dropped["compressed_kind"] += 1
        return None
    if not (isinstance(b, int) and isinstance(c, int) and 0 <= b < len(rnd.plans)):
        dropped["bad_chunk"] += 1
        return None
    if not 0 <= c < rnd.plans[b].nchunks:
        dropped["bad_chunk"] += 1
        return None
    return b, c, z
