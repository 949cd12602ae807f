"""One peer's network runtime on the event-loop thread.

The node glues the layers: a transport (optionally fault-wrapped) moves
frames; the wire codec authenticates them and drops replays; membership
tracks who is alive from the packets that arrive; and every accepted
packet is dispatched by kind to the subscriber that owns it (all-reduce,
Moshpit, state transfer).  The data path is fire-and-forget
(:meth:`Node.send`); small control messages that must arrive use
:meth:`Node.send_reliable`: resend with exponential backoff until an ACK or
a deadline, the receiver acting once per request id.

The node is three layers, each a class over the one below it:
``_node_io.py`` (:class:`~gossipnet.runtime._node_io.NodeIO`: sending, reliable
sends, receive and dispatch: the per-packet path), ``_node_membership.py``
(:class:`~gossipnet.runtime._node_membership.NodeMembership`: hello, views,
heartbeats, leave, waiting for peers) and this module (:class:`Node`: its
state, start, background tasks, close, counters).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Sequence
from typing import Any

from gossipnet.clock import Clock, MonotonicClock
from gossipnet.config import Config
from gossipnet.runtime._node_io import PacketCallback
from gossipnet.runtime._node_membership import NodeMembership
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import Membership
from gossipnet.transport import create_transport
from gossipnet.transport.base import Transport
from gossipnet.transport.wire import WireCodec

__all__ = ("Node",)

log = logging.getLogger(__name__)


class Node(NodeMembership):
    """Transport + wire + membership + dispatch for one peer."""

    def __init__(
        self,
        *,
        config: Config,
        listen: str,
        peer_id: str,
        secret: bytes | None = None,
        bootstrap: Sequence[str] = (),
        clock: Clock | None = None,
        faults: Any = None,
        network: Any = None,
        advertise_host: str | None = None,
    ) -> None:
        self.config = config
        self.peer_id = peer_id
        self.clock: Clock = clock or MonotonicClock()
        self._listen = listen
        self._secret = secret
        self._bootstrap = [a for a in dict.fromkeys(bootstrap)]
        self._faults = faults
        self._network = network
        self._advertise_host = advertise_host
        self.address = ""
        self.transport: Transport | None = None
        self.codec = WireCodec(secret, config, peer_id, clock=self.clock)
        self.membership: Membership | None = None
        self._subscribers: dict[int, PacketCallback] = {}
        self._pending: dict[int, tuple[str, asyncio.Future[None]]] = {}
        self._next_rid = 1
        self._seen_requests: collections.OrderedDict[tuple[str, int, int], None] = (
            collections.OrderedDict()
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.unhandled: collections.Counter[int] = collections.Counter()
        #: small int fields every heartbeat carries (e.g. an engine's next round), so
        #: peers that just joined or restarted learn where the others are.
        self.beacon: dict[str, Any] = {}
        self._heartbeat_listeners: list[PacketCallback] = []
        #: heartbeats that failed or beacon values withheld, by reason (see stats())
        self.heartbeat_errors: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Bind the transport, start heartbeats and bootstrap; return our address."""
        self.transport = create_transport(
            self._listen,
            self.config,
            clock=self.clock,
            faults=self._faults,
            network=self._network,
            advertise_host=self._advertise_host,
        )
        self.address = await self.transport.start(self._on_frames)
        self._bootstrap = [a for a in self._bootstrap if a != self.address]
        self.membership = Membership(self.peer_id, self.address, self.config.failure_timeout_s)
        self.membership.on_change(self._redial_the_dead)
        self.subscribe(NodeKind.HELLO, self._on_hello)
        self.subscribe(NodeKind.HELLO_ACK, self._on_view)
        self.subscribe(NodeKind.HEARTBEAT, self._on_view)
        self.subscribe(NodeKind.LEAVE, self._on_leave)
        self.subscribe(NodeKind.ACK, self._on_ack)
        self.spawn(self._heartbeat_loop(), "heartbeat")
        return self.address

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """Start a background task owned by the node (cancelled on close)."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.peer_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "peer %s: task %s failed", self.peer_id, task.get_name(), exc_info=task.exception()
            )

    async def close(self, *, announce: bool = True) -> None:
        """Announce departure (bounded), stop tasks, close sockets; idempotent."""
        if self._closed:
            return
        if announce and self.membership is not None and self.transport is not None:
            others = [p for p in self.membership.alive() if p != self.peer_id]
            timeout = min(1.0, self.config.control_timeout_s)
            await asyncio.gather(
                *(self.send_reliable(p, NodeKind.LEAVE, timeout_s=timeout) for p in others),
                return_exceptions=True,
            )
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for _, fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()
        if self.transport is not None:
            await self.transport.close()

    @property
    def bootstrap(self) -> list[str]:
        """Bootstrap addresses other than our own."""
        return list(self._bootstrap)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peer_id": self.peer_id, "address": self.address, "pid": os.getpid()}
        if self.transport is not None:
            out["transport"] = self.transport.stats.as_dict()
            fault_stats = getattr(self.transport, "fault_stats", None)
            if fault_stats is not None:
                out["faults"] = fault_stats.as_dict()
        out["wire_rejects"] = dict(self.codec.rejects)
        out["wire_accepted"] = self.codec.accepted
        out["unhandled_kinds"] = dict(self.unhandled)
        out["heartbeat_errors"] = dict(self.heartbeat_errors)
        return out
