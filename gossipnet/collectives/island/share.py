"""Buffers that the processes of one island share: host identity, handles, rebuilding.

Why not ``torch.multiprocessing``'s CPU sharing: its default strategy passes file
descriptors through a server that checks the multiprocessing ``authkey``, which only
processes forked or spawned from one parent share; torchrun's workers are unrelated
processes.  CPU buffers are therefore files in ``/dev/shm`` (a name is all the leader
needs, and ``torch.from_file`` maps it), CUDA buffers go through CUDA IPC
(``torch.multiprocessing.reductions.reduce_tensor``, a handle any process on the machine
can open).

A handle travels as a pickle of *plain values only* (str, int, bytes, bool, tuples,
lists): :func:`load_handles` refuses every global, so even a forged handle could not
run code.  Handles come only from our own peers anyway: each packet's MAC is checked
with the run's secret before anything reads it.

A file handle names a path, and a path can be a trap: a symlink in ``/dev/shm``
to another file of ours would be mapped and written to (issue 19).  So
:func:`open_handles` accepts only ``<shm dir>/gossipnet-<pid>-<hex>``, opens it
with ``O_NOFOLLOW`` and checks what it opened: a regular file, owned by us,
writable by nobody else, of the expected size; the mapping is then made through
that open descriptor (``/proc/self/fd``), never by looking the name up again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pickle
import re
import secrets
import socket
import stat
import tempfile
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gossipnet.transport.wire import DTYPE_CODES, DTYPES

__all__ = ("SharedBuckets", "host_id", "load_handles", "open_handles", "sweep_stale")

_SHM_DIR = "/dev/shm"
_NAME = re.compile(r"gossipnet-[0-9]+-[0-9a-f]{12}")


@functools.cache
def host_id() -> str:
    """This machine's identity: hostname + kernel boot id, hashed (16 hex digits).

    Why the boot id: containers often share a hostname across machines (``localhost``),
    while processes that can open each other's ``/dev/shm`` files and CUDA IPC handles
    run under one kernel.  Where there is no boot id (not Linux), the hostname alone.
    """
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return hashlib.blake2b(f"{socket.gethostname()}|{boot}".encode(), digest_size=8).hexdigest()


def _shm_dir() -> str:
    return _SHM_DIR if os.path.isdir(_SHM_DIR) else tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, it is not ours
        return True
    return True


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove the bucket files of processes that no longer exist; returns their paths.

    Why: a process killed with SIGKILL (an OOM kill, a preempted worker) never runs
    its finalizers, so its ``/dev/shm`` files outlive it and hold RAM until reboot.
    The file name carries the creator's pid, so the next process that shares buckets
    on this machine removes what dead creators left.  A live pid is never touched,
    even if it was reused by an unrelated process (the safe side); files whose name
    does not parse are not ours and stay.
    """
    directory = directory or _shm_dir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            parts = name.split("-")
            if len(parts) != 3 or parts[0] != "gossipnet" or not parts[1].isdigit():
                continue
            if int(parts[1]) == os.getpid() or _pid_alive(int(parts[1])):
                continue
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


@functools.cache
def _sweep_once(directory: str) -> None:
    sweep_stale(directory)


def _unlink_all(paths: Sequence[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)


class SharedBuckets:
    """Flat buckets (one per dtype of a layout) that another local process can map.

    Args:
        layout: (numel, dtype) per bucket.
        device: ``cpu`` (files in ``/dev/shm``, removed when this object is collected
            or the process exits normally, or, after a kill, by the next process on
            the machine that creates buckets: :func:`sweep_stale`) or a CUDA device
            (CUDA IPC).
    """

    def __init__(self, layout: Sequence[tuple[int, torch.dtype]], device: torch.device) -> None:
        self.layout = tuple(layout)
        self.device = device
        self.paths: list[str] = []
        self.buckets: list[torch.Tensor] = []
        for numel, dtype in self.layout:
            if dtype not in DTYPE_CODES:
                raise ValueError(f"dtype {dtype} cannot be shared with an island")
            if device.type == "cuda":
                self.buckets.append(torch.zeros(numel, dtype=dtype, device=device))
                continue
            _sweep_once(_shm_dir())  # once per process: what killed peers left behind
            path = os.path.join(_shm_dir(), f"gossipnet-{os.getpid()}-{secrets.token_hex(6)}")
            self.paths.append(path)
            self.buckets.append(torch.from_file(path, shared=True, size=numel, dtype=dtype))
        # a normal exit or garbage collection removes them; a killed process's files
        # are removed by the next process on this machine that shares buckets
        # (sweep_stale)
        weakref.finalize(self, _unlink_all, list(self.paths))

    def handles(self) -> bytes:
        """A picklable description that :func:`open_handles` maps in another process."""
        out: list[tuple[Any, ...]] = []
        for t, path in zip(self.buckets, self.paths or [""] * len(self.buckets), strict=True):
            code = DTYPE_CODES[t.dtype]
            if t.device.type != "cuda":
                out.append(("file", path, t.numel(), code))
                continue
            from torch.multiprocessing.reductions import reduce_tensor

            _, args = reduce_tensor(t)
            # args: tensor_cls, size, stride, offset, storage_cls, dtype, device, handle,
            # size_bytes, offset_bytes, requires_grad, rc_handle, rc_offset, ev_handle, ev_sync
            plain = (list(args[1]), list(args[2]), int(args[3]), code, int(args[6]), *args[7:])
            out.append(("cuda", *plain))
        return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


class _PlainUnpickler(pickle.Unpickler):
    """Loads plain values only; any class or function reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"island handles hold plain values; got {module}.{name}")


def load_handles(data: bytes) -> list[tuple[Any, ...]]:
    """Parse a handle payload; raises ``ValueError`` on anything malformed."""
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as err:
        raise ValueError(f"bad island handle payload: {err}") from err
    if not isinstance(obj, list) or not all(isinstance(h, tuple) and h for h in obj):
        raise ValueError("bad island handle payload: not a list of tuples")
    return obj


def open_handles(
    handles: Sequence[tuple[Any, ...]], layout: Sequence[tuple[int, torch.dtype]]
) -> list[torch.Tensor]:
    """Map another process's buckets into this one; they must match ``layout``.

    Raises:
        ValueError: a handle of another layout, an unknown kind, or a file that is gone.
    """
    if len(handles) != len(layout):
        raise ValueError(f"{len(handles)} shared buckets for a layout of {len(layout)}")
    out = []
    for h, (numel, dtype) in zip(handles, layout, strict=True):
        if h[0] == "file" and len(h) == 4:
            _, path, n, code = h
            if n != numel or DTYPES.get(code) != dtype or not isinstance(path, str):
                raise ValueError(f"shared bucket {path!r} is {n} x {code}, expected {numel}")
            out.append(_map_file(path, numel, dtype))
        elif h[0] == "cuda" and len(h) == 14:
            size, stride, offset, code, device, *rest = h[1:]
            if DTYPES.get(code) != dtype or torch.Size(size).numel() != numel:
                raise ValueError(f"shared CUDA bucket is {size} x {code}, expected {numel}")
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            t = rebuild_cuda_tensor(
                torch.Tensor, torch.Size(size), tuple(stride), offset,
                torch.storage.TypedStorage, dtype, device, *rest,
            )  # fmt: skip
            out.append(t)
        else:
            raise ValueError(f"unknown shared bucket handle kind {h[0]!r}")
    return out


def _map_file(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Map one bucket file of another process of ours; see the module docstring.

    Raises:
        ValueError: a name outside the shared-memory directory or not ours, a link,
            not a regular file, another owner, writable by others, or a wrong size.
    """
    directory, name = os.path.split(path)
    if directory != _shm_dir() or not _NAME.fullmatch(name):
        raise ValueError(f"shared bucket {path!r} is not a gossipnet file in {_shm_dir()}")
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:  # gone, or a symlink (ELOOP)
        raise ValueError(f"shared bucket file {path!r} cannot be opened: {err}") from err
    try:
        st = os.fstat(fd)
        bad = (
            "not a regular file" if not stat.S_ISREG(st.st_mode)
            else f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid()
            else f"mode {st.st_mode & 0o777:o}" if st.st_mode & 0o022
            else f"{st.st_size} B" if st.st_size != numel * dtype.itemsize
            else None
        )  # fmt: skip
        if bad is not None:
            raise ValueError(f"shared bucket file {path!r} refused: {bad}")
        via_fd = f"/proc/self/fd/{fd}"
        if os.path.exists(via_fd):  # the file we checked, not whatever the name is now
            return torch.from_file(via_fd, shared=True, size=numel, dtype=dtype)
        if not os.path.samestat(st, os.stat(path, follow_symlinks=False)):
            raise ValueError(f"shared bucket file {path!r} changed while opened")
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(fd)
