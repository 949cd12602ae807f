"""The machinery under :class:`gossipnet.Peer`: loop thread, node, engines, blocking calls.

:class:`PeerCore` owns what a peer runs on: the event-loop thread
(:mod:`gossipnet.runtime.loop`), the node (:mod:`gossipnet.runtime.node`) and the averaging
engines, created on the loop before any packet can arrive for them.  Every
public method is sync: it submits a coroutine to the loop and waits with a
deadline (``_call``); from the loop thread that raises ``RuntimeError``
instead of deadlocking.  Why a base class: :mod:`gossipnet.peer` keeps what
users call (``join()``, the collectives, the optimizer, micro-batches) and
their documentation; this module keeps how a call reaches the loop, who is
alive, and shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Sequence
from typing import Any, Self, TypeVar

from gossipnet._collective import FlatCache
from gossipnet.clock import Clock
from gossipnet.collectives.island.averager import IslandAverage
from gossipnet.collectives.lossy.engine import LossyAllReduce
from gossipnet.collectives.lossy.packets import OPTIMIZER_KINDS
from gossipnet.collectives.moshpit.averager import MoshpitAverager
from gossipnet.collectives.route.averager import RouteAverager
from gossipnet.collectives.statesync.sync import StateSync
from gossipnet.config import Config
from gossipnet.errors import ClosedError, ConfigError
from gossipnet.runtime._join_check import JoinSnapshot, join_error, shortfall_details
from gossipnet.runtime._malloc import tune_malloc
from gossipnet.runtime.join import advertise_host
from gossipnet.runtime.loop import LoopThread
from gossipnet.runtime.node import Node
from gossipnet.training.microbatch import MicrobatchState
from gossipnet.training.replicas import ReplicaDigests

__all__ = ("PeerCore",)

#: The facade's records keep its logger name, whichever module emits them.
log = logging.getLogger("gossipnet.peer")
T = TypeVar("T")


class PeerCore:
    """A started peer's runtime and lifecycle; the base of :class:`gossipnet.Peer`.

    Thread-safe: any thread may call its methods, except the peer's own
    event-loop thread (that raises ``RuntimeError`` instead of deadlocking).
    """

    def __init__(
        self,
        *,
        config: Config,
        listen: str,
        peer_id: str,
        bootstrap: Sequence[str],
        secret: bytes | None,
        faults: Any = None,
        clock: Clock | None = None,
        network: Any = None,
        expected_peers: int | None = None,
    ) -> None:
        self.config = config
        if config.tune_malloc:
            tune_malloc()
        self._loop = LoopThread(f"gossipnet-{peer_id}", use_uvloop=config.use_uvloop)
        self._node = Node(
            config=config,
            listen=listen,
            peer_id=peer_id,
            secret=secret,
            bootstrap=bootstrap,
            clock=clock,
            faults=faults,
            network=network,
            advertise_host=advertise_host(bootstrap),
        )
        self._closed = False
        self._allreduce: LossyAllReduce | None = None
        self._optim_engine: LossyAllReduce | None = None  # GossipOptimizer's rounds
        self._replicas: ReplicaDigests | None = None  # resync digests, ours and theirs
        self._moshpit: MoshpitAverager | None = None
        self._statesync: StateSync | None = None
        self._route: RouteAverager | None = None
        self._island: IslandAverage | None = None
        self._flats = FlatCache()
        self._microbatch = MicrobatchState()
        try:
            self._loop.call(self._start(), timeout_s=config.control_timeout_s + 10)
            self._await_peers(expected_peers)
        except BaseException:
            self.close(announce=False)
            raise

    def _await_peers(self, expected_peers: int | None) -> None:
        """Wait up to ``Config.join_timeout_s`` for the expected peers; return at once
        when they are alive.  Short of them at the deadline, go on with a warning if
        ``Config.min_peers`` are alive, else raise.

        ``expected_peers`` None: the bootstrap's distinct addresses plus us.

        Raises:
            JoinError: fewer than ``min_peers`` (default: all expected) alive; the
                message names the silent addresses and those failing authentication.
            ConfigError: ``min_peers`` above the peers expected.
        """
        config = self.config
        if expected_peers is None:
            # our own address was removed from the bootstrap list at start
            expected_peers = len(self._node.bootstrap) + 1
        minimum = expected_peers if config.min_peers is None else config.min_peers
        if minimum > expected_peers:
            raise ConfigError(
                f"Config.min_peers={minimum} exceeds the {expected_peers} peers join() expects"
                " (wait_for, or the distinct peer addresses plus this one)"
            )
        if expected_peers <= 1:
            return
        t = config.join_timeout_s
        if self._loop.call(self._node.wait_for_peers(expected_peers, t), timeout_s=t + 5):
            return
        snap = self._call(self._snapshot(expected_peers))
        if len(snap.alive) >= expected_peers:
            return  # the last one came in since the deadline
        if len(snap.alive) < minimum:
            raise join_error(snap)
        text, _, _ = shortfall_details(snap, advice=False)
        log.warning("%s\n  going on with them (Config.min_peers=%d)", text, minimum)

    async def _snapshot(self, expected: int) -> JoinSnapshot:
        node, members = self._node, self._node.membership
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

    # ------------------------------------------------------------------ identity
    @property
    def peer_id(self) -> str:
        return self._node.peer_id

    @property
    def address(self) -> str:
        return self._node.address

    @property
    def node(self) -> Node:
        """The async runtime (use only from the peer's loop thread)."""
        return self._node

    def alive_peers(self) -> list[str]:
        """Peers currently believed alive, sorted, this one included."""
        return self._call(self._alive())

    async def _alive(self) -> list[str]:
        return self._node.alive_peers()

    def stats(self) -> dict[str, Any]:
        """Transport, fault and wire counters (a snapshot)."""
        return self._call(self._stats())

    async def _stats(self) -> dict[str, Any]:
        return self._node.stats()

    def wait_for_peers(self, count: int, timeout_s: float | None = None) -> bool:
        """Block until ``count`` peers (self included) are alive; False at the deadline."""
        t = self.config.join_timeout_s if timeout_s is None else timeout_s
        return self._call(self._node.wait_for_peers(count, t), t + 5)

    async def _start(self) -> None:
        """Start the node and its engines on the loop thread, before any packet can
        arrive for them (an engine created lazily would miss a fast peer's first round)."""
        await self._node.start()
        self._allreduce = LossyAllReduce(self._node)
        self._optim_engine = LossyAllReduce(self._node, tag="opt", kinds=OPTIMIZER_KINDS)
        self._replicas = ReplicaDigests(self._node)
        self._moshpit = MoshpitAverager(self._node)
        self._statesync = StateSync(self._node)
        self._route = RouteAverager(self._node)
        self._island = IslandAverage(self._node)

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if self._closed:
            coro.close()
            raise ClosedError("this peer has left; call gossipnet.join() again")
        return self._loop.call(
            coro, self.config.control_timeout_s + 30 if timeout_s is None else timeout_s
        )

    # ------------------------------------------------------------------ shutdown
    def leave(self) -> None:
        """Announce departure to the alive peers (bounded wait), then close."""
        self.close(announce=True)

    def close(self, *, announce: bool = False) -> None:
        """Close sockets, cancel tasks, join the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.call(
                self._node.close(announce=announce), timeout_s=self.config.control_timeout_s + 5
            )
        except (ClosedError, TimeoutError, RuntimeError):
            log.warning("peer %s: close did not finish cleanly", self._node.peer_id)
        finally:
            self._loop.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<gossipnet.Peer {self.peer_id} {self.address} {state}>"
