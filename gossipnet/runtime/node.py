"""One peer's network runtime on the event-loop thread.

The node glues the layers: a transport (optionally fault-wrapped) moves
frames; the wire codec authenticates them and drops replays; membership
tracks who is alive from the packets that arrive; and every accepted
packet is dispatched by kind to the subscriber that owns it (all-reduce,
Moshpit, state transfer).  The data path is fire-and-forget
(:meth:`Node.send`); small control messages that must arrive use
:meth:`Node.send_reliable`: resend with exponential backoff until an ACK or
a deadline, the receiver acting once per request id.

The node is three parts, held by composition and each tested alone:
:attr:`Node.io` (:class:`~gossipnet.runtime.dispatch.PacketIO`: send, receive,
dispatch by kind: the per-packet path), :attr:`Node.reliable`
(:class:`~gossipnet.runtime.reliable.Reliable`: acks, retries, once per request) and
:attr:`Node.members` (:class:`~gossipnet.runtime.membership_protocol.MembershipProtocol`:
hello, views, heartbeats, leave, waiting for peers).  This module keeps the node's
state, start, background tasks, close and counters.

Why the parts' methods are bound onto the node in ``__init__`` (``node.send is
node.io.send``) rather than wrapped in methods: ``send`` and ``send_frames`` run once
per packet, and a forwarding call there would cost the all-reduce throughput.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from gossipnet.clock import Clock, MonotonicClock
from gossipnet.config import Config
from gossipnet.runtime.dispatch import PacketIO
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import Membership
from gossipnet.runtime.membership_protocol import MembershipProtocol
from gossipnet.runtime.reliable import Reliable, wait_future
from gossipnet.transport import create_transport
from gossipnet.transport.base import Transport
from gossipnet.transport.wire import WireCodec

__all__ = ("Node",)

log = logging.getLogger(__name__)


class Node:
    """Transport + wire + membership + dispatch for one peer.

    Besides its own methods it offers its parts' (bound once, see the module):
    ``send``, ``send_many``, ``send_frames``, ``encode_for``, ``encode_run``,
    ``send_batch``, ``send_to_address``,
    ``subscribe``, ``unsubscribe`` (:class:`PacketIO`); ``send_reliable``
    (:class:`Reliable`); ``alive_peers``, ``on_membership``, ``on_heartbeat``,
    ``wait_for_peers`` (:class:`MembershipProtocol`).  ``transport``,
    ``membership`` and ``address`` are set by :meth:`start`.
    """

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
        self._faults = faults
        self._network = network
        self._advertise_host = advertise_host
        self.address = ""
        self.transport: Transport | None = None
        self.membership: Membership | None = None
        self.codec = WireCodec(
            secret, config, peer_id, clock=self.clock, intro_kinds=frozenset({NodeKind.HELLO})
        )
        self.io = io = PacketIO(peer_id, self.clock, self.codec)
        self.reliable = reliable = Reliable(io, config)
        self.members = members = MembershipProtocol(io, config, bootstrap)
        self._tasks: set[asyncio.Task[Any]] = set()
        #: accepted packets nobody subscribed to, by kind
        self.unhandled = io.unhandled
        #: small int fields every heartbeat carries (e.g. an engine's next round)
        self.beacon = members.beacon
        #: heartbeats that failed or beacon values withheld, by reason (see stats())
        self.heartbeat_errors = members.heartbeat_errors
        #: per protocol engine above (e.g. ``"lossy:ar"``), its dropped packets by
        #: reason: a counter it keeps and registers here, so ``stats()`` shows every
        #: drop without this layer knowing the engines
        self.drop_counters: dict[str, Mapping[str, int]] = {}
        #: per protocol engine above, the bytes its packets put on the wire so far (a
        #: reader of its own counter), for ``stats()["wire"]``
        self.sent_counters: dict[str, Callable[[], int]] = {}
        # the parts' methods, bound once: no forwarding call on the per-packet path
        self.send = io.send
        self.send_many = io.send_many
        self.send_frames = io.send_frames
        self.encode_for = io.encode_for
        self.encode_run = io.encode_run
        self.send_batch = io.send_batch
        self.send_to_address = io.send_to_address
        self.subscribe = io.subscribe
        self.subscribe_batch = io.subscribe_batch
        self.unsubscribe = io.unsubscribe
        self._on_frames = io.on_frames
        self.send_reliable = reliable.send_reliable
        self.alive_peers = members.alive_peers
        self.on_membership = members.on_membership
        self.on_heartbeat = members.on_heartbeat
        self.wait_for_peers = members.wait_for_peers

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Bind the transport, start heartbeats and bootstrap; return our address."""
        io = self.io
        self.transport = io.transport = create_transport(
            self._listen,
            self.config,
            clock=self.clock,
            faults=self._faults,
            network=self._network,
            advertise_host=self._advertise_host,
        )
        if hasattr(self.transport, "batch_handler"):  # a backend that delivers per drain
            self.transport.batch_handler = io.on_batch
        self.address = io.address = await self.transport.start(io.on_frames)
        self.membership = self.members.start()
        self.spawn(self.members.heartbeat_loop(), "heartbeat")
        return self.address

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
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

    async def _wait_future(self, fut: asyncio.Future[Any], timeout_s: float) -> None:
        """Wait for ``fut`` at most ``timeout_s`` on the node's clock (see
        :func:`gossipnet.runtime.reliable.wait_future`).

        Raises:
            TimeoutError: ``fut`` is not done at the deadline.
        """
        await wait_future(self.clock, fut, timeout_s)

    async def close(self, *, announce: bool = True) -> None:
        """Announce departure (bounded), stop tasks, close sockets; idempotent."""
        if self.io.closed:
            return
        if announce and self.membership is not None and self.transport is not None:
            others = [p for p in self.membership.alive() if p != self.peer_id]
            timeout = min(1.0, self.config.control_timeout_s)
            await asyncio.gather(
                *(self.send_reliable(p, NodeKind.LEAVE, timeout_s=timeout) for p in others),
                return_exceptions=True,
            )
        self.io.closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.reliable.cancel_all()
        if self.transport is not None:
            await self.transport.close()

    def pin(self, peer_id: str, epoch: int, public: bytes, address: str) -> None:
        """Bind ``peer_id`` to ``public`` for good, on a launcher's word (a store the
        ranks share, as the torch backend's): no introduction can rebind it, and an
        introduction that bound another key to that id first is overridden.

        Raises:
            ValueError: an unusable public key, our own key or our own id.
        """
        self.codec.bind(peer_id, epoch, public, pinned=True)
        if self.membership is not None:
            self.membership.bound(peer_id, epoch, address, self.clock.now())

    @property
    def identity(self) -> tuple[int, bytes]:
        """Our incarnation and public key: what a launcher publishes for :meth:`pin`."""
        return self.codec.epoch, self.codec.identity.public

    @property
    def bootstrap(self) -> list[str]:
        """Bootstrap addresses other than our own."""
        return list(self.members.bootstrap)

    @property
    def closed(self) -> bool:
        return self.io.closed

    def stats(self) -> dict[str, Any]:
        """Transport, fault, wire, heartbeat and engine-drop counters (a snapshot).

        ``wire``: what this peer put on the wire since it started, every kind of
        packet: ``sent_bytes`` / ``sent_packets`` (frame bytes, as the transport's
        ``sent_bytes`` counts them; under a fault plan also the packets its network
        lost, less the copies its network duplicated: what this peer sent),
        ``control_bytes`` (node control: introductions, heartbeats, views, acks,
        leave), ``collective_bytes`` (per engine, e.g. ``lossy:ar``: the bytes its
        rounds' reports count, and repair answers served after a round) and
        ``other_bytes`` (the rest: state transfer, replica digests, protocols that
        do not count their own bytes).
        """
        out: dict[str, Any] = {"peer_id": self.peer_id, "address": self.address, "pid": os.getpid()}
        if self.transport is not None:
            out["transport"] = self.transport.stats.as_dict()
            fault_stats = getattr(self.transport, "fault_stats", None)
            if fault_stats is not None:
                out["faults"] = fault_stats.as_dict()
            out["wire"] = self._wire(self.transport)
        out["wire_rejects"] = dict(self.codec.rejects)
        out["wire_accepted"] = self.codec.accepted
        out["wire_unkeyed"] = self.codec.unkeyed
        if self.members.admission is not None:
            out["admission"] = dict(self.members.admission.counts)
        if self.membership is not None:
            out["membership_refused"] = dict(self.membership.refused)
        out["unhandled_kinds"] = dict(self.unhandled)
        out["heartbeat_errors"] = dict(self.heartbeat_errors)
        out["loop_stalls"] = {"count": self.members.stalls, "seconds": self.members.stalled_s}
        out["engine_drops"] = {name: dict(c) for name, c in self.drop_counters.items()}
        return out

    def _wire(self, transport: Transport) -> dict[str, Any]:
        """``stats()["wire"]`` (see :meth:`stats`)."""
        t = transport.stats
        # a fault plan's network: the packets it lost were sent; its duplicates were not
        lost = getattr(transport, "net_lost", (0, 0))
        dup = getattr(transport, "net_duplicated", (0, 0))
        sent = t.sent_bytes + lost[1] - dup[1]
        collective = {name: read() for name, read in self.sent_counters.items()}
        control = self.io.control_bytes
        return {
            "sent_bytes": sent,
            "sent_packets": t.sent_packets + lost[0] - dup[0],
            "control_bytes": control,
            "control_packets": self.io.control_packets,
            "collective_bytes": collective,
            "other_bytes": max(0, sent - control - sum(collective.values())),
        }
