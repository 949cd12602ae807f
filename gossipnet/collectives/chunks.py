"""Tensors <-> packet-sized chunks, zero-copy where the layout allows.

The loss-tolerant all-reduce (ALGORITHMS.md section 1) sends one datagram-sized chunk per
packet, tagged ``(round, bucket, chunk)`` so a receiver places it by offset in any order.

- :class:`FlatBuffer`: one contiguous 1-D *bucket* per dtype, so chunking is arithmetic on
  one buffer. It aliases instead of copying when it can (a single contiguous tensor *is*
  the bucket; :meth:`FlatBuffer.adopt` makes tensors views of it, like DDP's
  ``gradient_as_bucket_view``). It lives in ``_flatbuffer.py`` and is importable from here.
- :class:`ChunkPlan`: element-aligned chunks of at most ``chunk_bytes``; O(1) lookups, as a
  25M-element bucket over 1400-byte datagrams has ~70k chunks.
- :class:`ShardMap`: each chunk's owner (its reducer); contiguous, balanced, and computed
  identically by every peer from the same inputs.
- :func:`as_bytes` / :func:`from_bytes`: to and from the wire without copying; the bytes
  are native-endian, and every platform PyTorch supports is little-endian.

Nothing here loops per element in Python.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gossipnet.runtime.flatbuffer import FlatBuffer

__all__ = (
    "ChunkPlan",
    "FlatBuffer",
    "ShardMap",
    "all_finite",
    "as_bytes",
    "auto_chunk_bytes",
    "from_bytes",
    "worth_stacking",
)

#: Chunks up to this size are stacked to be checked and added in a few tensor calls;
#: larger ones are handled one call each.  Why: stacking saves ~2 dispatches (~4 us)
#: per chunk and costs one extra copy of its bytes (~10 GB/s): at 8 KiB the copy is
#: 0.8 us, at 64 KiB 6.5 us, so the crossover is near 32 KiB.  A 4 MiB ZeroMQ chunk
#: stacked cost two extra passes over every received byte (stack, then add/copy).
STACK_MAX_BYTES = 32 * 1024


def worth_stacking(chunk_elems: int, dtype: torch.dtype) -> bool:
    """Whether chunks of ``chunk_elems`` elements of ``dtype`` go through a stacked batch."""
    return chunk_elems * dtype.itemsize <= STACK_MAX_BYTES


#: Without a participant count, a bucket is cut into at least this many chunks before
#: chunks grow past the base size.
AUTO_CHUNKS = 16


def auto_chunk_bytes(nbytes: int, base: int, cap: int, chunks: int = AUTO_CHUNKS) -> int:
    """Chunk size for a bucket of ``nbytes``: ``base``, grown up to ``cap`` for big buckets.

    ``chunks``: how many chunks to aim for before growing past ``base``; the
    all-reduce passes its number of participants, one chunk per owner.

    Why: per-packet costs (Python, thread wake-ups, syscalls) dominate with
    small chunks, while chunks much larger than ``nbytes / chunks`` leave some
    owners without a chunk.  Measured at 1M float32 over 4 processes
    (``bench/allreduce.py --sizes 1048576 --chunk-kib 512 1024``): 16 chunks
    took 1.75x gloo's time, 8 chunks 1.45x, 4 chunks (one per owner) 1.28x.
    The size depends only on the bucket's byte size and ``chunks``, which
    every peer of a round agrees on (peers that disagree on the participants
    disagree on the shard map anyway).  A multiple of ``base``, hence
    element-aligned whenever ``base`` is.
    """
    if cap <= base:
        return base
    want = -(-nbytes // max(1, chunks))
    return max(base, min(cap // base * base, -(-want // base) * base))


# The exact text of the warning ``torch.frombuffer`` emits for a read-only buffer.
_READONLY_WARNING = "The given buffer is not writable"
#: Set once a read-only ``frombuffer`` ran under the filter: torch has spent its one warning.
_readonly_warned = False


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How a bucket of ``numel`` elements of ``dtype`` splits into packet-sized chunks.

    Chunk ``i`` is elements ``[i * chunk_elems, min((i + 1) * chunk_elems, numel))`` with
    ``chunk_elems = chunk_bytes // itemsize``: element-aligned, so no payload splits a value;
    all but the last are full. Arithmetic, not offset tables: every method is O(1).

    Raises:
        ValueError: ``numel < 0`` or ``chunk_bytes`` below one element.
    """

    numel: int
    dtype: torch.dtype
    chunk_bytes: int
    itemsize: int = field(init=False)
    chunk_elems: int = field(init=False)
    nchunks: int = field(init=False)

    def __post_init__(self) -> None:
        itemsize = self.dtype.itemsize
        if self.numel < 0:
            raise ValueError(f"ChunkPlan.numel must be >= 0, got {self.numel}")
        if self.chunk_bytes < itemsize:
            raise ValueError(
                f"ChunkPlan.chunk_bytes={self.chunk_bytes} holds no {self.dtype} element"
                f" ({itemsize} bytes); raise Config.chunk_bytes"
            )
        chunk_elems = self.chunk_bytes // itemsize
        object.__setattr__(self, "itemsize", itemsize)
        object.__setattr__(self, "chunk_elems", chunk_elems)
        object.__setattr__(self, "nchunks", -(-self.numel // chunk_elems))

    @classmethod
    def for_tensor(cls, buffer: torch.Tensor, chunk_bytes: int) -> ChunkPlan:
        """The plan for a 1-D bucket such as one of :attr:`FlatBuffer.buckets`."""
        return cls(numel=buffer.numel(), dtype=buffer.dtype, chunk_bytes=chunk_bytes)

    @property
    def offsets(self) -> range:
        """Each chunk's first element, as a lazy range (no list is built)."""
        return range(0, self.numel, self.chunk_elems)

    def chunk(self, i: int) -> tuple[int, int]:
        """``(offset, count)`` in elements of chunk ``i``.

        Raises:
            IndexError: ``i`` not in ``range(nchunks)``; a receiver drops such a packet.
        """
        if not 0 <= i < self.nchunks:
            raise IndexError(f"chunk {i} out of range for {self.nchunks} chunks")
        offset = i * self.chunk_elems
        return offset, min(self.chunk_elems, self.numel - offset)

    def byte_slice(self, i: int) -> slice:
        """Chunk ``i``'s bytes within :func:`as_bytes` of the whole bucket.

        Why: :func:`as_bytes` costs microseconds per call; slicing one memoryview of the
        bucket costs ~0.1 us per chunk, which matters at ~70k chunks per step.
        """
        offset, count = self.chunk(i)
        return slice(offset * self.itemsize, (offset + count) * self.itemsize)

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i`` of ``buffer`` as a view (no copy).

        Raises:
            ValueError: as :meth:`check`. IndexError: as :meth:`chunk`.
        """
        self.check(buffer)
        offset, count = self.chunk(i)
        return buffer.narrow(0, offset, count)

    def check(self, buffer: torch.Tensor) -> None:
        """Raise ValueError unless ``buffer`` is a 1-D tensor of this plan's numel and dtype."""
        if buffer.dim() != 1 or buffer.numel() != self.numel or buffer.dtype != self.dtype:
            raise ValueError(
                f"buffer {tuple(buffer.shape)} {buffer.dtype} does not match the plan"
                f" ({self.numel},) {self.dtype}"
            )


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or infinite.

    Why not ``torch.isfinite(t).all()``: on CPU it materialises a bool tensor and
    costs ~40x more (120 us per 64 KiB chunk).  float32/float64: NaN and +-inf
    propagate through a sum, one reduction at half the cost of ``aminmax``
    (39 vs 85 us per MiB); a sum that overflows (values near the dtype's limit,
    which would overflow the average as well) reads as non-finite, the safe side.
    Half precision would overflow a sum at 65504, so there NaN and +-inf are found
    through the min and max, which they always reach.
    """
    if tensor.numel() == 0:
        return True
    if not tensor.is_floating_point():
        return True
    flat = tensor.detach() if tensor.requires_grad else tensor
    if flat.dim() != 1:
        flat = flat.reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return math.isfinite(float(flat.sum()))
    lo, hi = torch.aminmax(flat)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor as a flat memoryview, without copying.

    Works for bfloat16 too: numpy has none, so the tensor is reinterpreted as uint8 first.
    The memoryview keeps the storage alive and sees later writes: send before writing.

    Raises:
        ValueError: not a contiguous CPU tensor (tensors cross to the network thread as
            CPU copies anyway).
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"as_bytes needs a contiguous CPU tensor, got device={tensor.device},"
            f" contiguous={tensor.is_contiguous()}; use .contiguous().cpu() first"
        )
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    return raw.numpy().data  # == memoryview(array); numpy types __buffer__ only on 3.12+


def from_bytes(
    data: memoryview | bytes | bytearray, dtype: torch.dtype, count: int
) -> torch.Tensor:
    """A 1-D tensor of ``count`` ``dtype`` elements reading ``data`` in place (no copy).

    Why the warning filter: ``torch.frombuffer`` warns on a read-only buffer (a received
    ZeroMQ frame, ``bytes``) as PyTorch has no read-only tensors, and the project turns
    warnings into errors. Received payloads are only read (added into an accumulator or
    copied into a bucket), so the warning is silenced for that call when ``data`` is
    read-only. Do not write to such a result; ``.clone()`` it. (``catch_warnings`` is
    process-global, but torch warns once per process, so only the first read-only call
    enters it: entering costs ~3 us, which at tens of thousands of packets per step is
    most of this function.)

    Raises:
        ValueError: ``data`` is not exactly ``count * itemsize`` bytes; drop the packet.
    """
    mv = memoryview(data).cast("B")
    if count < 0 or mv.nbytes != count * dtype.itemsize:
        raise ValueError(
            f"payload of {mv.nbytes} bytes does not hold {count} {dtype} elements"
            f" ({dtype.itemsize} bytes each)"
        )
    if count == 0:
        return torch.empty(0, dtype=dtype)
    global _readonly_warned
    if not mv.readonly or _readonly_warned:
        return torch.frombuffer(mv, dtype=dtype, count=count)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_READONLY_WARNING, category=UserWarning)
        out = torch.frombuffer(mv, dtype=dtype, count=count)
    _readonly_warned = True
    return out


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Which participant owns (reduces) each chunk of a plan.

    Each participant owns one contiguous range of chunks, in ``participants`` order; the
    first ``nchunks % P`` own one more, so shares differ by at most one and, with more
    participants than chunks, the last own nothing. Contiguous shards let an owner step its
    optimizer on one slice, and a failed owner costs exactly its slice (ALGORITHMS.md,
    "each peer reduces 1/G"). A pure function of ``(plan, participants)``: peers agreeing
    on the list (e.g. ``node.alive_peers()``, sorted) agree on owners without a message.

    Raises:
        ValueError: ``participants`` is empty or has duplicates.
    """

    plan: ChunkPlan
    participants: Sequence[str]  # stored as a tuple
    # each participant's chunks, computed once: a round asks ~3 times per packet
    _ranges: dict[str, range] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        participants = tuple(self.participants)
        if not participants:
            raise ValueError("ShardMap needs at least one participant")
        index = {pid: j for j, pid in enumerate(participants)}
        if len(index) != len(participants):
            raise ValueError(f"ShardMap participants contain duplicates: {participants}")
        object.__setattr__(self, "participants", participants)
        ranges = {
            pid: range(self._first_chunk(j), self._first_chunk(j + 1)) for pid, j in index.items()
        }
        object.__setattr__(self, "_ranges", ranges)

    def _first_chunk(self, j: int) -> int:
        """First chunk of participant ``j`` (``j == P`` gives ``nchunks``)."""
        q, r = divmod(self.plan.nchunks, len(self.participants))
        return j * q + min(j, r)

    def owner(self, chunk: int) -> str:
        """The participant that owns ``chunk``; IndexError outside ``range(nchunks)``."""
        if not 0 <= chunk < self.plan.nchunks:
            raise IndexError(f"chunk {chunk} out of range for {self.plan.nchunks} chunks")
        q, r = divmod(self.plan.nchunks, len(self.participants))
        big = r * (q + 1)  # chunks held by the r participants with one extra
        j = chunk // (q + 1) if chunk < big else r + (chunk - big) // q
        return self.participants[j]

    def chunks_of(self, pid: str) -> range:
        """The chunk indices ``pid`` owns (maybe empty); KeyError for a non-participant."""
        chunks = self._ranges.get(pid)
        if chunks is None:
            raise KeyError(f"{pid!r} is not a participant of this ShardMap")
        return chunks

    def owned_range(self, pid: str) -> range:
        """The bucket elements ``pid`` owns, one contiguous range; KeyError as above."""
        chunks = self.chunks_of(pid)
        step = self.plan.chunk_elems
        return range(
            min(chunks.start * step, self.plan.numel), min(chunks.stop * step, self.plan.numel)
        )

    def view(self, buffer: torch.Tensor, pid: str) -> torch.Tensor:
        """``pid``'s shard of ``buffer`` as a view (no copy), e.g. for its optimizer step.

        Raises:
            ValueError: as :meth:`ChunkPlan.check`. KeyError: as :meth:`chunks_of`.
        """
        self.plan.check(buffer)
        span = self.owned_range(pid)
        return buffer.narrow(0, span.start, len(span))
