"""A node's packet I/O: sending, reliable control messages, receive and dispatch.

:class:`NodeIO` is the lowest layer of :class:`gossipnet.runtime.node.Node`: every
packet a node sends or accepts passes through it.  The data path is
fire-and-forget (:meth:`NodeIO.send`, :meth:`NodeIO.send_frames`); small
control messages that must arrive use :meth:`NodeIO.send_reliable`: resend
with exponential backoff until an ACK or a deadline, the receiver acting once
per request id.  Every accepted packet goes to the one subscriber of its kind;
only one addressed to us (``Packet.directed``) and newer than anything its
sender sent us before (``Packet.fresh``) refreshes membership, so a captured
packet replayed later cannot keep a dead peer alive.

Why a base class and not a helper object: ``_on_frames`` and ``send_frames``
are on the all-reduce's hot path, once per packet; as methods of the node they
cost the same attribute lookups as before the split, with no forwarding call.
:class:`Node` assigns every attribute declared here in its ``__init__``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gossipnet.clock import Clock
from gossipnet.config import Config
from gossipnet.errors import ClosedError
from gossipnet.runtime.kinds import KIND_RANGE as _NODE_KINDS
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import Membership
from gossipnet.transport.base import Buffer, LocalFrames, Transport
from gossipnet.transport.wire import Packet, WireCodec

__all__ = ("NodeIO", "PacketCallback")

#: Kinds below this are node/membership control (``NodeKind``): sent ``urgent``.
_FIRST_DATA_KIND = _NODE_KINDS.stop

#: The node's records keep its logger name, whichever of its modules emits them.
log = logging.getLogger("gossipnet.runtime.node")

PacketCallback = Callable[[Packet], None]
_SEEN_REQUESTS = 8192
_INT64_MAX = (1 << 63) - 1


class NodeIO:
    """Send, reliable send, receive and dispatch by kind (the base of ``Node``)."""

    config: Config
    peer_id: str
    clock: Clock
    address: str
    transport: Transport | None
    codec: WireCodec
    membership: Membership | None
    unhandled: collections.Counter[int]
    _closed: bool
    _subscribers: dict[int, PacketCallback]
    _pending: dict[int, tuple[str, asyncio.Future[None]]]
    _next_rid: int
    _seen_requests: collections.OrderedDict[tuple[str, int, int], None]

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

        Node and membership kinds (below ``LossyKind.RS_DATA``) are sent ``urgent``: they
        never wait behind paced data, so heartbeats keep failure detection honest on
        a slow link however much data is queued.
        """
        address = self.membership.address_of(peer_id) if self.membership else None
        if address is None or self.transport is None or self._closed:
            return False
        local = self.transport.is_local(address)
        frames = self.codec.encode(kind, fields, payload, local=local, dst=peer_id)
        return self.transport.send(address, frames, urgent=kind < _FIRST_DATA_KIND)

    def encode_for(
        self,
        peer_ids: Sequence[str],
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
    ) -> list[Buffer]:
        """Frames of one packet for ``peer_ids``: unsigned where all of them are local.

        Why: between processes of one user on one host the payload's MAC proves
        nothing (``WireCodec.decode``), and it is a sixth of the all-reduce's CPU
        there.  One remote destination among them and the packet is signed.
        The packet names every one of ``peer_ids`` as its destination: send these
        frames to those peers only (any other drops them as ``destination``).
        """
        transport, members = self.transport, self.membership
        local = (
            transport is not None
            and members is not None
            and bool(peer_ids)
            and all(transport.is_local(members.address_of(p) or "") for p in peer_ids)
        )
        dst = peer_ids[0] if len(peer_ids) == 1 else peer_ids
        return self.codec.encode(kind, fields, payload, local=local, dst=dst)

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
        return self.send_frames(peer_ids, self.encode_for(peer_ids, kind, fields, payload))

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
        *,
        dst: str | None = None,
    ) -> bool:
        """Send one packet to ``address``, for peer ``dst`` (None: its id is not known
        yet, as for a HELLO to a bootstrap address; such a packet refreshes no
        liveness at the receiver)."""
        if self.transport is None or self._closed:
            return False
        frames = self.codec.encode(kind, fields, payload, dst=dst)
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
                    self.send_to_address(dst, kind, body, payload, dst=peer_id or None)
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
        pkt = self.codec.decode(frames, local=type(frames) is LocalFrames)
        if pkt is None or self._closed or self.membership is None:
            return
        addr = pkt.fields.get("addr")
        if pkt.fresh and pkt.directed:  # evidence of life now, not a late or stray copy
            self.membership.heard_from(
                pkt.src, pkt.epoch, addr if isinstance(addr, str) else None, self.clock.now()
            )
        rid = pkt.fields.get("rq")
        if rid is not None and pkt.kind != NodeKind.ACK:
            if type(rid) is not int or not 0 <= rid <= _INT64_MAX:
                self.codec.rejects["request_id"] += 1
                return
            reply_to = self.membership.address_of(pkt.src) or (
                addr if isinstance(addr, str) else None
            )
            if reply_to is not None:
                self.send_to_address(reply_to, NodeKind.ACK, {"ak": rid}, dst=pkt.src)
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
