"""A published state: immutable bytes, their chunking and checksums.

Split from :mod:`.sync` so that the server (:mod:`.server`), which serves
snapshots, and the client (:mod:`.client`), which checks chunks against the
same digests, share one definition: BLAKE2b-128 per chunk, BLAKE2b-256 over the
whole.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from gossipnet.collectives.statesync.manifest import DIGEST_BYTES

__all__ = ("Snapshot", "chunk_digest", "whole_digest")

_DIGEST = DIGEST_BYTES


def chunk_digest(data: memoryview | bytes) -> bytes:
    """A chunk's digest (``DIGEST_BYTES`` long), as listed in a manifest."""
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def whole_digest(data: memoryview | bytes) -> bytes:
    """The whole state's digest (32 bytes)."""
    return hashlib.blake2b(data, digest_size=32).digest()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable published state: bytes, chunking and checksums."""

    sid: str
    data: bytes
    chunk_bytes: int
    digests: bytes
    whole: bytes
    meta: dict[str, Any]
    created: float

    @property
    def nchunks(self) -> int:
        return len(self.digests) // _DIGEST

    def chunk(self, c: int) -> memoryview:
        return memoryview(self.data)[c * self.chunk_bytes : (c + 1) * self.chunk_bytes]

    @classmethod
    def of(cls, data: bytes, chunk_bytes: int, meta: dict[str, Any], now: float) -> Snapshot:
        view = memoryview(data)
        n = max(1, -(-len(data) // chunk_bytes))
        digests = b"".join(
            chunk_digest(view[c * chunk_bytes : (c + 1) * chunk_bytes]) for c in range(n)
        )
        whole = whole_digest(view)
        return cls(whole[:8].hex(), data, chunk_bytes, digests, whole, dict(meta), now)
