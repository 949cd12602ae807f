"""The task-free waits of the lossy phases (``Waker``) and ``wait_future``.

Both run on an injected clock: a FakeClock decides exactly when a timeout
passes, so each assertion below could fail if a wake-up were lost or a timer
leaked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gossipnet.clock import FakeClock
from gossipnet.runtime.reliable import wait_future
from gossipnet.runtime.waker import Waker


async def _spin(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.timeout(10)
def test_a_set_before_the_wait_returns_at_once_and_a_clear_rearms(
    run_async: Callable[..., Any],
) -> None:
    async def main() -> None:
        clock, w = FakeClock(), Waker()
        w.set()
        assert await w.wait(clock, 5.0) is True  # no time passes: it was set
        assert clock.now() == 0.0
        w.clear()
        assert not w.is_set()
        task = asyncio.ensure_future(w.wait(clock, 5.0))
        await _spin()
        assert not task.done()  # cleared: it waits
        clock.advance(4.9)
        await _spin()
        assert not task.done()
        clock.advance(0.2)  # the timeout passes on the injected clock
        await _spin()
        assert task.result() is False
        assert clock.next_deadline() is None  # its timer is gone

    run_async(main())


@pytest.mark.timeout(10)
def test_set_wakes_the_waiter_and_cancels_its_timer(run_async: Callable[..., Any]) -> None:
    async def main() -> None:
        clock, w = FakeClock(), Waker()
        task = asyncio.ensure_future(w.wait(clock, 30.0))
        await _spin()
        with pytest.raises(RuntimeError):  # one waiter at a time: a second is a bug
            await w.wait(clock, 1.0)
        w.set()
        await _spin()
        assert task.result() is True
        assert clock.next_deadline() is None
        # a waiter cancelled mid-wait leaves no gate behind: the next wait works
        w.clear()
        task = asyncio.ensure_future(w.wait(clock, 30.0))
        await _spin()
        task.cancel()
        await _spin()
        assert task.cancelled()
        again = asyncio.ensure_future(w.wait(clock, 30.0))
        await _spin()
        w.set()
        await _spin()
        assert again.result() is True

    run_async(main())


@pytest.mark.timeout(10)
def test_wait_future_times_out_on_the_clock_and_leaves_no_callback(
    run_async: Callable[..., Any],
) -> None:
    async def main() -> None:
        clock = FakeClock()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(wait_future(clock, fut, 2.0))
        await _spin()
        clock.advance(2.5)
        await _spin()
        with pytest.raises(TimeoutError):
            waiter.result()
        assert not fut.done()  # left running, as documented
        # the done-callback was removed: resolving fut later touches no stale gate
        fut.set_result(7)
        await _spin()
        # and a future that resolves in time wakes the waiter before its timeout
        fut2: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter2 = asyncio.ensure_future(wait_future(clock, fut2, 60.0))
        await _spin()
        fut2.set_result(1)
        await _spin()
        assert waiter2.done()
        assert waiter2.exception() is None
        assert clock.next_deadline() is None

    run_async(main())
