"""Quantisers, pure tensor functions on one chunk (CPU or CUDA alike).

``bf16`` / ``fp16``: a cast (fp16 saturates to +-65504 instead of becoming inf:
a gradient that large is clipped, never turned into a non-finite value that the
receiver would have to drop).  ``int8``: one float32 scale per chunk,
``s = max|x| / 127``, ``q = round(x / s)``; an all-zero chunk has ``s = 0`` and
decodes to zeros.  Non-finite inputs are the caller's to refuse (the all-reduce
sends them with weight 0, as on the dense path); here they give a non-finite
scale, which every receiver drops as ``non_finite`` (counted).

The sparse compressors' value codecs (``values=``, :func:`code_values`):
``"fp32"`` as is, ``"bf16"`` the cast, ``"int8"`` one float32 scale for the
values of one packet and, per group of :data:`GROUP` values, a power-of-two
step below it (:func:`quantize_grouped_int8`).  Why the groups: one packet of a
sparse round carries blocks from several layers whose gradients differ by
orders of magnitude; with one scale per packet the small layers' values rounded
to zero and waited in error feedback (demo, ArcTopK 0.02: perplexity 23.7 with
int8 against 18.8 with fp32 values).  A shift per 16 values costs 1/16 byte per
value.  They return what a receiver will decode beside what travels, so a
sender keeps the rounding error in its error feedback and an owner applies
exactly what its receivers apply.
"""

from __future__ import annotations

import torch

__all__ = (
    "CODEC_IDS",
    "HALF",
    "MAX_SCALE",
    "VALUE_BYTES",
    "code_values",
    "coded_bytes",
    "GROUP",
    "dequantize_grouped_int8",
    "dequantize_int8",
    "from_half",
    "group_count",
    "quantize_grouped_int8",
    "quantize_int8",
    "to_half",
    "value_cost",
)

#: Half dtypes by name.
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FP16_MAX = 65504.0
#: The value codecs' ids in a payload's header (``values=`` of ArcTopK and DCT).
CODEC_IDS = {"fp32": 0, "bf16": 1, "int8": 2}
#: Bytes per value of each codec (int8: plus a shift per :data:`GROUP` values).
VALUE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
#: Values that share one power-of-two step in the sparse int8 codec (one u8 shift).
GROUP = 16
#: The largest shift: a group's step is at least ``scale / 2**MAX_SHIFT``.
MAX_SHIFT = 31
#: The largest int8 scale a finite float32 input gives (``max|x| / 127`` at the
#: largest float32, rounded as :func:`quantize_int8` rounds it); a larger one in a
#: payload is forged or broken (and would decode past float32 to inf).
MAX_SCALE = float(torch.tensor(torch.finfo(torch.float32).max) / 127.0)


def to_half(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` cast to ``name`` (``"bf16"`` or ``"fp16"``, the latter saturating)."""
    if name == "fp16":
        x = x.clamp(-_FP16_MAX, _FP16_MAX)
    return x.to(HALF[name])


def from_half(h: torch.Tensor) -> torch.Tensor:
    """Half values back to float32."""
    return h.to(torch.float32)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, q)``: a float32 scale (0-dim) and int8 values with ``x ~ scale * q``.

    The error per element is at most ``scale / 2`` (round to nearest).
    """
    amax = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
    scale = (amax.to(torch.float32) / 127.0).reshape(())
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x.to(torch.float32) / safe).clamp_(-127, 127).to(torch.int8)
    return scale, q


def dequantize_int8(scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 values of ``(scale, q)``."""
    return q.to(torch.float32) * scale.to(torch.float32)


def group_count(count: int) -> int:
    """Groups (one shift each) of ``count`` values in the sparse int8 codec."""
    return -(-count // GROUP)


def _group_steps(scale: torch.Tensor, shifts: torch.Tensor, count: int) -> torch.Tensor:
    """Per value, its group's step ``scale * 2**-shift``."""
    steps = scale.reshape(1).to(torch.float32) * torch.exp2(-shifts.to(torch.float32))
    return steps.repeat_interleave(GROUP)[:count]


def quantize_grouped_int8(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, shifts, q)``: a float32 scale (``max|x| / 127``), one u8 shift per
    :data:`GROUP` values and int8 values, ``x ~ q * scale * 2**-shift``.

    Each group takes the largest shift (at most :data:`MAX_SHIFT`) whose step
    still covers its own largest value, so a group of small values is rounded
    as finely as the packet's largest group is; the error per element is at most
    half its group's step.
    """
    x = x.detach().to(torch.float32)
    n = x.numel()
    groups = group_count(n)
    mag = torch.nn.functional.pad(x.abs(), (0, groups * GROUP - n)).view(groups, GROUP)
    gmax = mag.amax(dim=1) if n else mag.new_zeros(0)
    amax = gmax.max() if n else x.new_zeros(())
    scale = (amax / 127.0).reshape(())
    ratio = torch.where(gmax > 0, amax / gmax.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    shifts = torch.floor(torch.log2(ratio)).clamp_(0, MAX_SHIFT)
    # log2 of a rounded ratio can land just above an integer: never let a group's
    # largest value outgrow its step's range (it would clamp at 127)
    shifts -= (torch.ldexp(gmax, shifts.to(torch.int32)) > amax).to(shifts.dtype)
    shifts = shifts.clamp_(0, MAX_SHIFT).to(torch.uint8)
    steps = _group_steps(scale, shifts, n)
    safe = torch.where(steps > 0, steps, torch.ones_like(steps))
    q = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
    return scale, shifts, q


def dequantize_grouped_int8(
    scale: torch.Tensor, shifts: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """float32 values of ``(scale, shifts, q)``."""
    return q.to(torch.float32) * _group_steps(scale, shifts, q.numel())


def value_cost(codec: str) -> float:
    """Bytes per value of ``codec`` on average, an int8 group's shift included
    (what a packet budget counts per value beside :func:`coded_bytes`' fixed part)."""
    return (coded_bytes(codec, GROUP) - coded_bytes(codec, 0)) / GROUP


def coded_bytes(codec: str, count: int) -> int:
    """Payload bytes of ``count`` values in ``codec`` (int8: with its 4-byte scale
    and a shift byte per group)."""
    if codec == "int8":
        return count + 4 + group_count(count)
    return VALUE_BYTES[codec] * count


def code_values(x: torch.Tensor, codec: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(parts, decoded)``: the tensors that travel for the values ``x`` in ``codec``
    (in order; int8: the scale, always present, the shifts, then the values) and
    the float32 values a receiver decodes from them."""
    x = x.detach().to(torch.float32)
    if codec == "fp32":
        return [x], x
    if codec == "bf16":
        h = x.to(torch.bfloat16)
        return [h], from_half(h)
    scale, shifts, q = quantize_grouped_int8(x)
    return [scale.reshape(1), shifts, q], dequantize_grouped_int8(scale, shifts, q)
