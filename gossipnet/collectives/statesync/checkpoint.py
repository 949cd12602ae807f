"""Training state <-> bytes, and atomic local checkpoints (used by state sync).

Split from :mod:`gossipnet.collectives.statesync.sync` to keep modules small; import
these names from there.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

import torch

__all__ = ("load_checkpoint", "pack_state", "save_atomic", "unpack_state")


def pack_state(state: dict[str, Any]) -> bytes:
    """Serialise tensors, numbers and containers (``torch.save`` format)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def unpack_state(data: bytes) -> dict[str, Any]:
    """Inverse of :func:`pack_state`; ``weights_only`` so bytes from the network
    cannot run code (the MAC authenticates peers; this limits what a bug or an
    insider could do)."""
    out = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(out, dict):
        raise ValueError("state blob does not hold a dict")
    return out


def save_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory,
    fsync, ``os.replace``, fsync of the directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike[str]) -> bytes | None:
    """The checkpoint's bytes, or None if there is none."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
