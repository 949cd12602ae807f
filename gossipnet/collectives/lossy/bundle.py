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

Why the records share a prefix: the chunks of one bundle belong to one round,
one sender and one destination, so their payloads open with the same per-round
fields (value codec, set tag, previous round, participants, contributor
bitmaps: :mod:`gossipnet.collectives.compress.payload` puts them first).  The
bundle states their common prefix once; measured on the demo (seed 0, session
17), the fixed part of each chunk's payload and record had cost about 240 bytes
per chunk per step over the four peers, which Accordion's finer chunk layout
(17 chunks against 8 at static density 0.045) paid twice as often.

What stays: every record is rebuilt as a whole compressed chunk payload (the
shared prefix, then its own bytes), so the bundle is decodable alone (one MAC
covers it) and a lost bundle loses only its own chunks; each record is then
handled exactly as a packet of its own (ownership, duplicates, decoding,
arrival counts), and ENDs count chunks, not packets, as they did when a chunk
was a packet.  A bundle of one is never sent: a lone chunk goes as a plain
packet.

Format: the packet's ``"z"`` is :data:`BUNDLE`, ``"c"`` its first record's
chunk, ``n`` the payload's length.  The payload is unsigned LEB128 varints
(:func:`uvarint`): the record count, the records' payload kind (one for all), the
shared prefix's length, then the prefix; per record its chunk step from the one
before (at least 1; none for the first, whose chunk is ``"c"``) and the length of
its own bytes; then the records' own bytes in order.  A malformed bundle (a
count below two, a zero chunk step, a prefix or lengths that do not add up to
the payload, an overlong varint, a nested bundle) is dropped whole and counted
``bad_bundle``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

from gossipnet.transport.wire import Packet

__all__ = ("BUNDLE", "Record", "expand", "group", "pack", "read_uvarint", "uvarint")

#: The ``"z"`` of a bundle: above every compressor's payload kind
#: (:class:`gossipnet.collectives.compress.payload.Z`), which must stay below it.
BUNDLE = 0xFFFF
#: One encoded chunk: (chunk, payload kind, payload).
Record = tuple[int, int, bytes]
#: Varints longer than this many bytes are refused (a value below 2**35).
MAX_VARINT = 5


def uvarint(n: int) -> bytes:
    """``n`` (>= 0) as an unsigned LEB128 varint: 7 bits a byte, low first."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_uvarint(data: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """``(value, next position)`` of the varint at ``pos``; None if it is cut
    short or longer than :data:`MAX_VARINT` bytes."""
    value = shift = 0
    for i in range(pos, min(len(data), pos + MAX_VARINT)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return None


def _vlen(n: int) -> int:
    return max(1, -(-n.bit_length() // 7))


def _shared(a: bytes, b: bytes) -> int:
    """Length of the common prefix of ``a`` and ``b`` (a few dozen bytes: the
    per-round fields, then the first count that differs)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _size(run: list[Record], shared: int) -> int:
    """Payload bytes of a bundle of ``run`` sharing a ``shared``-byte prefix."""
    size = _vlen(len(run)) + _vlen(run[0][1]) + _vlen(shared) + shared
    prev = run[0][0]
    for i, (c, _, p) in enumerate(run):
        own = len(p) - shared
        size += (_vlen(c - prev) if i else 0) + _vlen(own) + own
        prev = c
    return size


def group(records: list[Record], room: int) -> Iterator[list[Record]]:
    """Consecutive runs of ``records`` whose bundle fits ``room`` bytes of payload.

    A run holds one payload kind and increasing chunks; a record too large to
    share a packet is a run of its own (sent plain); the order is kept, so
    receivers see chunks in the order they were encoded.
    """
    run: list[Record] = []
    shared = 0
    for rec in records:
        if run:
            joined = min(shared, _shared(run[0][2], rec[2]))
            fits = rec[1] == run[0][1] and rec[0] > run[-1][0]
            if fits and _size([*run, rec], joined) <= room:
                run.append(rec)
                shared = joined
                continue
            yield run
        run, shared = [rec], len(rec[2])
    if run:
        yield run


def pack(run: list[Record]) -> bytes:
    """The payload of a bundle of ``run`` (two records or more, one payload kind,
    increasing chunks)."""
    z = run[0][1]
    if any(r[1] != z for r in run) or any(b[0] <= a[0] for a, b in itertools.pairwise(run)):
        raise ValueError("a bundle holds one payload kind and increasing chunks")
    shared = min(_shared(run[0][2], p) for _, _, p in run)
    heads = [uvarint(len(run)), uvarint(z), uvarint(shared), run[0][2][:shared]]
    prev = run[0][0]
    for i, (c, _, p) in enumerate(run):
        if i:
            heads.append(uvarint(c - prev))
        heads.append(uvarint(len(p) - shared))
        prev = c
    return b"".join([*heads, *(p[shared:] for _, _, p in run)])


def expand(pkt: Packet) -> list[Packet] | None:
    """The records of bundle ``pkt`` as packets of their own (same sender,
    round and header; ``c``, ``z``, ``n`` and the payload of the record, its
    shared prefix included); None if the bundle is malformed."""
    data = memoryview(pkt.payload).cast("B")
    heads = _heads(data, pkt.fields.get("c"))
    if heads is None:
        return None
    z, prefix, rows, at = heads
    out = []
    for c, n in rows:
        if at + n > len(data):
            return None
        body = prefix + bytes(data[at : at + n])
        fields = {**pkt.fields, "c": c, "z": z, "n": len(body)}
        out.append(replace(pkt, fields=fields, payload=memoryview(body)))
        at += n
    return out if at == len(data) else None


def _heads(data: memoryview, first: object) -> tuple[int, bytes, list[tuple[int, int]], int] | None:
    """(kind, shared prefix, (chunk, own length) per record, where the records'
    bytes start) of a bundle payload; None if malformed."""
    vals: list[int] = []
    pos = 0
    for _ in range(3):
        got = read_uvarint(data, pos)
        if got is None:
            return None
        vals.append(got[0])
        pos = got[1]
    count, z, shared = vals
    if count < 2 or count > len(data) or z >= BUNDLE or not isinstance(first, int):
        return None
    if pos + shared > len(data):
        return None
    prefix = bytes(data[pos : pos + shared])
    pos += shared
    rows, c = [], first
    for i in range(count):
        if i:
            got = read_uvarint(data, pos)
            if got is None or got[0] < 1:
                return None
            c, pos = c + got[0], got[1]
        got = read_uvarint(data, pos)
        if got is None:
            return None
        rows.append((c, got[0]))
        pos = got[1]
    return z, prefix, rows, pos
