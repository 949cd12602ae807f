"""A state-sync manifest, checked field by field before anything is allocated from it.

Why a module of its own: a manifest comes from another peer, and every number in it
sizes a buffer or an index on our side.  Before issue 19 it was used as sent:
``sz=2**40`` raised MemoryError, a string or a negative size TypeError or ValueError
out of ``StateSync.download``.  This pure function is the one place that decides
what a manifest may say; ``statesync.py`` counts a None as a reject.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

__all__ = ("DIGEST_BYTES", "WHOLE_BYTES", "chunk_size", "parse_manifest")

#: BLAKE2b-128 per chunk, BLAKE2b-256 of the whole state.
DIGEST_BYTES = 16
WHOLE_BYTES = 32
_MAX_SID = 64


def parse_manifest(
    fields: Mapping[str, Any], payload: bytes | memoryview, *, max_bytes: int, max_chunk: int
) -> dict[str, Any] | None:
    """The manifest ``{sid, sz, cb, d, w, m}`` if every field is typed and in range.

    Checked: ``sid`` a str of 1 to 64 characters; ``sz`` an int in [0, ``max_bytes``];
    ``cb`` an int in [1, ``max_chunk``]; in the msgpack payload, ``d`` exactly one
    16-byte digest per chunk of ``sz``, ``w`` a 32-byte digest, ``m`` a map with str
    keys.  The payload is parsed with a size limit fitted to ``sz``.

    Returns:
        The manifest, or None if anything is off (never raises).
    """
    sid, sz, cb = fields.get("sid"), fields.get("sz"), fields.get("cb")
    if not (isinstance(sid, str) and 0 < len(sid) <= _MAX_SID):
        return None
    if type(sz) is not int or not 0 <= sz <= max_bytes:
        return None
    if type(cb) is not int or not 0 < cb <= max_chunk:
        return None
    nchunks = max(1, -(-sz // cb))
    try:
        limit = max(nchunks * DIGEST_BYTES, WHOLE_BYTES)
        body = msgpack.unpackb(payload, max_bin_len=limit, max_ext_len=0)
    except Exception:
        return None
    if type(body) is not dict:
        return None
    d, w, m = body.get("d"), body.get("w"), body.get("m")
    if type(d) is not bytes or len(d) != nchunks * DIGEST_BYTES:
        return None
    if type(w) is not bytes or len(w) != WHOLE_BYTES:
        return None
    if type(m) is not dict or not all(isinstance(k, str) for k in m):
        return None
    return {"sid": sid, "sz": sz, "cb": cb, "d": d, "w": w, "m": m}


def chunk_size(manifest: Mapping[str, Any], c: int) -> int:
    """Bytes of chunk ``c`` of a parsed manifest (the last one may be short)."""
    return int(max(0, min(manifest["cb"], manifest["sz"] - c * manifest["cb"])))
