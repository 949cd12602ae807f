"""Tensor plumbing of the backend: reduce-op names, staging for the lossy all-reduce,
tensors to bytes and back, and the exact reductions (pure functions, no I/O).

Why apart from the process group: these are what the semantics hang on (which
calls are lossy, how SUM is scaled, how a dead rank's slot is treated) and are
tested alone without a network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = (
    "LOSSY_DTYPES",
    "Staged",
    "UnsupportedError",
    "exact_reduce",
    "from_bytes",
    "op_name",
    "stage",
    "to_bytes",
)

#: Float dtypes the lossy all-reduce averages (integers always take the exact path).
LOSSY_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
_OPS = dict(dist.ReduceOp.RedOpType.__members__)
_EXACT_OPS = frozenset({"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"})
_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


class UnsupportedError(RuntimeError):
    """A ``torch.distributed`` call or reduce op the gossipnet backend does not offer."""


def op_name(reduce_op: object) -> str:
    """``"SUM"``, ``"MAX"``, ... for a ``ReduceOp`` (or its ``RedOpType``)."""
    for name, member in _OPS.items():
        if reduce_op == member:
            return name
    return str(reduce_op)


def check_op(name: str, dtype: torch.dtype) -> None:
    """Raise :class:`UnsupportedError` for an op the backend cannot reduce exactly."""
    if name not in _EXACT_OPS:
        raise UnsupportedError(
            f"gossipnet backend: ReduceOp.{name} is not supported (supported: SUM and AVG,"
            " lossy for float tensors; PRODUCT, MIN, MAX, BAND, BOR, BXOR exact)"
        )
    if name in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise UnsupportedError(
            f"gossipnet backend: ReduceOp.{name} needs integer tensors, got {dtype}"
        )
    if name == "AVG" and not dtype.is_floating_point:
        raise UnsupportedError(f"gossipnet backend: ReduceOp.AVG needs float tensors, got {dtype}")


@dataclasses.dataclass(slots=True)
class Staged:
    """An all-reduce's input as flat contiguous CPU buckets for the lossy engine.

    Attributes:
        buckets: one flat CPU bucket per tensor: the tensor itself where it already is
            one (reduced in place), else a copy written back by :meth:`write_back`.
        weight: 1, or 0 where a local value was not finite (zeroed, not sent).
    """

    tensors: list[torch.Tensor]
    buckets: list[torch.Tensor]
    weight: float

    def write_back(self) -> None:
        for t, b in zip(self.tensors, self.buckets, strict=True):
            if b.data_ptr() != t.data_ptr() or t.device.type != "cpu":
                t.copy_(b.view(t.shape))


def stage(tensors: Sequence[torch.Tensor]) -> Staged:
    """Flat CPU buckets of ``tensors``; non-finite values zeroed (weight 0 then)."""
    buckets = []
    for t in tensors:
        if t.device.type == "cpu" and t.is_contiguous():
            buckets.append(t.detach().view(-1))
        else:
            buckets.append(t.detach().to("cpu").contiguous().view(-1))
    finite = all(bool(torch.isfinite(b).all()) for b in buckets)
    if not finite:
        for b in buckets:
            torch.nan_to_num_(b, nan=0.0, posinf=0.0, neginf=0.0)
    return Staged(list(tensors), buckets, 1.0 if finite else 0.0)


def to_bytes(tensors: Sequence[torch.Tensor]) -> bytes:
    """The tensors' raw bytes, concatenated (CPU copies where needed)."""
    parts = [t.detach().to("cpu").contiguous().view(-1).view(torch.uint8) for t in tensors]
    if not parts:
        return b""
    return torch.cat(parts).numpy().tobytes()


def from_bytes(data: bytes, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split ``data`` into CPU tensors shaped and typed like ``like``.

    Raises:
        ValueError: ``data`` is not exactly as long as ``like`` needs (ranks passed
            tensors of other shapes or dtypes).
    """
    need = sum(t.numel() * t.element_size() for t in like)
    if len(data) != need:
        raise ValueError(
            f"gossipnet backend: a rank sent {len(data)} bytes where {need} were expected"
            " (tensors of different shapes or dtypes across ranks)"
        )
    out, at = [], 0
    raw = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    for t in like:
        size = t.numel() * t.element_size()
        out.append(raw[at : at + size].view(t.dtype).view(t.shape))
        at += size
    return out


def exact_reduce(name: str, stacked: torch.Tensor, world: int) -> torch.Tensor:
    """Reduce ``stacked`` (one row per rank heard, in rank order) with op ``name``.

    SUM over fewer rows than ``world`` (a dead rank excused) is scaled to ``world``
    times the mean of what arrived, as the lossy path does (floats; integer SUMs
    stay plain sums).  Reducing in rank order gives every rank the same bits.
    """
    heard = stacked.shape[0]
    if name == "SUM":
        out = stacked.sum(dim=0)
        if heard < world and out.dtype.is_floating_point:
            out = out * (world / heard)
        return out.to(stacked.dtype)
    if name == "AVG":
        return stacked.mean(dim=0).to(stacked.dtype)
    if name == "PRODUCT":
        return stacked.prod(dim=0).to(stacked.dtype)
    if name == "MIN":
        return stacked.amin(dim=0)
    if name == "MAX":
        return stacked.amax(dim=0)
    fn = _BITWISE[name]
    out = stacked[0].clone()
    for row in stacked[1:]:
        out = fn(out, row)
    return out
