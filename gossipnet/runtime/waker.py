"""A flag one coroutine waits on, with a deadline, without a task per wait.

Why not ``asyncio.Event`` and :func:`~gossipnet.runtime.reliable.wait_future`:
a phase of a collective round waits once per arrival that may change its
decision (a sender's first packet, its END), and each of those waits built an
``Event.wait()`` task, a sleeper task and ``asyncio.wait``'s own future and
callbacks: about 1/6 of the Python calls of a 1M-element loopback
all-reduce.  Here a wait is one future and one timer callback on the
injected clock (so a :class:`~gossipnet.clock.FakeClock` still moves it).
"""

from __future__ import annotations

import asyncio

from gossipnet.clock import Clock

__all__ = ("Waker",)


class Waker:
    """``set()`` wakes whoever waits in :meth:`wait`; ``clear()`` re-arms.

    Like ``asyncio.Event`` (set/clear/is_set), used from the loop thread only,
    with at most one waiter at a time (the coroutine that owns the phase).
    """

    __slots__ = ("_flag", "_gate")

    def __init__(self) -> None:
        self._flag = False
        self._gate: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._flag = True
        gate = self._gate
        if gate is not None and not gate.done():
            gate.set_result(None)

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    async def wait(self, clock: Clock, timeout_s: float) -> bool:
        """Until set or ``timeout_s`` passed on ``clock``; True if set.

        Returns at once when already set.  A second concurrent waiter is a bug
        (it would leave the first asleep until its timeout): RuntimeError.
        """
        if self._flag:
            return True
        if self._gate is not None:
            raise RuntimeError("Waker already has a waiter")
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def open_gate() -> None:
            if not gate.done():
                gate.set_result(None)

        self._gate = gate
        timer = clock.call_later(max(0.0, timeout_s), open_gate)
        try:
            await gate
        finally:
            timer.cancel()
            self._gate = None
        return self._flag
