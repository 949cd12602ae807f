"""The backend's :class:`torch.distributed.Work`: completed from the event-loop thread.

Every collective of the backend runs as a coroutine on the peer's loop thread and
returns at once with a :class:`GossipWork`.  The coroutine finishes the work there
(:meth:`GossipWork.complete` / :meth:`GossipWork.fail`), which wakes a caller blocked
in :meth:`GossipWork.wait` and completes the :class:`torch.futures.Future` that DDP's
reducer and comm hooks chain on (their callbacks then run on the loop thread, as
they run on gloo's worker threads).

Why a ``threading.Event`` beside the future: ``Future.wait()`` takes no timeout, and
users expect ``work.wait(timeout)`` to raise when the deadline passes (gloo raises
``DistBackendError``), not to block for ever on a collective that a dead peer stalls.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ("GossipWork",)


class GossipWork(dist.Work):
    """One collective in flight.

    Args:
        op: the collective's name (in error messages).
        default_timeout_s: what ``wait()`` without a timeout waits (the group's timeout).
    """

    def __init__(self, op: str, default_timeout_s: float) -> None:
        super().__init__()
        self.op = op
        self.default_timeout_s = default_timeout_s
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._value: Any = None

    # ------------------------------------------------------------ the loop thread's side
    def complete(self, value: Any) -> None:
        """The collective finished: ``value`` is the future's result (a tensor list)."""
        self._value = value
        self._done.set()
        self._future.set_result(value)

    def fail(self, error: BaseException) -> None:
        """The collective failed: ``wait()`` and the future raise ``error``."""
        self._error = error
        self._done.set()
        self._future.set_exception(error)

    # ------------------------------------------------------------ the user's side
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until done; True.  ``timeout`` 0 means the group's timeout.

        Raises:
            torch.distributed.DistBackendError: not done within the timeout (the
                collective goes on in the background), or the collective failed
                (the cause is chained).
        """
        seconds = timeout.total_seconds() if timeout else 0.0
        seconds = seconds if seconds > 0 else self.default_timeout_s
        if not self._done.wait(seconds):
            raise dist.DistBackendError(
                f"gossipnet: {self.op} did not complete within {seconds:g} s (Work.wait"
                " timeout); a peer may be stalled or the network partitioned"
            )
        if self._error is not None:
            raise dist.DistBackendError(f"gossipnet: {self.op} failed: {self._error}") from (
                self._error
            )
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """The future DDP's comm hooks chain on; its value is the output tensor list."""
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._value

    def synchronize(self) -> None:
        """Nothing to order on a stream: CPU results are written before completion."""
