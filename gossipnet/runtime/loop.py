"""The one event-loop thread per peer, and blocking calls into it.

Why a thread: the training loop is synchronous PyTorch code and must not
know about asyncio; the network must keep answering heartbeats while the
trainer computes.  One daemon thread runs the loop (uvloop when installed
and enabled); the trainer calls :meth:`LoopThread.call` which submits a
coroutine with ``run_coroutine_threadsafe`` and waits with a timeout,
cancelling the coroutine on expiry.  Calling from the loop thread itself
would deadlock, so it raises instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from gossipnet.errors import ClosedError
from gossipnet.runtime._threads import limit_intraop_threads

__all__ = ("LoopThread",)

log = logging.getLogger(__name__)
T = TypeVar("T")


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """Owns an event loop running in a named daemon thread."""

    def __init__(self, name: str, *, use_uvloop: bool = True) -> None:
        self._loop = _new_loop(use_uvloop)
        self._ready = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _run(self) -> None:
        limit_intraop_threads(1)  # this thread's chunk arithmetic stays on this thread
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self._loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Raises:
            RuntimeError: when called from the loop thread (it would deadlock).
            ClosedError: when the loop was stopped.
            TimeoutError: when ``timeout_s`` passes; the coroutine is cancelled.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                "gossipnet's blocking API was called from its own event-loop thread; "
                "use the async API there"
            )
        if self._closed:
            coro.close()
            raise ClosedError("this peer was closed; call gossipnet.join() again")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"gossipnet call did not finish within {timeout_s} s") from None
        except concurrent.futures.CancelledError:
            raise ClosedError("the call was cancelled because the peer closed") from None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and join the thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if not self.in_loop_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning(
                    "event-loop thread %s did not stop in %.1f s", self._thread.name, timeout_s
                )
