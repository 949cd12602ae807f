"""Several compressed chunks to one destination in one packet: a bundle.

Why: a compressed chunk is sized so that its payload fills a packet at the
*densest* setting its compressor may use (``ChunkCodec.chunk_bytes``: three
times ARC-Top-K's density, Accordion's critical setting), so at a lighter
setting each chunk's payload fills a fraction of it, and a round sent one
packet per chunk paid a whole packet's header, MAC and framing (about 110
bytes) for each.  Measured on the demo under Accordion (density 0.1 when
critical, 0.015 otherwise): 102 packets per step carried 39.5 kB of payload
and 11.2 kB of packet overhead.  Bundled, consecutive chunks for one owner
(reduce-scatter) or from one owner (all-gather) share a packet while their
payloads fit one.

What stays: every record in a bundle is a whole compressed chunk payload, so
the bundle is decodable alone (one MAC covers it) and a lost bundle loses only
its own chunks; each record is then handled exactly as a packet of its own
(ownership, duplicates, decoding, arrival counts), and ENDs count chunks, not
packets, as they did when a chunk was a packet.  A bundle of one is never
sent: a lone chunk goes as a plain packet.

Format: the packet's ``"z"`` is :data:`BUNDLE`, ``"c"`` its first record's
chunk, ``n`` the payload's length; the payload is ``<H`` count, then ``count``
records' ``<IHI`` (chunk, payload kind, length), then the records' payloads in
order.  A malformed bundle (a count below two, lengths that do not add up to
the payload, a nested bundle) is dropped whole and counted ``bad_bundle``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import replace

from gossipnet.transport.wire import Packet

__all__ = ("BUNDLE", "HEAD", "RECORD", "Record", "expand", "group", "pack")

#: The ``"z"`` of a bundle: above every compressor's payload kind
#: (:class:`gossipnet.collectives.compress.payload.Z`), which must stay below it.
BUNDLE = 0xFFFF
HEAD = struct.Struct("<H")
RECORD = struct.Struct("<IHI")
#: One encoded chunk: (chunk, payload kind, payload).
Record = tuple[int, int, bytes]


def group(records: list[Record], room: int) -> Iterator[list[Record]]:
    """Consecutive runs of ``records`` whose bundle fits ``room`` bytes of payload.

    A record too large to share a packet is a run of its own (sent plain); the
    order is kept, so receivers see chunks in the order they were encoded.
    """
    run: list[Record] = []
    size = HEAD.size
    for rec in records:
        cost = RECORD.size + len(rec[2])
        if run and size + cost > room:
            yield run
            run, size = [], HEAD.size
        run.append(rec)
        size += cost
    if run:
        yield run


def pack(run: list[Record]) -> bytes:
    """The payload of a bundle of ``run`` (two records or more)."""
    heads = b"".join(RECORD.pack(c, z, len(p)) for c, z, p in run)
    return b"".join([HEAD.pack(len(run)), heads, *(p for _, _, p in run)])


def expand(pkt: Packet) -> list[Packet] | None:
    """The records of bundle ``pkt`` as packets of their own (same sender,
    round and header; ``c``, ``z``, ``n`` and the payload of the record);
    None if the bundle is malformed."""
    data = pkt.payload
    if len(data) < HEAD.size:
        return None
    (count,) = HEAD.unpack_from(data, 0)
    start = HEAD.size + count * RECORD.size
    if count < 2 or start > len(data):
        return None
    out = []
    at = start
    for i in range(count):
        c, z, n = RECORD.unpack_from(data, HEAD.size + i * RECORD.size)
        if z == BUNDLE or at + n > len(data):
            return None
        fields = {**pkt.fields, "c": c, "z": z, "n": n}
        out.append(replace(pkt, fields=fields, payload=data[at : at + n]))
        at += n
    return out if at == len(data) else None
