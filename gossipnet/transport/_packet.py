"""One accepted packet, as the wire codec hands it on (re-exported by :mod:`.wire`).

Its own module so that the codec's helpers (:mod:`._fast_decode`) build packets
without importing the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ("Packet",)


@dataclass(slots=True)
class Packet:
    """One accepted packet.  Read-only by convention: never assign to its fields.

    Why not ``frozen=True``: a frozen dataclass sets each field through
    ``object.__setattr__``, and building one cost 0.67 us against 0.13 us, per
    received packet (tens of thousands a second).  It was never hashable either
    (``fields`` is a dict); copy with ``dataclasses.replace``.

    ``fields`` holds the caller's header fields only (reserved keys removed).
    ``payload`` is a byte-format view of the received frame, not a copy: keep
    it only as long as the transport's buffer lives, or copy it.
    ``directed``: the packet came under its sender's pairwise key, so it was meant for
    us (False: an introduction, which any member can send under any name).
    ``fresh``: it advanced its sender's replay window (False: an older packet
    arriving late); only fresh directed packets are evidence a peer is alive now.
    """

    src: str
    epoch: int
    seq: int
    kind: int
    fields: dict[str, Any]
    payload: memoryview
    directed: bool = True
    fresh: bool = True
