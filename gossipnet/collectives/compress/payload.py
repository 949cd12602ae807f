"""The payload formats of compressed chunks: each packet decodable alone.

A compressed data packet carries ``"z"`` (its payload kind, :class:`Z`; in the
fixed binary data header, flag bit 3 and the formerly reserved u16) beside the
usual round, mode, layout, bucket and chunk fields, ``dt="u8"`` and ``n`` = its
payload's byte length (so the codec's length check still holds).  Every
payload says, itself, what it holds: its counts, its scale, its index set or
index list, and the codec of its values.  Little-endian; counts first, then the
sections in order:

``QUANT``   ``<BI`` kind (0 bf16, 1 fp16, 2 int8; bit 7 set: a parameter update, which
            the receiver adds to its parameters), count; [int8: f32 scale]; values.
``TOPK_RS`` ``<BQ`` value codec, set tag; counts: proposed blocks, values; u32
            proposed block ids; their bf16 norms (a sparse sketch); values at the set.
``TOPK_AG`` ``<BBHQQ`` value codec, value kind (0 averages at the current set, 1 a
            parameter update at the blocks listed as the current set, no ages),
            participants, next tag, previous round; contributor bitmaps (this
            round, the previous); counts: current set blocks, next set blocks,
            values; u32 current set, u32 next set, u8 age per current block, values.
``DCT_RS``  ``<B`` value codec; count: entries; u32 indices; values.
``DCT_AG``  ``<BBHQ`` value codec, value kind (0 averages, 1 a parameter update),
            participants, previous round; two contributor bitmaps; count: entries;
            u32 indices; values.

Counts are unsigned LEB128 varints (:func:`~gossipnet.collectives.lossy.bundle.uvarint`:
one byte below 128, two below 16384), each checked against its bound (the
chunk's blocks or elements) as it is read.  Why this order and these widths:
the fixed part of a chunk's payload (its header, an int8 scale, bitmaps) is
paid per chunk per destination, and Accordion's chunk layout (sized for its
critical density) has about twice as many chunks as the static setting of
equal quality; the per-round fields come first so that the records of one
bundle (:mod:`gossipnet.collectives.lossy.bundle`), which share them, state
them once in the bundle's shared prefix, and a plain packet still carries them
all.  Measured on the demo (seed 0, int8 values, 4 peers): the fixed part of
a chunk's payload and bundle record came to about 240 bytes per chunk per step
with ``<QIIB`` / ``<QQHIIIBB`` headers and ``<IHI`` records.

The sparse kinds' values are coded as the value codec says
(:data:`~gossipnet.collectives.compress.quant.CODEC_IDS`: 0 f32, 1 bf16,
2 int8 = an f32 scale, a u8 shift per 16 values (each group's step is
``scale * 2**-shift``), then one int8 per value).  A receiver whose own setting
differs drops the packet (``compressed_kind``), as it drops an update in a round
that broadcasts averages or the reverse.

Decoders check every count against the chunk (an index beyond it, a count that
does not add up to the payload's length, an unsorted or repeated index, a
non-finite value or scale, an int8 scale above what finite values give, decoded
values that are not finite, a count above its bound or an overlong varint): each
is a :class:`Bad` with the reason the caller counts, never an exception that escapes.
The values a decoder returns are finite, checked once per payload (one reduction).
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass

import torch

from gossipnet.collectives.chunks import all_finite, as_bytes, from_bytes
from gossipnet.collectives.compress.quant import (
    MAX_SCALE,
    dequantize_grouped_int8,
    from_half,
    group_count,
)
from gossipnet.collectives.lossy.bundle import MAX_VARINT, read_uvarint, uvarint

__all__ = ("NONE", "Bad", "Z", "bitmap", "in_bitmap", "join", "Reader", "uvarint")

#: A set tag or round id that is none (no announcement, no previous round).
NONE = (1 << 64) - 1


class Z(enum.IntEnum):
    """Payload kinds (the ``"z"`` field)."""

    QUANT = 1
    TOPK_RS = 2
    TOPK_AG = 3
    DCT_RS = 4
    DCT_AG = 5


class Bad(Exception):
    """A malformed compressed payload; ``str(self)`` is the drop reason."""


def join(*parts: bytes | torch.Tensor) -> bytes:
    """Concatenate struct bytes and CPU tensors' raw bytes (one copy)."""
    return b"".join(p if isinstance(p, bytes) else bytes(as_bytes(p.contiguous())) for p in parts)


def bitmap(flags: torch.Tensor) -> torch.Tensor:
    """Bool flags -> packed uint8 bitmap (bit ``i % 8`` of byte ``i // 8``)."""
    n = flags.numel()
    pad = (-n) % 8
    f = torch.nn.functional.pad(flags.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (f * weights).sum(dim=1).to(torch.uint8)


def in_bitmap(bits: torch.Tensor, i: int) -> bool:
    """Whether bit ``i`` of a packed bitmap is set."""
    return bool((int(bits[i // 8]) >> (i % 8)) & 1)


@dataclass(slots=True)
class Reader:
    """Sequential, checked reads of one payload (every read may raise :class:`Bad`)."""

    data: memoryview
    pos: int = 0

    def struct(self, fmt: struct.Struct) -> tuple[int, ...]:
        if self.pos + fmt.size > len(self.data):
            raise Bad("compressed_short")
        out = fmt.unpack_from(self.data, self.pos)
        self.pos += fmt.size
        return out

    def count(self, bound: int) -> int:
        """A varint count, at most ``bound``."""
        got = read_uvarint(self.data, self.pos)
        if got is None:  # cut short, or longer than any count needs
            overlong = self.pos + MAX_VARINT <= len(self.data)
            raise Bad("compressed_count" if overlong else "compressed_short")
        if got[0] > bound:
            raise Bad("compressed_count")
        self.pos = got[1]
        return got[0]

    def tensor(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        size = count * dtype.itemsize
        if count < 0 or self.pos + size > len(self.data):
            raise Bad("compressed_count")
        t = from_bytes(self.data[self.pos : self.pos + size], dtype, count)
        self.pos += size
        return t

    def values(self, count: int) -> torch.Tensor:
        """``count`` float32 values, all finite."""
        v = self.tensor(torch.float32, count)
        if not all_finite(v):
            raise Bad("non_finite")
        return v

    def coded(self, count: int, codec: str) -> torch.Tensor:
        """``count`` values in ``codec`` (``"fp32"``, ``"bf16"``, ``"int8"``) as
        float32, all finite (an int8 scale too)."""
        if codec == "fp32":
            return self.values(count)
        if codec == "bf16":
            v = from_half(self.tensor(torch.bfloat16, count))
        else:
            scale = self.scale()
            shifts = self.tensor(torch.uint8, group_count(count))
            v = dequantize_grouped_int8(scale[0], shifts, self.tensor(torch.int8, count))
        if not all_finite(v):
            raise Bad("non_finite")
        return v

    def scale(self) -> torch.Tensor:
        """An int8 scale (one float32): finite (else ``non_finite``) and in
        ``[0, MAX_SCALE]``, the range finite inputs give (else ``compressed_scale``)."""
        s = self.tensor(torch.float32, 1)
        x = float(s[0])
        if not math.isfinite(x):
            raise Bad("non_finite")
        if not 0.0 <= x <= MAX_SCALE:
            raise Bad("compressed_scale")
        return s

    def ages(self, count: int) -> torch.Tensor:
        """``count`` u8 ages (rounds a block's values stand for) as float32, each >= 1."""
        a = self.tensor(torch.uint8, count)
        if count and int(a.min()) < 1:
            raise Bad("compressed_age")
        return a.to(torch.float32)

    def indices(self, count: int, bound: int) -> torch.Tensor:
        """``count`` u32 indices, strictly increasing and below ``bound`` (int64)."""
        raw = self.tensor(torch.int32, count).to(torch.int64) & 0xFFFF_FFFF
        if count and (int(raw[-1]) >= bound or bool((raw[1:] <= raw[:-1]).any())):
            raise Bad("compressed_index")
        return raw

    def done(self) -> None:
        if self.pos != len(self.data):
            raise Bad("compressed_count")
