"""The bytes a round put on the wire, and the bytes a dense round would have put there.

A round's ``report.extra["bytes_sent"]`` is, for every packet of that round this
peer handed to its transport and the transport accepted (``send`` returned True,
so a packet a simulated network then loses counts, as one a real network loses):
the packet's frame lengths (header, payload, MAC frame), once per destination
and once per copy.  Data, redundant and compressed copies, parity, END markers,
NACK repair requests and the answers served while the round runs all count.
That is what ``TransportStats.sent_bytes`` counts for the same packets: on a
network without a fault plan the two agree byte for byte.  Neither counts what
the backend adds around a packet (UDP: a 1 + 4-bytes-per-frame prefix and the
IP/UDP headers, ``udp.pacing.WIRE_OVERHEAD_BYTES`` with Ethernet; ZeroMQ: its
frame headers).  Where the transport refuses part of a run of packets (a full
send queue, counted in its drops), the refused ones are taken at the run's mean
size.  Repair answers served after the round returned count in the engine's
total (``net.stats()["wire"]``), not in the report that was already returned.

``extra["bytes_dense"]`` of a compressed round (:func:`dense_bytes`) is what a
dense round of the same settings would have sent: the same buckets and
participants, the dense chunking (``chunk_sizes`` without a codec), every chunk
sent (reduce-scatter to its owner, all-gather to every other participant), the
dense round's redundancy (``Config.redundancy``, not ``compressed_copies``) and
parity (``Config.parity_group`` as a dense round would apply it), each packet
with the header and MAC frame this round's own data packets carried to the same
destinations, and this round's control packets (ENDs, repair requests) as they
were.  ``compression_ratio`` is ``bytes_dense / bytes_sent``: copies and
everything else a compressed round sends lower it.

Counting happens per send call (a run to one owner, or one packet to all its
destinations), from the frames the call already holds: the frame lengths summed
once per packet, never per destination or per copy; ``bytes_dense`` is a few
integer sums per bucket and participant at the end of the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from gossipnet.collectives.chunks import ChunkPlan, ShardMap
from gossipnet.reports import CollectiveReport
from gossipnet.transport.base import Buffer

if TYPE_CHECKING:
    import torch

__all__ = (
    "ByteMeter",
    "add_resync_bytes",
    "count_sent",
    "count_sent_run",
    "dense_bytes",
    "packet_bytes",
)


class ByteMeter:
    """Bytes sent, as data (chunks, copies, parity, repair answers) and control
    (ENDs, repair requests): one per round, and one running total per engine."""

    __slots__ = ("control", "data")

    def __init__(self) -> None:
        self.data = 0
        self.control = 0

    @property
    def total(self) -> int:
        return self.data + self.control


class Metered(Protocol):
    """What the counting needs of a round (:class:`.round.Round` has it)."""

    wire: ByteMeter  # the round's own bytes
    wire_total: ByteMeter  # its engine's running total, counted alike
    data_overhead: dict[str, int]  # per phase: one data packet's header and MAC bytes
    participants: tuple[str, ...]
    me: str
    src: list[torch.Tensor]


def packet_bytes(frames: Sequence[Buffer]) -> int:
    """One packet's frame lengths, as the transports count them (``sent_bytes``).

    The wire codec's frames are bytes or byte-format memoryviews, so ``len`` is
    their size in bytes.
    """
    n = 0
    for f in frames:
        n += len(f)
    return n


def count_sent(
    rnd: Metered,
    frames: Sequence[Buffer],
    accepted: int,
    *,
    control: bool = False,
    phase: str = "",
) -> None:
    """``accepted`` sends of one packet (its destinations, or its copies) of ``rnd``.

    ``phase`` (``"rs"``, ``"ag"``): a data packet of that phase, whose header and
    MAC frame give :func:`dense_bytes` the per-packet overhead for its destinations.
    """
    size = packet_bytes(frames)
    if phase and phase not in rnd.data_overhead and len(frames) == 3:
        rnd.data_overhead[phase] = size - len(frames[1])
    if not accepted:
        return
    nbytes = size * accepted
    meter, total = rnd.wire, rnd.wire_total
    if control:
        meter.control += nbytes
        total.control += nbytes
    else:
        meter.data += nbytes
        total.data += nbytes


def count_sent_run(
    rnd: Metered, packets: Sequence[Sequence[Buffer]], accepted: int, dests: int, phase: str = ""
) -> None:
    """``accepted`` of a run of data ``packets``, each sent to ``dests`` destinations."""
    if not packets:
        return
    if phase and phase not in rnd.data_overhead and len(packets[0]) == 3:
        rnd.data_overhead[phase] = packet_bytes(packets[0]) - len(packets[0][1])
    if not accepted:
        return
    size = 0
    for frames in packets:
        for f in frames:
            size += len(f)
    offered = len(packets) * dests
    nbytes = size * dests if accepted >= offered else size * accepted // len(packets)
    rnd.wire.data += nbytes
    rnd.wire_total.data += nbytes


def dense_bytes(rnd: Metered, chunk_bytes: Sequence[int], redundancy: int, fec_k: int) -> int:
    """What a dense round of ``rnd``'s settings sends from this peer (module doc).

    ``chunk_bytes``: the dense round's chunk size per bucket (``packets.chunk_sizes``
    without a codec); ``redundancy`` and ``fec_k``: its copies and parity group (a
    compressed round replaces them with ``compressed_copies`` and no parity).
    """
    parts, me = rnd.participants, rnd.me
    others = len(parts) - 1
    if others < 1:
        return rnd.wire.control
    over = rnd.data_overhead
    rs_over = over.get("rs", over.get("ag", 0))
    ag_over = over.get("ag", rs_over)
    rs_packets = rs_bytes = ag_packets = ag_bytes = 0
    for src, cb in zip(rnd.src, chunk_bytes, strict=True):
        plan = ChunkPlan(int(src.numel()), src.dtype, cb)
        smap = ShardMap(plan, parts)
        width = plan.chunk_elems * plan.itemsize
        for p in parts:
            chunks = smap.chunks_of(p)
            nbytes = len(smap.owned_range(p)) * plan.itemsize
            # parity.group_count: floor(n / k) groups, one parity packet (a chunk wide) each
            parity = len(chunks) // fec_k if fec_k else 0
            if p == me:  # our shard's broadcast, to every other participant
                ag_packets += len(chunks) + parity
                ag_bytes += nbytes + parity * width
            else:  # our contribution to p's shard
                rs_packets += len(chunks) + parity
                rs_bytes += nbytes + parity * width
    rs = (rs_bytes + rs_packets * rs_over) * redundancy
    ag = (ag_bytes + ag_packets * ag_over) * redundancy * others
    return rs + ag + rnd.wire.control


def add_resync_bytes(report: CollectiveReport, resync: CollectiveReport) -> None:
    """Fold a resync round that ran inside a call (``all_reduce(..., step=opt)``) into
    the call's report: its bytes join ``bytes_sent`` (``resync_bytes`` says how many)
    and, as a dense call resyncs alike, ``bytes_dense``; the ratio follows."""
    extra = report.extra
    moved = resync.extra.get("bytes_sent", 0.0)
    extra["resync_bytes"] = moved
    extra["bytes_sent"] = extra.get("bytes_sent", 0.0) + moved
    if "bytes_dense" in extra:
        extra["bytes_dense"] += moved
        sent = extra["bytes_sent"]
        extra["compression_ratio"] = extra["bytes_dense"] / sent if sent else 1.0
