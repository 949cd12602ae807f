"""Training state served to a peer that downloads it (``statesync``), and the
parameter bytes a realigning peer takes back in.

Shared by the all-reduce strategy (a realigning peer downloads the others'
parameters) and the Moshpit strategy (a joiner downloads the current state).  Why
hash here and install on the loop: hashing a model's bytes takes a while and
must not stall the loop, and the loop thread never reads tensors the trainer
is writing, so the bytes are made on the training thread (or a worker holding
the trainer's lock) and only the finished snapshot crosses over.

The all-reduce strategy serves its parameters as raw bytes (:func:`pack_params`:
the flat buckets back to back), not pickled: the receiver knows the layout (its own
model's, :func:`layout_key`), so nothing from the network is unpickled, the size is
exactly its own (a manifest announcing another is refused before anything is
kept), and each chunk can be compared with other peers' (their manifests' chunk
digests) before it is taken (:func:`write_chunks`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gossipnet.collectives.chunks import all_finite, as_bytes
from gossipnet.collectives.statesync.sync import Snapshot, StateSync
from gossipnet.training.host import TrainingHost

__all__ = (
    "install",
    "layout_key",
    "pack_params",
    "publish",
    "raw_size",
    "snapshot",
    "write_chunks",
)


def snapshot(
    data: bytes, chunk_bytes: int, step: int, meta: Mapping[str, Any] | None = None
) -> Snapshot:
    """A snapshot of packed state ``data`` at ``step`` (its time is set at install);
    ``meta`` is added to the manifest's meta (e.g. a realignment claim)."""
    return Snapshot.of(data, chunk_bytes, {"step": step, **(meta or {})}, 0.0)


def install(sync: StateSync, snap: Snapshot) -> None:
    """Serve ``snap`` from now on, stamped with the node's clock (loop thread only)."""
    sync.install(dataclasses.replace(snap, created=sync.node.clock.now()))


def publish(host: TrainingHost, pack: Callable[[], bytes], step: int) -> None:
    """Serve the state ``pack()`` returns at ``step``; nothing without statesync.

    Blocking: packs and hashes on the calling (training) thread, then installs
    on the loop thread and waits for it.
    """
    sync = host.statesync
    if sync is None:
        return
    snap = snapshot(pack(), sync.chunk_bytes, step)

    async def on_loop() -> None:
        install(sync, snap)

    host.call(on_loop())


def layout_key(buckets: Sequence[torch.Tensor]) -> str:
    """16 hex digits naming the buckets' dtypes and lengths, in order: two peers whose
    raw parameter bytes can be compared chunk by chunk have the same key."""
    desc = ";".join(f"{b.dtype}:{b.numel()}" for b in buckets)
    return hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()


def raw_size(buckets: Sequence[torch.Tensor]) -> int:
    """Bytes of :func:`pack_params` of ``buckets``."""
    return sum(b.numel() * b.element_size() for b in buckets)


def pack_params(buckets: Sequence[torch.Tensor]) -> bytes:
    """The flat parameter buckets' raw bytes, back to back (CPU copies are made)."""
    return b"".join(as_bytes(b.detach().cpu().contiguous()) for b in buckets)


def write_chunks(buckets: Sequence[torch.Tensor], parts: Mapping[int, bytes], chunk: int) -> str:
    """Overwrite chunk ``c`` (``chunk`` bytes each, the last may be short) of our packed
    parameters with ``parts[c]`` for every ``c`` given; the reason nothing was written
    (``"layout"``: a part out of range or of the wrong length; ``"non_finite"``), or
    "" once written.  All or nothing: the values are checked before any bucket changes.
    """
    staged = bytearray(pack_params(buckets))
    size = len(staged)
    for c, data in parts.items():
        start = c * chunk
        if c < 0 or start >= size or len(data) != min(chunk, size - start):
            return "layout"
        staged[start : start + len(data)] = data
    values: list[torch.Tensor] = []
    offset = 0
    for b in buckets:
        nbytes = b.numel() * b.element_size()
        if nbytes == 0:
            values.append(torch.empty(0, dtype=b.dtype))
            continue
        raw = torch.frombuffer(staged, dtype=torch.uint8, count=nbytes, offset=offset)
        values.append(raw.view(b.dtype))
        offset += nbytes
    floats = [v for v in values if v.is_floating_point()]
    if not all(all_finite(v) for v in floats):
        return "non_finite"
    with torch.no_grad():
        for b, v in zip(buckets, values, strict=True):
            b.copy_(v.view_as(b))
    return ""
