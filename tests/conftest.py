"""Shared test helpers, exposed as fixtures (no pytest-asyncio).

The helpers themselves are the public kit, :mod:`gossipnet.testing`
(``virtual_time`` and ``cluster``); these fixtures only hand them to tests.

- ``run_async(coro)``: run one test coroutine on a fresh loop (``asyncio.run``,
  debug mode) under a wall-clock bound, so a hang fails fast with a message.
- ``wait_until(pred, timeout_s, clock=...)``: wait for a condition with a
  deadline.  Under a :class:`~gossipnet.FakeClock` it advances virtual time in
  small steps, each only once the loop has nothing left to run (trio's
  "autojump" idea; the loop itself reports idleness, see
  :mod:`gossipnet.testing.virtual_time`), so a 3 s failure timeout costs
  milliseconds and the run replays exactly; under real time it polls the predicate.
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

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gossipnet import Config
from gossipnet.runtime.node import Node
from gossipnet.testing import cluster as _cluster
from gossipnet.testing import drive as _drive
from gossipnet.testing import free_tcp_ports as _free_tcp_ports
from gossipnet.testing import run as _run
from gossipnet.testing import start_node as _start_node
from gossipnet.testing import wait_until as _wait_until
from gossipnet.testing import wait_until_sync as _wait_until_sync
from gossipnet.testing.virtual_time import RUN_TIMEOUT_S

#: Fast membership for unit tests (the brief's numbers): a crash is seen in ~0.55 s.
FAST = {
    "heartbeat_interval_s": 0.05,
    "failure_timeout_s": 0.5,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 5.0,
    "collective_timeout_s": 2.0,
}


def _run_async(coro: Any, timeout_s: float = RUN_TIMEOUT_S) -> Any:
    """Run one test coroutine on a fresh virtual-time loop, debug mode, bounded."""
    return _run(coro, timeout_s=timeout_s)


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
