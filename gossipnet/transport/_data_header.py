"""The fixed binary header of data packets: one ``struct`` layout, versioned.

Why: a data packet (a chunk of a tensor) is most of the traffic, tens of
thousands a second, and its header always carries the same fields (round,
mode, layout, bucket, chunk, dtype, count, weight, parity flag).  As a msgpack
map it cost a dict build and a ``packb`` to send and an ``unpackb`` and a dozen
typed ``pop`` checks to receive, per packet.  A fixed layout packs and parses
in one ``struct`` call, and every range check collapses into the widths of its
fields.  Control messages keep msgpack: they are few, and their fields vary.

How a receiver tells them apart: a header frame starting with byte ``0xC1``,
which msgpack never emits (the one byte its format leaves unused), is a fixed
header; any msgpack map starts with ``0x80``-``0x8F``, ``0xDE`` or ``0xDF``.

Layout (little-endian, :data:`FIXED`), then the sender's id (UTF-8,
``src_len`` bytes), then ``ndst`` destination tags of 4 bytes::

    magic u8 (0xC1)  version u8  kind u16  mode u8  dtype u8  x u8  flags u8
    src_len u8  ndst u8  z u16  run u32  epoch u64  seq u64
    round u64  layout u32  bucket u32  chunk u32  count u32  weight f64

``flags``: bit 0 a weight is present, bit 1 a parity group ``x`` is announced,
bit 2 destination tags are present (even zero of them, as msgpack's ``"@"``),
bit 3 a compressed payload's kind ``z`` is present (the u16 that was reserved;
``gossipnet.collectives.compress.payload.Z``; without the bit it is 0), bit 4 a
parity packet (``collectives/lossy/parity.py``): ``chunk`` holds its group
``g``, ``x`` its group size ``gs`` (at most 255), ``dtype`` is ``u8``, and its
fields are ``g`` and ``gs`` where a data packet's are ``c``, ``dt`` and ``x``
(wire version 2; version 1 sent parity in msgpack, a map per packet: at 10%
loss a quarter of the optimizer's packets).
``run``: 4 bytes of a hash of ``Config.run`` (the MAC key is per run too; this
keeps the codec's ``run`` reject reason).  ``dtype``: an index into
:data:`DTYPE_ORDER`.  The MAC covers the header as it does a msgpack one.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

__all__ = (
    "DATA_KEYS",
    "DTYPE_ORDER",
    "FIXED",
    "HAS_DST",
    "HAS_G",
    "HAS_W",
    "HAS_X",
    "HAS_Z",
    "MAGIC",
    "pack",
    "repack",
    "run_tag",
)

#: First byte of a fixed header: unused by msgpack, so no map starts with it.
MAGIC = 0xC1
FIXED = struct.Struct("<BBHBBBBBBHIQQQIIIId")
HAS_W, HAS_X, HAS_DST, HAS_Z, HAS_G = 1, 2, 4, 8, 16
#: Wire dtype codes in index order (the ``dtype`` byte); append only.
DTYPE_ORDER = ("f32", "f16", "bf16", "f64", "i64", "i32", "u8")
_DTYPE_INDEX = {code: i for i, code in enumerate(DTYPE_ORDER)}
#: Fields a data packet carries; a packet with exactly these (``w``, ``x`` optional)
#: goes in a fixed header, any other in msgpack.
DATA_KEYS = frozenset({"r", "m", "L", "b", "c", "dt", "n", "w", "x", "z"})
_REQUIRED = frozenset({"r", "m", "L", "b", "c", "dt", "n"})
#: A parity packet's fields (``w`` optional): ``g`` travels as the chunk, ``gs`` as ``x``.
PARITY_KEYS = frozenset({"r", "m", "L", "b", "g", "gs", "n", "w"})
_PARITY_REQUIRED = frozenset({"r", "m", "L", "b", "g", "gs", "n"})
_U8_INDEX = DTYPE_ORDER.index("u8")
_U8, _U16, _U32, _U64 = 0xFF, 0xFFFF, 0xFFFF_FFFF, (1 << 64) - 1


def run_tag(run: str) -> int:
    """The ``run`` field: 4 bytes of a hash of the run id."""
    return int.from_bytes(hashlib.blake2b(run.encode(), digest_size=4).digest(), "little")


def _uint(x: object, top: int) -> bool:
    return type(x) is int and 0 <= x <= top


def pack(
    version: int,
    kind: int,
    fields: Mapping[str, Any],
    ident: tuple[bytes, int, int, int],
    tags: bytes | None,
) -> bytes | None:
    """The fixed header of a data or parity packet, or None where ``fields`` do not fit one.

    Args:
        version: the wire version.
        kind: the packet kind, already range-checked.
        fields: the caller's fields; a fixed header only for exactly
            :data:`DATA_KEYS` (``w``, ``x`` and ``z`` optional) or
            :data:`PARITY_KEYS` (``w`` optional), within their widths.
        ident: ``(src as UTF-8, run tag, epoch, seq)``.
        tags: the destination tags, or None for none.
    """
    keys = fields.keys()
    get = fields.get
    if keys <= DATA_KEYS and keys >= _REQUIRED:
        c, dt, x, z = get("c"), _DTYPE_INDEX.get(get("dt")), get("x", 0), get("z", 0)  # type: ignore[arg-type]
        flags = (HAS_X if "x" in fields else 0) | (HAS_Z if "z" in fields else 0)
    elif keys <= PARITY_KEYS and keys >= _PARITY_REQUIRED:
        c, dt, x, z, flags = get("g"), _U8_INDEX, get("gs"), 0, HAS_G
    else:
        return None
    src, run, epoch, seq = ident
    r, m, lay, b, n, w = get("r"), get("m"), get("L"), get("b"), get("n"), get("w")
    flags |= HAS_W if w is not None else 0
    if tags is not None:
        flags |= HAS_DST
    ndst = len(tags) // 4 if tags is not None else 0
    if not (
        dt is not None
        and _uint(r, _U64) and _uint(m, _U8) and _uint(lay, _U32) and _uint(b, _U32)
        and _uint(c, _U32) and _uint(n, _U32) and _uint(x, _U8) and _uint(z, _U16)
        and (w is None or type(w) in (int, float))
        and len(src) <= _U8 and ndst <= _U8
    ):  # fmt: skip
        return None
    head = FIXED.pack(
        MAGIC, version, kind, m, dt, x, flags, len(src), ndst, z, run, epoch, seq,
        r, lay, b, c, n, float(w if w is not None else 0.0),
    )  # fmt: skip
    return b"".join((head, src, tags or b""))


def repack(head: bytes, rows: list[tuple[int, int, int, int]]) -> list[bytes]:
    """Headers like the fixed header ``head`` with (seq, bucket, chunk, count) of ``rows``.

    Why: the data packets of one phase to one destination share every field but
    those four, so the first header is built (and checked) by :func:`pack` and
    the rest are one ``struct`` call each, with no per-packet field checks.
    Each row's values must fit a u64 (seq) and u32 (the others); the caller
    checks the run's extremes once.
    """
    f = FIXED.unpack_from(head)
    pre, (r, lay), w = f[:12], f[13:15], f[18]
    tail = head[FIXED.size :]
    fmt = FIXED.pack
    return [fmt(*pre, q, r, lay, b, c, n, w) + tail for q, b, c, n in rows]


def fields_of(
    mode: int, code: str, r: int, lay: int, b: int, c: int, n: int, flags: int,
    w: float, x: int, z: int,
) -> dict[str, Any]:  # fmt: skip
    """A parsed header's fields as the msgpack path gives them (optional ones by flag):
    the one place both decoders (``wire``, ``_fast_decode``) build them."""
    fields: dict[str, Any]
    if flags & HAS_G:  # a parity packet: what a data packet's chunk and x hold
        fields = {"r": r, "m": mode, "L": lay, "b": b, "g": c, "gs": x, "n": n}
        if flags & HAS_W:
            fields["w"] = w
        return fields
    fields = {"r": r, "m": mode, "L": lay, "b": b, "c": c, "dt": code, "n": n}
    if flags & HAS_W:
        fields["w"] = w
    if flags & HAS_X:
        fields["x"] = x
    if flags & HAS_Z:
        fields["z"] = z
    return fields
