"""What the round asks of a compressor: :class:`ChunkCodec` (a Protocol).

Why a Protocol here: the compressors live in :mod:`gossipnet.collectives.compress`,
which knows nothing of rounds' phases; the engine calls it at four points per
chunk (encode and decode, in each phase) and twice per round (``begin``,
``finish``), and a dense round passes none.  Compressed packets carry ``"z"``
(their payload kind; in the fixed data header, flag bit 3 and the u16 that was
reserved) beside the usual fields, ``dt="u8"`` and ``n`` = payload bytes, and
take the per-packet path (the batch intake is for dense chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ("ChunkCodec", "Decoded")

#: A decoded contribution: its dense values for the whole chunk and the weight to
#: add it with (0 where the packet carried no usable values), or a drop reason.
Decoded = tuple[torch.Tensor, float | None] | str


class ChunkCodec(Protocol):
    """One compressor for one round; every method runs on the loop thread."""

    #: The round's broadcast carries parameters (set by :meth:`begin`): each chunk
    #: travels as its update from ``rnd.dst``, which every receiver adds to its own.
    param_mode: bool

    def setting(self) -> str:
        """What every peer must pass alike (family, value codec, block), short: it
        joins the round's layout description, so another setting is a
        ``LayoutMismatchError`` naming both, not packets dropped one by one."""
        ...

    def chunk_bytes(
        self, base: int, numel: int, itemsize: int, participants: int, param_mode: bool
    ) -> int:
        """Bytes of dense data per chunk so that a compressed payload fits ``base``
        (``param_mode``: the broadcast carries parameter updates, compressed alike)."""
        ...

    def begin(self, rnd: Any, param_mode: bool) -> None:
        """Before the round's sends: compress our own contribution to our shard
        (into the reducers' accumulators); ``param_mode``: the broadcast carries
        parameters (the optimizer), not the averages: see :attr:`param_mode`."""
        ...

    def encode_rs(self, rnd: Any, owner: str, b: int, c: int) -> tuple[int, bytes]:
        """``(z, payload)`` of our contribution to chunk ``c`` of bucket ``b``."""
        ...

    def decode_rs(
        self, rnd: Any, src: str, b: int, c: int, z: int, payload: memoryview, w: float
    ) -> Decoded:
        """A contribution for one of our chunks, decoded; or why it was dropped."""
        ...

    def encode_ag(
        self, rnd: Any, b: int, c: int, values: torch.Tensor, counted: Callable[[str], bool]
    ) -> tuple[int, bytes, torch.Tensor] | None:
        """``(z, payload, what receivers will decode)`` of our broadcast of chunk
        ``c`` (``values`` its averages, or its new parameters: then the payload is
        their update from ``rnd.dst``'s chunk, and what receivers decode is that
        chunk plus the decoded update); None: send it dense."""
        ...

    def decode_ag(
        self, rnd: Any, src: str, b: int, c: int, z: int, payload: memoryview
    ) -> torch.Tensor | str:
        """A broadcast chunk's dense values (parameter rounds: ``rnd.dst``'s chunk
        plus the update), or why it was dropped."""
        ...

    def finish(self, rnd: Any) -> dict[str, float]:
        """The round's report extras (the compressor's counters; the engine adds the
        bytes, :mod:`.wirebytes`)."""
        ...
