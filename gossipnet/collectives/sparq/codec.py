"""SPARQ's compression operator C(x) and its packets: pure functions, no I/O.

C(x) works per *block*, a fixed index range of the flat parameter vector: keep the
``k`` entries of largest magnitude (top-k), then quantise them to int8 with one
float32 scale per block (``scale = max|v| / 127``, round to nearest).  Why this
operator: it is deterministic and contractive, ``||x - C(x)||^2 <= (1 - w)||x||^2``
with ``w >= (k / B) * (1 - k / (4 * 127^2))`` (top-k keeps at least the fraction
k/B of each block's energy; rounding loses at most ``k * (scale/2)^2 <= k/(4*127^2)``
of what it keeps).  Why per block and not a global top-k: a block's entries fit one
packet, so a packet's size is known before sending and every packet is decodable
alone (its block, its own scale, its offsets).

Packets (fields are msgpack header fields; payloads little-endian):

- DELTA ``{b, u, n, r}``: block ``b`` goes from version ``u`` to ``u + 1`` by adding
  ``n`` values; payload ``scale:f32 | offsets:u16 * n | values:i8 * n``.
- REFRESH ``{b, u, o, n}``: the exact values (f32 * n) of block ``b`` at version ``u``
  from offset ``o``; a block's refresh is its segments, each a packet.
- END ``{r, t, h, d}``: the sender's round ``r`` is sent (``t``: it triggered; ``h``: the
  latest round of the receiver's END it holds, so a receiver sees it was not heard);
  payload: the sender's version of every block (u32 each), from which it sees gaps.
- NACK ``{r}``: payload ``(block:u32, held version:i32) * m``: blocks to repair.

Every packet is authenticated by the wire codec like any other and carries all it
needs to be applied alone (block, version, scale, offsets or segment); every parser
returns None for a malformed or out-of-range packet, which callers count as a drop.
Out of range includes values: a DELTA's scale and a REFRESH's values are finite and
at most :data:`VALUE_BOUND` in magnitude (the DELTA's scale at most
``VALUE_BOUND / 127``), so no neighbour's packets make a copy, and so the mix,
non-finite: a copy moves at most that much per version.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = (
    "VALUE_BOUND",
    "Compressed",
    "Layout",
    "compress",
    "decompress",
    "delta_packets",
    "parse_delta",
    "parse_end",
    "parse_nack",
    "parse_refresh",
)

_Q = 127.0  # int8 levels each side of zero
_SCALE = struct.Struct("<f")
#: The largest magnitude a value from a packet may have: no parameter comes near it,
#: and adding it to a copy for every version a run can send stays far from inf.
VALUE_BOUND = 2.0**60


@dataclass(frozen=True, slots=True)
class Layout:
    """How a flat vector of ``numel`` floats is cut into blocks and refresh segments.

    Attributes:
        numel: elements of the vector.
        block: elements per block (<= 65536: offsets are u16).
        keep: entries C(x) keeps per full block (top-k's k); a shorter last block
            keeps ``ceil(keep * len / block)``.
        segment: elements per REFRESH packet.
    """

    numel: int
    block: int
    keep: int
    segment: int

    def __post_init__(self) -> None:
        if self.numel < 1 or not 1 <= self.keep <= self.block <= 65536 or self.segment < 1:
            raise ValueError(f"invalid SparQ layout {self}")

    @classmethod
    def for_payload(cls, numel: int, density: float, payload_bytes: int) -> Layout:
        """Blocks whose kept entries (3 bytes each, 4 for the scale) fit ``payload_bytes``."""
        room = max(1, (payload_bytes - 4) // 3)
        block = int(min(65536, numel, max(1, math.floor(room / density))))
        keep = max(1, min(room, block, math.ceil(density * block)))
        return cls(numel, block, keep, max(1, payload_bytes // 4))

    @property
    def nblocks(self) -> int:
        return -(-self.numel // self.block)

    def bounds(self, b: int) -> tuple[int, int]:
        """``[lo, hi)`` of block ``b``."""
        lo = b * self.block
        return lo, min(lo + self.block, self.numel)

    def keep_of(self, b: int) -> int:
        lo, hi = self.bounds(b)
        return max(1, min(self.keep, math.ceil(self.keep * (hi - lo) / self.block)))


@dataclass(frozen=True, slots=True)
class Compressed:
    """C(x) per block: ``offsets`` (nb, k) int64 in-block positions, ``q`` (nb, k) int8,
    ``scale`` (nb,) float32.  Entries at padding (past the vector's end) carry q = 0."""

    offsets: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor


def compress(x: torch.Tensor, layout: Layout) -> Compressed:
    """C(x) for a 1-D float32 CPU tensor of ``layout.numel`` elements (whole-tensor ops)."""
    nb, blk = layout.nblocks, layout.block
    padded = torch.zeros(nb * blk, dtype=torch.float32)
    padded[: layout.numel] = x
    rows = padded.view(nb, blk)
    k = min(layout.keep, blk)
    offsets = rows.abs().topk(k, dim=1, sorted=False).indices
    vals = rows.gather(1, offsets)
    scale = (vals.abs().amax(dim=1) / _Q).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(vals / safe[:, None]).clamp_(-_Q, _Q).to(torch.int8)
    # the last block keeps only its share (keep_of); drop the smallest extras
    last = nb - 1
    extra = k - layout.keep_of(last)
    if extra > 0:
        order = vals[last].abs().argsort()
        q[last, order[:extra]] = 0
    return Compressed(offsets, q, scale)


def decompress(c: Compressed, layout: Layout) -> torch.Tensor:
    """C(x) as a dense 1-D float32 tensor (tests; the wire path applies packets)."""
    nb, blk = layout.nblocks, layout.block
    out = torch.zeros(nb * blk, dtype=torch.float32)
    base = (torch.arange(nb) * blk)[:, None]
    out.index_add_(0, (c.offsets + base).reshape(-1), (c.q.float() * c.scale[:, None]).reshape(-1))
    return out[: layout.numel]


def delta_packets(
    c: Compressed, layout: Layout, versions: np.ndarray, rnd: int
) -> list[tuple[int, dict[str, Any], bytes]]:
    """``(block, fields, payload)`` of every block with a nonzero kept entry.

    ``versions[b]`` is the block's version before this difference.  Blocks whose
    entries all quantise to zero are not sent (their version does not move).
    """
    out: list[tuple[int, dict[str, Any], bytes]] = []
    keep = (c.q != 0).numpy()
    offsets, q, scale = c.offsets.numpy(), c.q.numpy(), c.scale.numpy()
    for b in np.flatnonzero(keep.any(axis=1)):
        m = keep[b]
        lo, hi = layout.bounds(int(b))
        m &= offsets[b] < hi - lo  # padding past the vector's end is never sent
        if not m.any():
            continue
        offs = offsets[b][m].astype("<u2")
        payload = _SCALE.pack(float(scale[b])) + offs.tobytes() + q[b][m].tobytes()
        fields = {"b": int(b), "u": int(versions[b]), "n": int(m.sum()), "r": rnd}
        out.append((int(b), fields, payload))
    return out


def _int(fields: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = fields.get(key)
    return v if type(v) is int and lo <= v < hi else None


def parse_delta(
    fields: dict[str, Any], payload: memoryview | bytes, layout: Layout
) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
    """``(block, base version, in-block offsets int64, values f32)``; None if malformed."""
    b = _int(fields, "b", 0, layout.nblocks)
    u = _int(fields, "u", 0, 2**31)
    n = _int(fields, "n", 1, layout.keep + 1)
    if b is None or u is None or n is None or len(payload) != 4 + 3 * n:
        return None
    (scale,) = _SCALE.unpack_from(payload, 0)
    if not 0 <= scale <= VALUE_BOUND / _Q:  # NaN fails too
        return None
    offs = np.frombuffer(payload, dtype="<u2", count=n, offset=4).astype(np.int64)
    lo, hi = layout.bounds(b)
    if n > layout.keep_of(b) or int(offs.max()) >= hi - lo:
        return None
    q = np.frombuffer(payload, dtype=np.int8, count=n, offset=4 + 2 * n)
    values = torch.from_numpy(q.astype(np.float32)) * torch.tensor(scale, dtype=torch.float32)
    return b, u, torch.from_numpy(offs), values


def refresh_packets(
    vec: torch.Tensor, layout: Layout, b: int, version: int
) -> list[tuple[dict[str, Any], bytes]]:
    """Block ``b`` of ``vec`` exactly, as REFRESH packets of one segment each."""
    lo, hi = layout.bounds(b)
    data = vec[lo:hi].numpy().astype("<f4")
    out = []
    for o in range(0, hi - lo, layout.segment):
        seg = data[o : o + layout.segment]
        out.append(({"b": b, "u": version, "o": o, "n": len(seg)}, seg.tobytes()))
    return out


def parse_refresh(
    fields: dict[str, Any], payload: memoryview | bytes, layout: Layout
) -> tuple[int, int, int, torch.Tensor] | None:
    """``(block, version, in-block offset, values f32)``; None if malformed."""
    b = _int(fields, "b", 0, layout.nblocks)
    v = _int(fields, "u", 0, 2**31)
    o = _int(fields, "o", 0, layout.block)
    n = _int(fields, "n", 1, layout.segment + 1)
    if b is None or v is None or o is None or n is None or o % layout.segment:
        return None
    lo, hi = layout.bounds(b)
    if o + n > hi - lo or n != min(layout.segment, hi - lo - o) or len(payload) != 4 * n:
        return None
    values = np.frombuffer(payload, dtype="<f4", count=n).astype(np.float32)
    if not float(np.abs(values).max()) <= VALUE_BOUND:  # NaN and inf fail too
        return None
    return b, v, o, torch.from_numpy(values)


def end_payload(versions: np.ndarray) -> bytes:
    return versions.astype("<u4").tobytes()


def parse_end(
    fields: dict[str, Any], payload: memoryview | bytes, layout: Layout
) -> tuple[int, bool, int, np.ndarray] | None:
    """``(round, triggered, heard, the sender's block versions)``; None if malformed.

    ``heard``: the latest round of *our* END the sender holds (-2: none).
    """
    r = _int(fields, "r", -1, 2**62)  # -1: the introduction (see the exchange)
    t = _int(fields, "t", 0, 2)
    h = _int(fields, "h", -2, 2**62)
    d = fields.get("d")
    if r is None or t is None or h is None or d != layout.numel:
        return None
    if len(payload) != 4 * layout.nblocks:
        return None
    return r, bool(t), h, np.frombuffer(payload, dtype="<u4").astype(np.int64)


def nack_payload(blocks: np.ndarray, held: np.ndarray) -> bytes:
    pairs = np.empty(len(blocks), dtype=[("b", "<u4"), ("v", "<i4")])
    pairs["b"], pairs["v"] = blocks, held
    return pairs.tobytes()


def parse_nack(payload: memoryview | bytes, layout: Layout) -> list[tuple[int, int]] | None:
    """``[(block, version the asker holds)]`` (-1: unknown); None if malformed."""
    if not payload or len(payload) % 8 or len(payload) // 8 > layout.nblocks:
        return None
    pairs = np.frombuffer(payload, dtype=[("b", "<u4"), ("v", "<i4")])
    if (pairs["b"] >= layout.nblocks).any() or (pairs["v"] < -1).any():
        return None
    return [(int(b), int(v)) for b, v in zip(pairs["b"], pairs["v"], strict=True)]
