"""The compressor value types users pass as ``compress=``, and their validation.

Why frozen values: a compressor setting is part of what a round *is* (two peers
with different settings cut their buckets differently and are told apart by the
layout check), so it must compare, hash and log like any option; the state a
compressor needs across rounds (error feedback, index sets) lives elsewhere, in a
:class:`~gossipnet.collectives.compress.session.CompressSession` per layout.

Every bad argument raises :class:`gossipnet.ConfigError` naming the accepted values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossipnet.errors import ConfigError

__all__ = (
    "DCT",
    "QUANT_NAMES",
    "Accordion",
    "ArcTopK",
    "Compression",
    "Int8",
    "Sparse",
    "VALUE_CODECS",
    "resolve",
)

#: The string forms of ``compress=``: half-precision casts of every value.
QUANT_NAMES = ("bf16", "fp16")

#: How the sparse compressors' values travel (``values=``): float32, a bf16 cast, or
#: int8 with one float32 scale per packet.
VALUE_CODECS = ("fp32", "bf16", "int8")


def _density(name: str, value: object) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ConfigError(f"{name} must be a number in (0, 1], got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ConfigError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def _values(name: str, value: object) -> None:
    if not isinstance(value, str) or value not in VALUE_CODECS:
        accepted = ", ".join(repr(v) for v in VALUE_CODECS)
        raise ConfigError(f"{name} must be one of {accepted}, got {value!r}")


def _positive_int(name: str, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Int8:
    """Int8 with one float32 scale per chunk (per packet): ``q = round(x / s)``,
    ``s = max|x| / 127``; 4x fewer bytes than float32, no error feedback on the
    gradients (the rounding error is below 1/254 of the chunk's largest magnitude).
    The optimizer's parameter updates travel alike, their rounding kept by the owner."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ArcTopK:
    """ARC-Top-K: the owner of each chunk picks its index set (blocks of ``block``
    elements) from the summed sketches it received, announces it with its
    broadcast, and every peer sends only the values at that set (no index list).

    Attributes:
        density: fraction of a chunk's elements sent, in (0, 1].
        block: elements per block of the index set and of the sketch (a power of two
            in [8, 4096]); larger blocks: smaller sketches and announcements, coarser
            sets (measured on ``bench/compression.py``'s regression task at density
            0.01, 300 steps: block 16 reached MSE 5.65, block 32 8.6, dense 2.69).
        eta: EF21M momentum of the error feedback, in (0, 1]: ``v <- (1-eta) v + eta g``;
            1 is plain error feedback (use it when the base optimizer has momentum).
        values: how the values travel: ``"fp32"``, ``"bf16"`` (2 bytes each) or
            ``"int8"`` (1 byte each, one float32 scale per packet and a
            power-of-two step per 16 values, :func:`.quant.quantize_grouped_int8`).
            The contributions' rounding error stays in the error feedback; the
            owner's broadcast of the averages is rounded once, not error-fed (int8:
            at most half the step of the value's group); the optimizer's parameter
            updates travel in it too, their rounding kept by the owner.
        catch_up: with an Adam or AdamW base optimizer (``net.optimizer``, or
            ``net.all_reduce(..., step=opt)``), step
            each element as the rounds its value stands for (error feedback sends
            the sum of the rounds since it last left) and choose the next set by
            the step each block would take (block energy over Adam's ``v``).
            Without it AdamW moves rarely sent elements about ``sqrt(k)`` times
            too little (``gossipnet.collectives.compress.staleness``).  No effect
            on other optimizers or on an ``all_reduce`` without ``step=``.
    """

    density: float = 0.01
    block: int = 16
    eta: float = 1.0
    values: str = "fp32"
    catch_up: bool = True

    def __post_init__(self) -> None:
        _density("ArcTopK.density", self.density)
        b = self.block
        if not (isinstance(b, int) and 8 <= b <= 4096 and b & (b - 1) == 0):
            raise ConfigError(f"ArcTopK.block must be a power of two in [8, 4096], got {b!r}")
        _density("ArcTopK.eta", self.eta)
        _values("ArcTopK.values", self.values)


@dataclass(frozen=True, kw_only=True, slots=True)
class DCT:
    """Dynamic Communication Thresholding: send the entries with ``|u| >= theta``
    (with their indices), ``theta`` the ``1 - density`` quantile of ``|u|``,
    refreshed every ``refresh_every`` rounds (in between, one comparison); plain
    error feedback keeps what was not sent.

    Attributes:
        density: expected fraction of entries sent, in (0, 1]; sets the quantile.
        quantile: alternatively the quantile itself, in [0, 1) (``1 - density``).
        refresh_every: rounds between threshold refreshes, >= 1.
        values: how the values travel, as :class:`ArcTopK`'s ``values`` (the
            indices stay u32).
    """

    density: float | None = None
    quantile: float | None = None
    refresh_every: int = 1000
    values: str = "fp32"

    def __post_init__(self) -> None:
        if self.density is not None and self.quantile is not None:
            raise ConfigError("DCT takes density or quantile, not both")
        if self.quantile is not None:
            q = self.quantile
            if not (isinstance(q, (int, float)) and 0.0 <= q < 1.0):
                raise ConfigError(f"DCT.quantile must be a number in [0, 1), got {q!r}")
        elif self.density is not None:
            _density("DCT.density", self.density)
        _positive_int("DCT.refresh_every", self.refresh_every)
        _values("DCT.values", self.values)

    @property
    def keep(self) -> float:
        """The fraction of entries kept (default 0.01)."""
        if self.quantile is not None:
            return 1.0 - float(self.quantile)
        return 0.01 if self.density is None else float(self.density)


#: The compressors with a density knob, which :class:`Accordion` switches.
Sparse = ArcTopK | DCT


@dataclass(frozen=True, kw_only=True, slots=True)
class Accordion:
    """Accordion: per layer (each tensor of the call = one bucket), ``low``
    compression (the denser setting) in critical regimes, ``high`` otherwise.

    The rule (Agarwal et al. 2021, ALGORITHMS.md section 6): every ``interval``
    rounds, a layer whose accumulated gradient norm changed by a relative
    ``>= threshold`` since the previous interval is critical; the first interval
    is critical.

    Attributes:
        low: the light compression (e.g. ``ArcTopK(density=0.1)``).
        high: the heavy one, the same family, block, eta and values (e.g.
            ``ArcTopK(density=0.01)``).
        interval: rounds per interval, >= 1.
        threshold: relative change that marks a critical regime, > 0 (the authors': 0.5).
    """

    low: Sparse
    high: Sparse
    interval: int = 10
    threshold: float = 0.5

    def __post_init__(self) -> None:
        for name, c in (("low", self.low), ("high", self.high)):
            if not isinstance(c, (ArcTopK, DCT)):
                raise ConfigError(
                    f"Accordion.{name} must be a gossipnet.ArcTopK or gossipnet.DCT, got {c!r}"
                )
        if type(self.low) is not type(self.high):
            raise ConfigError("Accordion.low and .high must be the same family (ArcTopK or DCT)")
        lo, hi = self.low, self.high
        if (
            isinstance(lo, ArcTopK)
            and isinstance(hi, ArcTopK)
            and (lo.block, lo.eta) != (hi.block, hi.eta)
        ):
            raise ConfigError("Accordion's ArcTopK settings may differ in density only")
        if lo.values != hi.values:
            raise ConfigError(
                "Accordion.low and .high must send values alike,"
                f" got {lo.values!r} and {hi.values!r}"
            )
        if density_of(self.low) < density_of(self.high):
            raise ConfigError("Accordion.low must be the lighter compression (density >= high's)")
        _positive_int("Accordion.interval", self.interval)
        t = self.threshold
        if not (isinstance(t, (int, float)) and 0 < t < math.inf):
            raise ConfigError(f"Accordion.threshold must be a number > 0, got {t!r}")


def density_of(c: Sparse) -> float:
    """The fraction of entries ``c`` sends."""
    return c.density if isinstance(c, ArcTopK) else c.keep


#: What ``compress=`` resolves to (None: dense).
Compression = str | Int8 | ArcTopK | DCT | Accordion


def resolve(compress: object) -> Compression | None:
    """Check a ``compress=`` argument; None or ``"none"`` for dense.

    Raises:
        ConfigError: anything but None, ``"none"``, ``"bf16"``, ``"fp16"``,
            ``gossipnet.Int8()``, ``ArcTopK``, ``DCT`` or ``Accordion``.
    """
    if compress is None or compress == "none":
        return None
    if isinstance(compress, str):
        if compress in QUANT_NAMES:
            return compress
        raise ConfigError(
            f"compress={compress!r} is not known; use None, 'bf16', 'fp16', gossipnet.Int8(),"
            " gossipnet.ArcTopK(...), gossipnet.DCT(...) or gossipnet.Accordion(...)"
        )
    if isinstance(compress, (Int8, ArcTopK, DCT, Accordion)):
        return compress
    raise ConfigError(
        f"compress={compress!r} is not a compressor; use None, 'bf16', 'fp16',"
        " gossipnet.Int8(), gossipnet.ArcTopK(...), gossipnet.DCT(...) or gossipnet.Accordion(...)"
    )
