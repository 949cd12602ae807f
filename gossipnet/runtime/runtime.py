"""One started peer's runtime: its loop thread, its node, its engines, blocking calls.

:class:`Runtime` is what :class:`gossipnet.Peer` holds rather than inherits: the
event-loop thread (:mod:`gossipnet.runtime.loop`), the node
(:mod:`gossipnet.runtime.node`), the engines the facade registers, the flat-buffer
cache, the join wait and shutdown.  Every method is sync and thread-safe: it submits a
coroutine to the loop and waits with a deadline (:meth:`Runtime.call`); from the loop
thread that raises ``RuntimeError`` instead of deadlocking.

Why engines by key: the runtime is the layer under the collectives, so it must not
name them.  The facade passes factories to :meth:`Runtime.start`, which builds them on
the loop thread right after the node starts, before any packet can arrive for them (an
engine created lazily would miss a fast peer's first round), and hands them back typed
through :meth:`Runtime.engine`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from gossipnet.config import Config
from gossipnet.errors import ClosedError, ConfigError
from gossipnet.runtime._gc import tune_gc
from gossipnet.runtime._join_check import JoinSnapshot, join_error, shortfall_details
from gossipnet.runtime._malloc import tune_malloc
from gossipnet.runtime.flatbuffer import FlatCache
from gossipnet.runtime.loop import LoopThread
from gossipnet.runtime.node import Node

__all__ = ("EngineFactory", "Runtime")

#: The facade's records keep its logger name, whichever module emits them.
log = logging.getLogger("gossipnet.peer")
T = TypeVar("T")
E = TypeVar("E")

#: Builds one engine on the loop thread from the started node.
EngineFactory = Callable[[Node], object]


class Runtime:
    """A peer's loop thread, node and engines, driven from any other thread.

    Thread-safe: any thread may call its methods, except its own event-loop thread
    (that raises ``RuntimeError`` instead of deadlocking).

    Args:
        node: the node to run, not started yet; its ``config`` is the runtime's.
    """

    def __init__(self, node: Node) -> None:
        self.config: Config = node.config
        if self.config.tune_malloc:
            tune_malloc()
        tune_gc(self.config.gc_threshold, self.config.gc_freeze)  # process-wide (Config)
        self.node = node
        self.loop_thread = LoopThread(
            f"gossipnet-{node.peer_id}", use_uvloop=self.config.use_uvloop
        )
        #: one flat buffer per tensor layout, for the caller's thread (see FlatCache)
        self.flats = FlatCache()
        self._engines: dict[str, object] = {}
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(
        self, engines: Mapping[str, EngineFactory] | None = None, *, expected_peers: int | None
    ) -> None:
        """Start the node and ``engines`` on the loop thread, then wait for the peers.

        Args:
            engines: key -> factory, built in order right after the node starts.
            expected_peers: peers (self included) to wait for; None: the bootstrap's
                distinct addresses plus us.

        Raises:
            JoinError, ConfigError: see :meth:`await_peers`; the runtime is closed.
        """
        try:
            self.loop_thread.call(
                self._start(engines or {}), timeout_s=self.config.control_timeout_s + 10
            )
            self.await_peers(expected_peers)
        except BaseException:
            self.close(announce=False)
            raise

    async def _start(self, engines: Mapping[str, EngineFactory]) -> None:
        # no await between the node's start and the engines: no packet can come between
        await self.node.start()
        for key, factory in engines.items():
            self._engines[key] = factory(self.node)

    def engine(self, key: str, kind: type[E]) -> E:
        """The engine registered under ``key`` at :meth:`start`.

        Raises:
            KeyError: no such engine.
            TypeError: it is not a ``kind``.
        """
        found = self._engines[key]
        if not isinstance(found, kind):
            raise TypeError(f"engine {key!r} is a {type(found).__name__}, not a {kind.__name__}")
        return found

    def leave(self) -> None:
        """Announce departure to the alive peers (bounded wait), then close."""
        self.close(announce=True)

    def close(self, *, announce: bool = False) -> None:
        """Close sockets, cancel tasks, join the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.loop_thread.call(
                self.node.close(announce=announce), timeout_s=self.config.control_timeout_s + 5
            )
        except (ClosedError, TimeoutError, RuntimeError):
            log.warning("peer %s: close did not finish cleanly", self.node.peer_id)
        finally:
            self.loop_thread.stop()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ calls
    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop thread and wait for its result.

        Args:
            coro: runs on the loop thread; cancelled at the deadline.
            timeout_s: the wait's bound in seconds (default
                ``Config.control_timeout_s + 30``).

        Raises:
            ClosedError: the runtime was closed (``coro`` is closed unrun).
            RuntimeError: called from the loop thread itself (it would deadlock).
            TimeoutError: ``timeout_s`` passed.
        """
        if self._closed:
            coro.close()
            raise ClosedError("this peer has left; call gossipnet.join() again")
        if timeout_s is None:
            timeout_s = self.config.control_timeout_s + 30
        return self.loop_thread.call(coro, timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop thread without waiting; its future.

        Why: a caller that overlaps its own work with the network's waits later on
        the future (with its own deadline, cancelling on expiry).

        Raises:
            ClosedError: the runtime was closed (``coro`` is closed unrun).
        """
        if self._closed:
            coro.close()
            raise ClosedError("this peer has left; call gossipnet.join() again")
        return asyncio.run_coroutine_threadsafe(coro, self.loop_thread.loop)

    # ------------------------------------------------------------------ who is there
    def alive_peers(self) -> list[str]:
        """Peers currently believed alive, sorted, this one included."""
        return self.call(self._alive())

    async def _alive(self) -> list[str]:
        return self.node.alive_peers()

    def stats(self) -> dict[str, Any]:
        """Transport, fault and wire counters (a snapshot)."""
        return self.call(self._stats())

    async def _stats(self) -> dict[str, Any]:
        return self.node.stats()

    def wait_for_peers(self, count: int, timeout_s: float | None = None) -> bool:
        """Block until ``count`` peers (self included) are alive; False at the deadline."""
        t = self.config.join_timeout_s if timeout_s is None else timeout_s
        return self.call(self.node.wait_for_peers(count, t), t + 5)

    def await_peers(self, expected_peers: int | None) -> None:
        """Wait up to ``Config.join_timeout_s`` for the expected peers; return at once
        when they are alive.  Short of them at the deadline, go on with a warning if
        ``Config.min_peers`` are alive, else raise.

        Args:
            expected_peers: None: the bootstrap's distinct addresses plus us.

        Raises:
            JoinError: fewer than ``min_peers`` (default: all expected) alive; the
                message names the silent addresses and those failing authentication.
            ConfigError: ``min_peers`` above the peers expected.
        """
        config = self.config
        if expected_peers is None:
            # our own address was removed from the bootstrap list at start
            expected_peers = len(self.node.bootstrap) + 1
        minimum = expected_peers if config.min_peers is None else config.min_peers
        if minimum > expected_peers:
            raise ConfigError(
                f"Config.min_peers={minimum} exceeds the {expected_peers} peers join() expects"
                " (wait_for, or the distinct peer addresses plus this one)"
            )
        if expected_peers <= 1:
            return
        t = config.join_timeout_s
        if self.loop_thread.call(self.node.wait_for_peers(expected_peers, t), timeout_s=t + 5):
            return
        snap = self.call(self._snapshot(expected_peers))
        if len(snap.alive) >= expected_peers:
            return  # the last one came in since the deadline
        if len(snap.alive) < minimum:
            raise join_error(snap)
        text, _, _ = shortfall_details(snap, advice=False)
        log.warning("%s\n  going on with them (Config.min_peers=%d)", text, minimum)

    async def _snapshot(self, expected: int) -> JoinSnapshot:
        node, members = self.node, self.node.membership
        alive = tuple(node.alive_peers())
        addresses = (members.address_of(p) if members else None for p in alive)
        return JoinSnapshot(
            peer_id=node.peer_id,
            address=node.address,
            alive=alive,
            alive_addresses=frozenset(a for a in addresses if a),
            bootstrap=tuple(node.bootstrap),
            suspects=tuple(node.codec.suspects.values()),
            run=self.config.run,
            expected=expected,
            timeout_s=self.config.join_timeout_s,
        )
