"""One peer's network runtime on the event-loop thread.

The node glues the layers: a transport (optionally fault-wrapped) moves
frames; the wire codec authenticates them and drops replays; membership
tracks who is alive from the packets that arrive; and every accepted
packet is dispatched by kind to the subscriber that owns it (all-reduce,
Moshpit, state transfer).  The data path is fire-and-forget
(:meth:`Node.send`); small control messages that must arrive use
:meth:`Node.send_reliable`: resend with exponential backoff until an ACK or
a deadline, the receiver acting once per request id.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

from .clock import Clock, MonotonicClock
from .config import Config
from .errors import ClosedError
from .membership import Membership, MembershipCallback
from .transport import create_transport
from .transport.base import Buffer, Transport
from .transport.wire import Kind, Packet, WireCodec

__all__ = ("Node",)

#: Kinds below this are node/membership control (see ``Kind``): sent ``urgent``.
_FIRST_DATA_KIND = 16

log = logging.getLogger(__name__)

PacketCallback = Callable[[Packet], None]
_MAX_VIEW_ENTRIES = 4096
_SEEN_REQUESTS = 8192


class Node:
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
        self.beacon: dict[str, int] = {}
        self._heartbeat_listeners: list[PacketCallback] = []

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
        self.subscribe(Kind.HELLO, self._on_hello)
        self.subscribe(Kind.HELLO_ACK, self._on_view)
        self.subscribe(Kind.HEARTBEAT, self._on_view)
        self.subscribe(Kind.LEAVE, self._on_leave)
        self.subscribe(Kind.ACK, self._on_ack)
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
                *(self.send_reliable(p, Kind.LEAVE, timeout_s=timeout) for p in others),
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

    # ------------------------------------------------------------------ sending
    def subscribe(self, kind: int, handler: PacketCallback) -> None:
        """Route accepted packets of ``kind`` to ``handler`` (one handler per kind)."""
        self._subscribers[int(kind)] = handler

    def unsubscribe(self, kind: int) -> None:
        self._subscribers.pop(int(kind), None)

    def send(
        self,
        peer_id: str,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
    ) -> bool:
        """Fire-and-forget one packet to ``peer_id``; False if it was dropped locally.

        Node and membership kinds (below ``Kind.RS_DATA``) are sent ``urgent``: they
        never wait behind paced data, so heartbeats keep failure detection honest on
        a slow link however much data is queued.
        """
        address = self.membership.address_of(peer_id) if self.membership else None
        if address is None or self.transport is None or self._closed:
            return False
        frames = self.codec.encode(kind, fields, payload)
        return self.transport.send(address, frames, urgent=kind < _FIRST_DATA_KIND)

    def send_many(
        self,
        peer_ids: Sequence[str],
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
    ) -> int:
        """Fire-and-forget one packet to each of ``peer_ids``; how many were accepted.

        Why: a broadcast chunk is the same packet for every destination (the
        replay window is per receiver), so it is encoded and signed once, not
        once per peer: the MAC is the largest CPU cost of the data path.
        """
        if self.transport is None or self._closed or not peer_ids:
            return 0
        return self.send_frames(peer_ids, self.codec.encode(kind, fields, payload))

    def send_frames(self, peer_ids: Sequence[str], frames: list[Buffer]) -> int:
        """Send already encoded ``frames`` to each of ``peer_ids``; how many were accepted.

        A second send of the same frames is the same packet (same sequence
        number): a receiver that got the first copy drops the second as a replay,
        which is what redundant copies (``Config.redundancy``) rely on.
        """
        if self.transport is None or self._closed:
            return 0
        sent = 0
        for peer_id in peer_ids:
            address = self.membership.address_of(peer_id) if self.membership else None
            if address is not None:
                sent += self.transport.send(address, frames)
        return sent

    def send_to_address(
        self,
        address: str,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
    ) -> bool:
        if self.transport is None or self._closed:
            return False
        frames = self.codec.encode(kind, fields, payload)
        return self.transport.send(address, frames, urgent=kind < _FIRST_DATA_KIND)

    async def send_reliable(
        self,
        peer_id: str,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
        *,
        timeout_s: float | None = None,
        address: str | None = None,
    ) -> bool:
        """Send until acknowledged or ``timeout_s`` passes; True when acknowledged.

        Each try is a fresh packet (new sequence number) so the replay guard
        does not eat retries; the receiver acts once per request id.
        """
        if self._closed:
            raise ClosedError("node is closed")
        timeout = self.config.control_timeout_s if timeout_s is None else timeout_s
        rid = self._next_rid
        self._next_rid += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (peer_id, fut)
        body = dict(fields or {})
        body["rq"] = rid
        deadline = self.clock.now() + timeout
        delay = self.config.control_retry_s
        try:
            while not self._closed:
                dst = address or (self.membership.address_of(peer_id) if self.membership else None)
                if dst is not None:
                    self.send_to_address(dst, kind, body, payload)
                remaining = deadline - self.clock.now()
                if remaining <= 0:
                    return False
                wait = min(delay, remaining)
                with contextlib.suppress(TimeoutError):
                    await self._wait_future(fut, wait)
                if fut.done():
                    return not fut.cancelled()
                delay = min(delay * 2, 0.5)
            return False
        finally:
            self._pending.pop(rid, None)

    async def _wait_future(self, fut: asyncio.Future[Any], timeout_s: float) -> None:
        """Wait for ``fut`` at most ``timeout_s`` on the injected clock."""
        if fut.done():
            return
        sleeper = asyncio.ensure_future(self.clock.sleep(timeout_s))
        try:
            await asyncio.wait({fut, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
        if not fut.done():
            raise TimeoutError

    # ------------------------------------------------------------------ receiving
    def _on_frames(self, frames: list[memoryview]) -> None:
        pkt = self.codec.decode(frames)
        if pkt is None or self._closed or self.membership is None:
            return
        addr = pkt.fields.get("addr")
        self.membership.heard_from(
            pkt.src, pkt.epoch, addr if isinstance(addr, str) else None, self.clock.now()
        )
        rid = pkt.fields.get("rq")
        if isinstance(rid, int) and pkt.kind != Kind.ACK:
            reply_to = self.membership.address_of(pkt.src) or (
                addr if isinstance(addr, str) else None
            )
            if reply_to is not None:
                self.send_to_address(reply_to, Kind.ACK, {"ak": rid})
            key = (pkt.src, pkt.epoch, rid)
            if key in self._seen_requests:
                return  # a retry of a request we already acted on
            self._seen_requests[key] = None
            if len(self._seen_requests) > _SEEN_REQUESTS:
                self._seen_requests.popitem(last=False)
        handler = self._subscribers.get(pkt.kind)
        if handler is None:
            self.unhandled[pkt.kind] += 1
            return
        try:
            handler(pkt)
        except Exception:
            # A handler bug must not kill the receive path for every other packet.
            log.exception(
                "peer %s: handler for kind %d failed on a packet from %s",
                self.peer_id,
                pkt.kind,
                pkt.src,
            )

    def _on_ack(self, pkt: Packet) -> None:
        rid = pkt.fields.get("ak")
        entry = self._pending.get(rid) if isinstance(rid, int) else None
        if entry is not None and entry[0] in (pkt.src, "") and not entry[1].done():
            entry[1].set_result(None)

    def _on_hello(self, pkt: Packet) -> None:
        addr = pkt.fields.get("addr")
        if isinstance(addr, str):
            self.send_to_address(addr, Kind.HELLO_ACK, {"addr": self.address}, self._view_payload())

    def on_heartbeat(self, callback: PacketCallback) -> None:
        """Also call ``callback`` with every heartbeat (to read others' beacons)."""
        self._heartbeat_listeners.append(callback)

    def _on_view(self, pkt: Packet) -> None:
        if pkt.kind == Kind.HEARTBEAT:
            for cb in self._heartbeat_listeners:
                cb(pkt)
        if not pkt.payload or self.membership is None:
            return
        try:
            view = msgpack.unpackb(
                pkt.payload,
                max_array_len=_MAX_VIEW_ENTRIES,
                max_str_len=1024,
                max_bin_len=0,
                max_map_len=0,
                max_ext_len=0,
            )
        except Exception:
            self.codec.rejects["view_parse"] += 1
            return
        if not isinstance(view, list):
            self.codec.rejects["view_parse"] += 1
            return
        for entry in view:
            if (
                isinstance(entry, list)
                and len(entry) == 2
                and all(isinstance(x, str) for x in entry)
                and self.membership.learned(entry[0], entry[1])
            ):
                self.send_to_address(entry[1], Kind.HELLO, {"addr": self.address})

    def _on_leave(self, pkt: Packet) -> None:
        if self.membership is None:
            return
        address = self.membership.address_of(pkt.src)
        self.membership.left(pkt.src, pkt.epoch)
        self.codec.forget(pkt.src)
        if address is not None:
            # after a grace period: the ACK of this LEAVE is still queued on that socket
            grace = min(self.config.control_timeout_s, 10 * self.config.control_retry_s)
            self.clock.call_later(grace, lambda: self._forget(address))

    def _forget(self, address: str) -> None:
        """Release the transport's per-destination resources unless a peer uses it again."""
        if self._closed or self.transport is None or self.membership is None:
            return
        if any(p.address == address for p in self.membership.known()):
            return
        self.transport.forget(address)

    def _view_payload(self) -> bytes:
        assert self.membership is not None
        return msgpack.packb([list(e) for e in self.membership.view()])

    # ------------------------------------------------------------------ membership
    async def _connect_bootstrap(self) -> None:
        """Let backends with lazy connections (ZeroMQ ``IMMEDIATE``) finish connecting
        to the bootstrap peers first, so the first HELLO is not dropped and joining
        takes milliseconds instead of a heartbeat interval."""
        transport = self.transport
        connect = getattr(transport, "connect", None) or getattr(
            getattr(transport, "inner", None), "connect", None
        )
        if connect is None or not self._bootstrap:
            return
        await asyncio.gather(
            *(connect(a, min(0.2, self.config.heartbeat_interval_s)) for a in self._bootstrap),
            return_exceptions=True,
        )

    async def _connect_to(self, addresses: list[str]) -> None:
        """Wait (bounded) until our own sends to ``addresses`` would be accepted.

        Why: hearing from a peer says its socket to us is up, not ours to it; with
        ZeroMQ's ``IMMEDIATE`` the first round's packets would be dropped otherwise.
        """
        transport = self.transport
        connect = getattr(transport, "connect", None) or getattr(
            getattr(transport, "inner", None), "connect", None
        )
        if connect is None:
            return
        await asyncio.gather(
            *(connect(a, 0.5) for a in addresses if a != self.address), return_exceptions=True
        )

    async def _heartbeat_loop(self) -> None:
        assert self.membership is not None
        interval = self.config.heartbeat_interval_s
        await self._connect_bootstrap()
        while not self._closed:
            now = self.clock.now()
            self.membership.expire(now)
            for address in self.membership.prune(now, 10 * self.config.failure_timeout_s):
                self._forget(address)
            view = self._view_payload()
            beat = {"addr": self.address, **self.beacon}
            for info in self.membership.known():
                if info.alive:
                    self.send_to_address(info.address, Kind.HEARTBEAT, beat, view)
                else:
                    self.send_to_address(info.address, Kind.HELLO, {"addr": self.address})
            known_addresses = {p.address for p in self.membership.known() if p.alive}
            for address in self._bootstrap:
                if address not in known_addresses:
                    self.send_to_address(address, Kind.HELLO, {"addr": self.address})
            await self.clock.sleep(interval / 2 if self.membership.version == 0 else interval)

    def alive_peers(self) -> list[str]:
        return self.membership.alive() if self.membership else [self.peer_id]

    def on_membership(self, callback: MembershipCallback) -> None:
        assert self.membership is not None, "start() the node first"
        self.membership.on_change(callback)

    async def wait_for_peers(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` peers (self included) are alive or the deadline passes."""
        assert self.membership is not None, "start() the node first"
        changed = asyncio.Event()

        def wake(_event: str, _peer: str) -> None:
            changed.set()

        self.membership.on_change(wake)
        deadline = self.clock.now() + timeout_s
        try:
            while len(self.alive_peers()) < count:
                remaining = deadline - self.clock.now()
                if remaining <= 0:
                    return False
                changed.clear()
                waiter = asyncio.ensure_future(changed.wait())
                try:
                    await self._wait_future(waiter, remaining)
                except TimeoutError:
                    pass
                finally:
                    waiter.cancel()
            await self._connect_to(
                [a for a in (self.membership.address_of(p) for p in self.alive_peers()) if a]
            )
            return True
        finally:
            self.membership.off_change(wake)

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
        return out
