"""One intra-op thread for the tensor work on gossipnet's event-loop thread.

Why: the loop thread sums, adds and copies packet-sized chunks (up to 4 MiB)
between network events.  PyTorch's OpenMP pool would split each of those over
every core: on a machine whose cores are busy (the trainer's own kernels, or
more peer processes than cores) the loop thread then waits for pool threads
that are not running, and every op costs two thread wake-ups.  A
communication thread's arithmetic stays on that thread, as gloo's does.

OpenMP keeps the thread count per calling thread, so setting it here leaves
the caller's thread (the training loop) and every other thread as they were.
PyTorch reads it through ``omp_get_max_threads()`` after initialising each
thread once, so the order matters: let PyTorch initialise this thread first,
then lower the count.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ("limit_intraop_threads",)

_log = logging.getLogger(__name__)
_OPENMP_LIBS = ("libgomp", "libiomp5", "libomp")


def _loaded_openmp() -> list[ctypes.CDLL]:
    """The OpenMP runtimes this process already loaded (PyTorch's among them)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:  # not Linux
        return []
    libs = []
    for path in sorted(paths):
        if path.rsplit("/", 1)[-1].startswith(_OPENMP_LIBS):
            try:
                lib = ctypes.CDLL(path)  # already loaded: the same handle, no new copy
            except OSError:
                continue
            if hasattr(lib, "omp_set_num_threads"):
                libs.append(lib)
    return libs


def limit_intraop_threads(n: int) -> bool:
    """Let PyTorch kernels called from this thread use ``n`` threads; True if in force."""
    import torch

    torch.ones(1 << 16).sum()  # PyTorch's per-thread set-up runs on a thread's first kernel
    if torch.get_num_threads() <= n:
        return True
    # another library (MKL, a numpy build) may have brought its own runtime: set the
    # count in each until PyTorch's reads it
    for lib in _loaded_openmp():
        lib.omp_set_num_threads(ctypes.c_int(n))
        if torch.get_num_threads() == n:
            return True
    _log.debug("no OpenMP runtime PyTorch uses was found; the loop thread keeps its threads")
    return False
