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

A whole training state (parameters, the optimizer's per-parameter state, the step
count: what a Moshpit joiner downloads) is checked by :func:`check_state` against
the local model before anything of it is used: at most :func:`state_bound` bytes
(from the local parameters and optimizer state), unpickled without running code
(``weights_only``), every tensor of the local shape and dtype and finite; and
:func:`adopt_state` takes only the parameters and the per-parameter state, never
the donor's hyperparameters (``param_groups``: lr, momentum, ...).  Anything else is
a reason string the caller counts, never an exception.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gossipnet.collectives.chunks import all_finite, as_bytes
from gossipnet.collectives.statesync.sync import Snapshot, StateSync, unpack_state
from gossipnet.training.host import TrainingHost

__all__ = (
    "adopt_state",
    "check_state",
    "install",
    "layout_key",
    "pack_params",
    "publish",
    "raw_size",
    "snapshot",
    "state_bound",
    "write_chunks",
)

#: Optimizer state assumed per parameter byte before the optimizer has any (Adam's two
#: moments; SGD's momentum takes one): the bound of a state downloaded at the start.
STATE_PER_PARAM = 2
#: Allowance for the container (``torch.save``'s zip records and pickle), fixed and
#: per tensor; generous next to what it takes.
OVERHEAD_BYTES = 64 << 10
OVERHEAD_PER_TENSOR = 1 << 10


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_bound(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """The most bytes a packed state of this model and optimizer may take: the
    parameters, their optimizer state (what it holds now, or :data:`STATE_PER_PARAM`
    times the parameters before it holds any, whichever is larger) and the container."""
    raw = sum(_nbytes(p) for p in params)
    held = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    state = max(sum(_nbytes(v) for v in held), STATE_PER_PARAM * raw)
    tensors = len(params) + max(len(held), 3 * len(params))
    return raw + state + OVERHEAD_BYTES + OVERHEAD_PER_TENSOR * tensors


def _state_value(v: object, like: torch.Tensor) -> str:
    """Why ``v`` is no per-parameter optimizer state of ``like`` ("" if it is): a
    tensor of its shape and dtype, or a number or 0-d tensor, all finite, or None."""
    if v is None:
        return ""
    if isinstance(v, torch.Tensor):
        shaped = v.dim() == 0 or (v.shape == like.shape and v.dtype == like.dtype)
        if v.layout != torch.strided or not shaped:
            return "layout"
        return "" if not v.is_floating_point() or all_finite(v.reshape(-1)) else "non_finite"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "layout"
    return "" if math.isfinite(v) else "non_finite"


def check_state(
    data: bytes, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any] | None, str]:
    """``{"params", "state", "step"}`` from a packed ``{"params", "optim", "step"}``
    if it fits this model and optimizer; else (None, why).

    ``state`` maps a parameter's index (the optimizer's order, as in its
    ``state_dict``) to its optimizer state: tensors of that parameter's shape and
    dtype, and scalars.  The donor's ``param_groups`` are never read.  Reasons:
    ``"oversize"``, ``"bad_pickle"``, ``"layout"``, ``"non_finite"``.  Never raises.
    """
    if len(data) > state_bound(params, optimizer):
        return None, "oversize"
    try:
        state = unpack_state(data)
    except Exception:  # any failure to parse another peer's bytes is that peer's fault
        return None, "bad_pickle"
    theirs, optim, step = state.get("params"), state.get("optim"), state.get("step")
    if not (isinstance(theirs, list) and len(theirs) == len(params)):
        return None, "layout"
    if type(step) is not int or step < 0 or not isinstance(optim, dict):
        return None, "layout"
    per_param = optim.get("state", {})
    if not isinstance(per_param, dict):
        return None, "layout"
    for t, p in zip(theirs, params, strict=True):
        if not (isinstance(t, torch.Tensor) and t.shape == p.shape and t.dtype == p.dtype):
            return None, "layout"
        if t.is_floating_point() and not all_finite(t.reshape(-1)):
            return None, "non_finite"
    for i, st in per_param.items():
        if type(i) is not int or not 0 <= i < len(params) or not isinstance(st, dict):
            return None, "layout"
        for v in st.values():
            why = _state_value(v, params[i])
            if why:
                return None, why
    return {"params": theirs, "state": per_param, "step": step}, ""


def adopt_state(
    checked: Mapping[str, Any], params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """Copy a :func:`check_state` result into ``params`` and ``optimizer.state``; the
    optimizer's hyperparameters stay as they are."""
    with torch.no_grad():
        for p, t in zip(params, checked["params"], strict=True):
            p.copy_(t)
    for i, st in checked["state"].items():
        p = params[i]
        optimizer.state[p] = {
            k: v.clone().to(p.device) if isinstance(v, torch.Tensor) and v.dim() else v
            for k, v in st.items()
        }
