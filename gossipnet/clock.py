"""Injected time.

Every deadline in gossipnet reads an injected :class:`Clock` rather than
``time.time()`` or a bare ``asyncio.sleep``, so fault tests can run a 30 s
timeout in 0 s under :class:`FakeClock` and replay exactly.  Timers are
callbacks (``call_later``) so that the per-packet paths (delays, bandwidth
shaping) stay synchronous and allocate no task per packet.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ("Clock", "FakeClock", "MonotonicClock", "TimerHandle")


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


@runtime_checkable
class Clock(Protocol):
    """Monotonic seconds plus timers; used only from the event-loop thread."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> TimerHandle: ...


class MonotonicClock:
    """Real time: ``time.monotonic`` and the running loop's timers."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)


class _FakeTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Virtual time that moves only when told to.

    ``advance(dt)`` fires due timers in time order and wakes sleepers, so a
    test decides exactly when deadlines pass.  ``run_until(pred, step)`` is a
    helper that advances in steps, letting the loop run between steps.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, _FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _FakeTimer(self._now + max(0.0, delay_s), callback)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        handle = self.call_later(seconds, wake)
        try:
            await fut
        finally:
            handle.cancel()

    def advance(self, dt: float) -> None:
        """Move time forward by ``dt`` seconds, firing timers that fall due."""
        if dt < 0:
            raise ValueError("time only moves forward")
        target = self._now + dt
        while self._heap and self._heap[0][0] <= target:
            when, _, timer = heapq.heappop(self._heap)
            self._now = max(self._now, when)
            if not timer.cancelled:
                timer.callback()
        self._now = target

    def next_deadline(self) -> float | None:
        """Time of the earliest pending timer, or None."""
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    async def run_for(self, seconds: float, step_s: float = 0.001) -> None:
        """Advance ``seconds`` in steps, yielding to the loop between steps."""
        end = self._now + seconds
        while self._now < end:
            self.advance(min(step_s, end - self._now))
            for _ in range(3):
                await asyncio.sleep(0)
