"""The virtual-time loop knows when every task waits, through public asyncio API only.

``gossipnet.testing.virtual_time`` learns that the loop is idle from the timeout
asyncio passes its selector (0 while callbacks are ready).  These tests fail
loudly should a future asyncio stop behaving that way: :func:`settle` would then
return too early (a callback chain still running) or never (the test times out).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gossipnet.clock import FakeClock
from gossipnet.testing import autojump, drive, new_event_loop, run, settle, virtual_time, wait_until

pytestmark = pytest.mark.timeout(30)


def test_settle_returns_only_after_every_ready_callback_and_task_step() -> None:
    """A chain of call_soon callbacks and a task yielding 50 times both finish first."""

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        hops = [0]
        steps = [0]

        def hop() -> None:
            hops[0] += 1
            if hops[0] < 100:
                loop.call_soon(hop)

        async def stepper() -> None:
            for _ in range(50):
                steps[0] += 1
                await asyncio.sleep(0)

        loop.call_soon(hop)
        task = asyncio.create_task(stepper())
        await settle()
        done = (hops[0], steps[0])
        await task
        return done

    assert run(main()) == (100, 50)


def test_settle_is_bounded_when_a_task_never_waits() -> None:
    """A task that reschedules itself forever does not hang settle()."""

    async def main() -> None:
        async def spin() -> None:
            while True:  # noqa: ASYNC110 - a task that never waits, on purpose
                await asyncio.sleep(0)

        task = asyncio.create_task(spin())
        await settle(max_spins=10)
        task.cancel()

    run(main(), timeout_s=5)


def test_the_loop_reports_idle_to_its_selector() -> None:
    """The public mechanism itself: asyncio waits with a non-zero timeout when idle."""
    loop = new_event_loop()
    try:
        selector = virtual_time._SELECTORS[loop]  # the kit's own record, not asyncio's
        before = selector.idle_reports
        loop.run_until_complete(asyncio.sleep(0.001))
        assert selector.idle_reports > before
    finally:
        loop.close()


def test_autojump_makes_a_long_sleep_free_and_exact() -> None:
    clock = FakeClock()
    order: list[float] = []

    async def sleeper(seconds: float) -> None:
        await clock.sleep(seconds)
        order.append(clock.now())

    async def main() -> None:
        with autojump(clock):
            await asyncio.gather(sleeper(30.0), sleeper(0.5), sleeper(7.25))

    started = time.monotonic()
    run(main())
    assert order == [0.5, 7.25, 30.0]
    assert time.monotonic() - started < 5.0  # 30 virtual seconds, no real waiting


def test_autojump_refuses_a_second_clock_and_needs_the_kit_loop() -> None:
    async def main() -> None:
        with (
            autojump(FakeClock()),
            pytest.raises(RuntimeError, match="already"),
            autojump(FakeClock()),
        ):
            pass

    run(main())
    with pytest.raises(RuntimeError, match="new_event_loop"):
        asyncio.run(settle())


def test_wait_until_and_drive_advance_virtual_time_in_steps() -> None:
    clock = FakeClock()

    async def main() -> tuple[float, str]:
        took = await wait_until(lambda: clock.now() >= 1.0, 5.0, clock=clock, step_s=0.25)

        async def later() -> str:
            await clock.sleep(2.0)
            return "done"

        return took, await drive(clock, later(), timeout_s=3.0)

    took, result = run(main())
    assert took == pytest.approx(1.0)
    assert result == "done"


def test_wait_until_names_what_it_waited_for() -> None:
    async def main() -> None:
        await wait_until(lambda: False, 0.1, clock=FakeClock(), what="the impossible")

    with pytest.raises(AssertionError, match=r"the impossible not reached within 0\.1 s"):
        run(main())
