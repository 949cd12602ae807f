"""Virtual time for tests: an event loop that knows when every task waits.

A fault test must replay exactly and a 30 s failure timeout must cost nothing.
Code under test reads an injected :class:`~gossipnet.clock.FakeClock`, so time
moves only when the test moves it; the question is *when* it may move.  Trio's
answer (``trio.testing.MockClock``, autojump) is: once every task is blocked.
This module gives asyncio the same answer without reading its private state.

How: :func:`new_event_loop` builds a plain :class:`asyncio.SelectorEventLoop`
around a selector of ours.  The loop asks its selector to wait with a timeout of
0 while callbacks are ready and with a longer (or no) timeout only when nothing
is left to run: that call is the loop's own report that it is idle.  Our
selector then first polls the real sockets (an event means not idle), and if
none is ready it wakes the tasks waiting in :func:`settle`, or (inside
:func:`autojump`) moves the fake clock to its next timer.  Only public asyncio
API is used (``SelectorEventLoop(selector)``, ``asyncio.Runner(loop_factory=)``);
``tests/unit/test_virtual_time.py`` fails loudly should asyncio stop reporting
idleness this way.

Use it with :func:`run` (like :func:`asyncio.run`) or pass :func:`new_event_loop`
as the loop factory of your own runner (``asyncio.Runner(loop_factory=...)``).
Example::

    clock = FakeClock()
    async def main() -> None:
        node = ...  # built with clock=clock
        await wait_until(lambda: node.alive_peers() == ["a", "b"], 5.0, clock=clock)
    gossipnet.testing.run(main())
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar

from gossipnet.clock import Clock, FakeClock

__all__ = (
    "RUN_TIMEOUT_S",
    "STEP_S",
    "autojump",
    "drive",
    "new_event_loop",
    "run",
    "settle",
    "wait_until",
)

T = TypeVar("T")

#: Default wall-clock bound of :func:`run`: a bound on a hang, never on speed.
RUN_TIMEOUT_S = 120.0
#: Default virtual step of :func:`wait_until` and :func:`drive` under a FakeClock.
STEP_S = 0.005
#: Loop iterations :func:`settle` waits at most while some task never stops running.
MAX_SPINS = 200


class _IdleSelector(selectors.BaseSelector):
    """A selector that turns the loop's "nothing to run" wait into idle events.

    Why a selector: it is the one object an asyncio loop consults on every
    iteration, through public API, with the very fact we need (the timeout is 0
    exactly while callbacks are ready).
    """

    def __init__(self, inner: selectors.BaseSelector) -> None:
        self._inner = inner
        self._waiters: list[tuple[asyncio.Future[None], int]] = []
        self._clock: FakeClock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.idle_reports = 0  # times the loop reported idle (read by the kit's tests)

    # -- the selector interface, delegated ---------------------------------------
    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:  # callbacks are ready: busy
            self._count_busy_iteration()
            return self._inner.select(timeout)
        events = self._inner.select(0)
        if events:
            return events
        self.idle_reports += 1
        if self._wake_waiters() or self._jump():
            return []
        return self._inner.select(timeout)

    # -- idle handling ------------------------------------------------------------
    def wait_idle(self, loop: asyncio.AbstractEventLoop, max_spins: int) -> asyncio.Future[None]:
        fut = loop.create_future()
        self._waiters.append((fut, max_spins))
        return fut

    def _count_busy_iteration(self) -> None:
        if not self._waiters:
            return
        left = []
        for fut, spins in self._waiters:
            if spins <= 1:
                _resolve(fut)
            else:
                left.append((fut, spins - 1))
        self._waiters = left

    def _wake_waiters(self) -> bool:
        woke = False
        waiters, self._waiters = self._waiters, []
        for fut, _ in waiters:
            woke = _resolve(fut) or woke
        return woke

    def _jump(self) -> bool:
        clock = self._clock
        if clock is None:
            return False
        deadline = clock.next_deadline()
        if deadline is None:
            return False
        try:
            clock.advance(max(0.0, deadline - clock.now()))
        except Exception as err:  # a timer callback failed: report it, keep the loop alive
            if self._loop is not None:
                self._loop.call_exception_handler(
                    {"message": "FakeClock timer failed under autojump", "exception": err}
                )
        return True


def _resolve(fut: asyncio.Future[None]) -> bool:
    if fut.done():
        return False
    fut.set_result(None)
    return True


_SELECTORS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _IdleSelector] = (
    weakref.WeakKeyDictionary()
)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new asyncio loop on which :func:`settle` and :func:`autojump` work.

    It is an ordinary :class:`asyncio.SelectorEventLoop` (sockets, subprocesses and
    signals as usual), so it can serve as the loop factory of any runner.

    Returns:
        The loop, not running and not set as the current loop.
    """
    selector = _IdleSelector(selectors.DefaultSelector())
    loop = asyncio.SelectorEventLoop(selector)
    selector._loop = loop
    _SELECTORS[loop] = selector
    return loop


def _selector() -> _IdleSelector:
    loop = asyncio.get_running_loop()
    selector = _SELECTORS.get(loop)
    if selector is None:
        raise RuntimeError(
            "this needs an event loop from gossipnet.testing.new_event_loop(); run the "
            "test with gossipnet.testing.run(...) or asyncio.Runner(loop_factory=new_event_loop)"
        )
    return selector


def run(main: Coroutine[Any, Any, T], *, timeout_s: float = RUN_TIMEOUT_S, debug: bool = True) -> T:
    """Run ``main`` on a fresh :func:`new_event_loop` loop, like :func:`asyncio.run`.

    Why a wall-clock bound: a test that hangs should fail fast with a message,
    not wait for the test runner's own timeout.  Debug mode is on by default
    because it reports never-awaited coroutines and callbacks from other threads.

    Args:
        main: the coroutine to run.
        timeout_s: wall-clock seconds after which ``main`` is cancelled.
        debug: asyncio debug mode.

    Returns:
        ``main``'s result.

    Raises:
        TimeoutError: ``main`` ran longer than ``timeout_s``.
    """

    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await main

    with asyncio.Runner(debug=debug, loop_factory=new_event_loop) as runner:
        return runner.run(bounded())


async def settle(*, max_spins: int = MAX_SPINS) -> None:
    """Return once every other task waits (no callback ready, no socket readable).

    Why a bound: a task that reschedules itself forever (``sleep(0)`` in a loop)
    never lets the loop go idle; after ``max_spins`` loop iterations this returns
    anyway, which is still deterministic.

    Raises:
        RuntimeError: the running loop was not made by :func:`new_event_loop`.
    """
    selector = _selector()
    await selector.wait_idle(asyncio.get_running_loop(), max_spins)


@contextlib.contextmanager
def autojump(clock: FakeClock) -> Iterator[FakeClock]:
    """While inside, jump ``clock`` to its next timer whenever every task waits.

    This is trio's autojump clock for asyncio: ``await clock.sleep(30)`` returns at
    once, at virtual time +30 s, and timers fire in their exact order.  Must be
    entered on the running :func:`new_event_loop` loop; one clock per loop.

    Raises:
        RuntimeError: not on such a loop, or another clock already jumps on it.
    """
    selector = _selector()
    if selector._clock is not None:
        raise RuntimeError("another FakeClock already autojumps on this loop")
    selector._clock = clock
    try:
        yield clock
    finally:
        selector._clock = None


async def wait_until(
    pred: Callable[[], bool],
    timeout_s: float,
    *,
    clock: Clock | None = None,
    step_s: float = STEP_S,
    what: str = "condition",
) -> float:
    """Wait until ``pred()`` holds; the (virtual or real) seconds it took.

    Under a :class:`FakeClock` time advances by ``step_s`` only after the loop
    settled, so the run is exact and a 3 s deadline costs milliseconds; under
    any other clock it polls every ``step_s`` real seconds.

    Raises:
        AssertionError: ``pred`` still false after ``timeout_s``; names ``what``.
    """
    if isinstance(clock, FakeClock):
        t0 = clock.now()
        while True:
            await settle()
            if pred():
                return clock.now() - t0
            if clock.now() - t0 >= timeout_s:
                raise AssertionError(f"{what} not reached within {timeout_s} s (virtual)")
            clock.advance(step_s)
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 >= timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(step_s)
    return time.monotonic() - t0


async def drive(
    clock: Clock | None,
    aw: Awaitable[T],
    *,
    timeout_s: float = 20.0,
    step_s: float = STEP_S,
) -> T:
    """Await ``aw`` while virtual time advances by ``step_s`` whenever the loop settles.

    For awaitables that need time to pass (a round with lossy phases, retries).
    Under a clock that is not a :class:`FakeClock` this is ``asyncio.wait_for``.

    Raises:
        AssertionError: not done within ``timeout_s`` virtual seconds (``aw`` is
            then cancelled).
        TimeoutError: not done within ``timeout_s`` real seconds.
    """
    if not isinstance(clock, FakeClock):
        return await asyncio.wait_for(aw, timeout_s)
    task = asyncio.ensure_future(aw)
    t0 = clock.now()
    try:
        while True:
            await settle()
            if task.done():
                return task.result()
            if clock.now() - t0 >= timeout_s:
                raise AssertionError(f"did not finish within {timeout_s} s (virtual)")
            clock.advance(step_s)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
