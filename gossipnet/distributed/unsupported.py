"""The ``torch.distributed`` calls the gossipnet backend does not offer, each a clear error.

Why a mixin of its own: a Python process group that leaves a call to the C++ base gets
"No backend type associated with device type cpu", which names neither the call nor
what to do; each method here raises :class:`UnsupportedError` naming both.  Kept apart
so that ``process_group.py`` holds only what the backend does.
"""

from __future__ import annotations

from typing import Any, NoReturn

from gossipnet.distributed.tensors import UnsupportedError

__all__ = ("UnsupportedCalls",)

_SUPPORTED = (
    "allreduce, broadcast, allgather, all_gather_into_tensor, reduce_scatter,"
    " reduce_scatter_tensor, barrier"
)


class UnsupportedCalls:
    """Every collective the backend does not run, raising an error that names it."""

    def _unsupported(self, call: str) -> UnsupportedError:
        return UnsupportedError(
            f"gossipnet backend: torch.distributed {call} is not supported (supported:"
            f" {_SUPPORTED}); run it on a gloo group: dist.new_group(backend='gloo')"
        )

    def alltoall(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("all_to_all")

    def alltoall_base(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("all_to_all_single")

    def send(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("send")

    def recv(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("recv")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("recv (any source)")

    def gather(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("gather")

    def scatter(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("scatter")

    def reduce(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("reduce")

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("all_reduce_coalesced")

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("all_gather_coalesced")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise self._unsupported("monitored_barrier (use barrier)")
