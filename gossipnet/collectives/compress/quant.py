"""Quantisers, pure tensor functions on one chunk (CPU or CUDA alike).

``bf16`` / ``fp16``: a cast (fp16 saturates to +-65504 instead of becoming inf:
a gradient that large is clipped, never turned into a non-finite value that the
receiver would have to drop).  ``int8``: one float32 scale per chunk,
``s = max|x| / 127``, ``q = round(x / s)``; an all-zero chunk has ``s = 0`` and
decodes to zeros.  Non-finite inputs are the caller's to refuse (the all-reduce
sends them with weight 0, as on the dense path); here they give a non-finite
scale, which every receiver drops as ``non_finite`` (counted).

The sparse compressors' value codecs (``values=``, :func:`code_values`) reuse
these: ``"fp32"`` as is, ``"bf16"`` the cast, ``"int8"`` one scale for the
values of one packet.  They return what a receiver will decode beside what
travels, so a sender keeps the rounding error in its error feedback and an owner
applies exactly what its receivers apply.
"""

from __future__ import annotations

import torch

__all__ = (
    "CODEC_IDS",
    "HALF",
    "VALUE_BYTES",
    "code_values",
    "coded_bytes",
    "dequantize_int8",
    "from_half",
    "quantize_int8",
    "to_half",
)

#: Half dtypes by name.
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FP16_MAX = 65504.0
#: The value codecs' ids in a payload's header (``values=`` of ArcTopK and DCT).
CODEC_IDS = {"fp32": 0, "bf16": 1, "int8": 2}
#: Bytes per value of each codec.
VALUE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


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


def coded_bytes(codec: str, count: int) -> int:
    """Payload bytes of ``count`` values in ``codec`` (int8: with its 4-byte scale)."""
    return VALUE_BYTES[codec] * count + (4 if codec == "int8" else 0)


def code_values(x: torch.Tensor, codec: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(parts, decoded)``: the tensors that travel for the values ``x`` in ``codec``
    (in order; int8: the scale, always present, then the values) and the float32
    values a receiver decodes from them."""
    x = x.detach().to(torch.float32)
    if codec == "fp32":
        return [x], x
    if codec == "bf16":
        h = x.to(torch.bfloat16)
        return [h], from_half(h)
    scale, q = quantize_int8(x)
    return [scale.reshape(1), q], dequantize_int8(scale, q)
