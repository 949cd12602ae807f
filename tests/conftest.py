"""Shared test helpers, exposed as fixtures (no pytest-asyncio).

- ``run_async(coro)``: run one test coroutine on a fresh loop (``asyncio.run``,
  debug mode) under a wall-clock bound, so a hang fails fast with a message.
- ``wait_until(pred, timeout_s, clock=...)``: wait for a condition with a
  deadline.  Under a :class:`~gossipnet.FakeClock` it advances virtual time in
  small steps, each only once the loop has nothing left to run (trio's
  "autojump" idea), so a 3 s failure timeout costs milliseconds and the run
  replays exactly; under real time it polls the predicate.
- ``drive(clock, awaitable)``: await something that needs virtual time to pass
  (a round with lossy phases, ``send_reliable`` retries).
- ``start_node`` / ``cluster``: started :class:`~gossipnet.runtime.node.Node` s on a
  :class:`~gossipnet.testing.MemoryNetwork`, named ``p0..pN-1`` at ``mem://p<i>``.
- ``wait_until_sync`` / ``free_tcp_port`` / ``free_tcp_ports``: for the
  thread-based integration tests on real sockets.

Time limits (``pytest.mark.timeout``, pyproject's default of 60 s, the deadlines
tests pass to their own waits) bound a hang, never speed: each is at least ~10x
what the test takes on 2 idle cores, and says why where it is set.  A CPU-bound
test runs ~5x slower at a load of 8 on 2 cores (measured: the drift test 9 s idle,
42 s at a load of 9, 58 s at 12), and CI machines are shared.  Protocol timeouts
(``collective_timeout_s``, ``failure_timeout_s`` ...) that a test sets short must be
ones its assertion needs short; elsewhere a starved peer thread would miss them
and be cut from a round or declared dead, which is not what the test measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import pytest

from gossipnet import Config, FakeClock, FaultPlan
from gossipnet.clock import Clock
from gossipnet.runtime.node import Node
from gossipnet.testing import MemoryNetwork

T = TypeVar("T")

#: Wall-clock bound of one ``run_async`` call, a hang bound (virtual time costs
#: nothing): the slowest test that keeps this default takes ~3 s on 2 idle cores,
#: 17 s at a load of 12 (``test_bursty_loss_does_not_stall_rounds``).
RUN_TIMEOUT_S = 120.0
#: Default virtual step of ``wait_until`` / ``drive`` under a FakeClock.
STEP_S = 0.005
#: Yields at most per step while the loop still has ready callbacks.
_MAX_SPINS = 200

#: Fast membership for unit tests (the brief's numbers): a crash is seen in ~0.55 s.
FAST = {
    "heartbeat_interval_s": 0.05,
    "failure_timeout_s": 0.5,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 5.0,
    "collective_timeout_s": 2.0,
}


def _run_async(coro: Coroutine[Any, Any, T], timeout_s: float = RUN_TIMEOUT_S) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded(), debug=True)


async def _settle() -> None:
    """Yield until no callback is ready (memory-network deliveries, task steps).

    ``loop._ready`` is asyncio's private ready queue; without it we fall back
    to a fixed number of yields, which is still deterministic.
    """
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)
    for _ in range(_MAX_SPINS if ready is not None else 32):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return


async def _wait_until(
    pred: Callable[[], bool],
    timeout_s: float,
    *,
    clock: Clock | None = None,
    step_s: float = STEP_S,
    what: str = "condition",
) -> float:
    """Wait until ``pred()``; return the (virtual or real) seconds it took.

    Raises:
        AssertionError: ``pred`` still false after ``timeout_s``.
    """
    if isinstance(clock, FakeClock):
        t0 = clock.now()
        while True:
            await _settle()
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


async def _drive(
    clock: Clock | None,
    aw: Awaitable[T],
    *,
    timeout_s: float = 20.0,
    step_s: float = STEP_S,
) -> T:
    """Await ``aw`` while virtual time advances whenever the loop is idle.

    Under a real clock this is ``asyncio.wait_for(aw, timeout_s)``.
    """
    if not isinstance(clock, FakeClock):
        return await asyncio.wait_for(aw, timeout_s)
    task = asyncio.ensure_future(aw)
    t0 = clock.now()
    try:
        while True:
            await _settle()
            if task.done():
                return task.result()
            if clock.now() - t0 >= timeout_s:
                raise AssertionError(f"did not finish within {timeout_s} s (virtual)")
            clock.advance(step_s)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _start_node(
    network: MemoryNetwork,
    name: str,
    *,
    config: Config,
    clock: Clock | None = None,
    faults: FaultPlan | None = None,
    bootstrap: Sequence[str] = (),
    secret: bytes | None = b"test-secret",
) -> Node:
    """One started node ``name`` listening on ``mem://<name>``."""
    node = Node(
        config=config,
        listen=f"mem://{name}",
        peer_id=name,
        secret=secret,
        bootstrap=bootstrap,
        clock=clock,
        faults=faults,
        network=network,
    )
    await node.start()
    return node


@contextlib.asynccontextmanager
async def _cluster(
    n: int,
    *,
    config: Config,
    clock: Clock | None = None,
    faults: FaultPlan | Callable[[int], FaultPlan | None] | None = None,
    bootstrap: Callable[[int, list[str]], Sequence[str]] | None = None,
    network: MemoryNetwork | None = None,
    discover: bool = True,
    timeout_s: float = 5.0,
) -> AsyncIterator[list[Node]]:
    """``n`` started nodes ``p0..`` that bootstrap from everyone (by default).

    With ``discover`` it waits until every node sees all ``n`` alive.  Nodes are
    closed without announcing on exit (a test that wants LEAVE closes them itself).
    """
    network = network or MemoryNetwork()
    addresses = [f"mem://p{i}" for i in range(n)]
    nodes: list[Node] = []
    try:
        for i in range(n):
            plan = faults(i) if callable(faults) else faults
            boot = bootstrap(i, addresses) if bootstrap is not None else addresses
            nodes.append(
                await _start_node(
                    network, f"p{i}", config=config, clock=clock, faults=plan, bootstrap=boot
                )
            )
        if discover:
            await _wait_until(
                lambda: all(len(x.alive_peers()) == n for x in nodes),
                timeout_s,
                clock=clock,
                what=f"all {n} nodes alive everywhere",
            )
        yield nodes
    finally:
        for node in nodes:
            await node.close(announce=False)


def _wait_until_sync(
    pred: Callable[[], bool], timeout_s: float, *, interval_s: float = 0.01, what: str = "condition"
) -> float:
    """Thread-side ``wait_until``: poll ``pred`` until true; seconds it took."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 >= timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - t0


def _free_tcp_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (held open together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def run_async() -> Callable[..., Any]:
    return _run_async


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[float]]:
    return _wait_until


@pytest.fixture
def drive() -> Callable[..., Awaitable[Any]]:
    return _drive


@pytest.fixture
def start_node() -> Callable[..., Awaitable[Node]]:
    return _start_node


@pytest.fixture
def cluster() -> Callable[..., contextlib.AbstractAsyncContextManager[list[Node]]]:
    return _cluster


@pytest.fixture
def fast_config() -> Config:
    """Fast heartbeats and timeouts for memory-network tests (``run`` left default)."""
    return Config(**FAST)


@pytest.fixture
def wait_until_sync() -> Callable[..., float]:
    return _wait_until_sync


@pytest.fixture
def free_tcp_ports() -> Callable[[int], list[int]]:
    return _free_tcp_ports
