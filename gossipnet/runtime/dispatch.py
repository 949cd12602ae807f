"""A node's packet I/O: encode and send, receive, authenticate and dispatch by kind.

:class:`PacketIO` is the part of :class:`gossipnet.runtime.node.Node` that every packet
passes through.  Sending is fire-and-forget (:meth:`PacketIO.send`,
:meth:`PacketIO.send_frames`); every accepted packet goes to the one subscriber of its
kind.  Only a packet under its sender's pairwise key (``Packet.directed``: not an
introduction, which any member can send under any name) and newer than anything its
sender sent us before (``Packet.fresh``) refreshes membership, so a captured packet
replayed later cannot keep a dead peer alive; and only a node-control packet of the
peer itself moves that peer's address (its ``addr`` field).

Why apart: it is the per-packet path (the all-reduce sends and receives through it
once per chunk), so it is kept free of the reliable-message and membership logic,
which reach it through two hooks set once: :attr:`PacketIO.accept_request` (a request
id seen: ACK it, drop a retry) and the subscribers.  The node stores this object's
bound methods as its own (``node.send is node.io.send``), so the split adds no call.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gossipnet.clock import Clock
from gossipnet.runtime.kinds import KIND_RANGE as _NODE_KINDS
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import Membership
from gossipnet.transport.address import valid_address
from gossipnet.transport.base import Buffer, LocalFrames, Transport
from gossipnet.transport.wire import Packet, WireCodec

__all__ = ("BatchCallback", "PacketCallback", "PacketIO", "RequestFilter")

#: Kinds below this are node/membership control (``NodeKind``): sent ``urgent``.
_FIRST_DATA_KIND = _NODE_KINDS.stop

#: The node's records keep its logger name, whichever of its modules emits them.
log = logging.getLogger("gossipnet.runtime.node")

PacketCallback = Callable[[Packet], None]
#: Takes consecutive accepted packets of its kinds, in arrival order (one drain's).
BatchCallback = Callable[[list[Packet]], None]
#: Called with a packet that carries a request id (``rq``); False: drop the packet.
RequestFilter = Callable[[Packet, Any], bool]


def _accept_all(_pkt: Packet, _rid: Any) -> bool:
    return True


class PacketIO:
    """Send, receive and dispatch by kind for one peer; runs on the loop thread.

    ``transport``, ``membership`` and ``address`` are None/empty until the node starts
    (it sets them once); until then every send returns False and arrivals are dropped.

    Args:
        peer_id: our id.
        clock: the injected clock (membership's "now").
        codec: the wire codec that signs, checks and numbers packets.
    """

    def __init__(self, peer_id: str, clock: Clock, codec: WireCodec) -> None:
        self.peer_id = peer_id
        self.clock = clock
        self.codec = codec
        self.transport: Transport | None = None
        self.membership: Membership | None = None
        self.address = ""
        self.closed = False
        #: kind -> the one handler of accepted packets of that kind
        self.subscribers: dict[int, PacketCallback] = {}
        #: kind -> the one handler of runs of accepted packets (``subscribe_batch``)
        self.batch_subscribers: dict[int, BatchCallback] = {}
        #: accepted packets nobody subscribed to, by kind
        self.unhandled: collections.Counter[int] = collections.Counter()
        #: the reliable part's receive side (see :mod:`gossipnet.runtime.reliable`)
        self.accept_request: RequestFilter = _accept_all
        #: frame bytes and packets of node-control kinds (hello, heartbeats, views,
        #: acks, leave) the transport accepted: their share of ``Node.stats()["wire"]``
        self.control_bytes = 0
        self.control_packets = 0

    # ------------------------------------------------------------------ subscribing
    def subscribe(self, kind: int, handler: PacketCallback) -> None:
        """Route accepted packets of ``kind`` to ``handler`` (one handler per kind)."""
        self.subscribers[int(kind)] = handler

    def subscribe_batch(self, kind: int, handler: BatchCallback) -> None:
        """Route accepted packets of ``kind`` to ``handler`` in runs (one handler per kind).

        A run is the consecutive packets of one drain (:meth:`on_batch`) that go to
        ``handler``; a packet for any other handler ends it, so every handler
        still sees packets in arrival order relative to all others.  Per-packet
        delivery (:meth:`on_frames`) goes to the kind's :meth:`subscribe` handler
        where it has one (no batch machinery for one packet), else to this one.
        """
        self.batch_subscribers[int(kind)] = handler

    def unsubscribe(self, kind: int) -> None:
        self.subscribers.pop(int(kind), None)
        self.batch_subscribers.pop(int(kind), None)

    # ------------------------------------------------------------------ sending
    def send(
        self,
        peer_id: str,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
        *,
        group_bytes: int = 0,
    ) -> bool:
        """Fire-and-forget one packet to ``peer_id``; False if it was dropped locally.

        Node and membership kinds (below ``LossyKind.RS_DATA``) are sent ``urgent``: they
        never wait behind paced data, so heartbeats keep failure detection honest on
        a slow link however much data is queued.  ``group_bytes``: see
        :meth:`send_frames`.
        """
        address = self.membership.address_of(peer_id) if self.membership else None
        if address is None or self.transport is None or self.closed:
            return False
        if peer_id not in self.codec.keys.by_id:  # not introduced yet: it would drop it
            self.codec.unkeyed += 1
            return False
        local = self.transport.is_local(address)
        frames = self.codec.encode(kind, fields, payload, local=local, dst=peer_id)
        if kind < _FIRST_DATA_KIND:
            return self._send_control(address, frames)
        if group_bytes:
            return self.transport.send(address, frames, group_bytes=group_bytes)
        return self.transport.send(address, frames)

    def _send_control(self, address: str, frames: list[Buffer]) -> bool:
        """A node-control packet, ``urgent`` (ahead of queued data), counted if accepted."""
        assert self.transport is not None
        if not self.transport.send(address, frames, urgent=True):
            return False
        self.control_packets += 1
        self.control_bytes += sum(len(f) for f in frames)  # the codec's frames: bytes
        return True

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
        The packet carries a tag for each of ``peer_ids`` under our pair key: send
        these frames to those peers only (any other drops them).
        """
        local, dst = self._destination(peer_ids)
        return self.codec.encode(kind, fields, payload, local=local, dst=dst)

    def _destination(self, peer_ids: Sequence[str]) -> tuple[bool, str | Sequence[str]]:
        """(every one of ``peer_ids`` is on a local channel, the packet's ``dst``)."""
        transport, members = self.transport, self.membership
        local = (
            transport is not None
            and members is not None
            and bool(peer_ids)
            and all(transport.is_local(members.address_of(p) or "") for p in peer_ids)
        )
        return local, peer_ids[0] if len(peer_ids) == 1 else peer_ids

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
        if self.transport is None or self.closed or not peer_ids:
            return 0
        return self.send_frames(peer_ids, self.encode_for(peer_ids, kind, fields, payload))

    def send_frames(
        self, peer_ids: Sequence[str], frames: list[Buffer], *, group_bytes: int = 0
    ) -> int:
        """Send already encoded ``frames`` to each of ``peer_ids``; how many were accepted.

        A second send of the same frames is the same packet (same sequence
        number): a receiver that got the first copy drops the second as a replay,
        which is what redundant copies (``Config.redundancy``) rely on.

        ``group_bytes``: the packet is one of a collective round's, whose largest
        payload is this many bytes (``Transport.send``); every packet of the round,
        data, ENDs, parity and repairs alike, passes the same value, so a
        transport with two channels to a peer keeps the round on one of them.
        """
        if self.transport is None or self.closed:
            return 0
        members = self.membership
        if members is None:
            return 0
        addresses = [a for p in peer_ids if (a := members.address_of(p)) is not None]
        if group_bytes:
            return self.transport.send_each(addresses, frames, group_bytes=group_bytes)
        return self.transport.send_each(addresses, frames)

    def encode_run(
        self,
        peer_ids: Sequence[str],
        kind: int,
        common: Mapping[str, Any],
        rows: Sequence[tuple[int, int, int]],
        payloads: Sequence[Buffer],
        *,
        chunk_key: str = "c",
    ) -> list[list[Buffer]]:
        """:meth:`encode_for` of a run of data (or parity) packets
        (``WireCodec.encode_run``): the same packets, the locality test made once."""
        local, dst = self._destination(peer_ids)
        return self.codec.encode_run(
            kind, common, rows, payloads, local=local, dst=dst, chunk_key=chunk_key
        )

    def send_batch(
        self, peer_ids: Sequence[str], packets: Sequence[list[Buffer]], *, group_bytes: int = 0
    ) -> int:
        """:meth:`send_frames` of each of ``packets``, handed to the transport per
        destination as a run (``Transport.send_batch``); how many were accepted."""
        if self.transport is None or self.closed or not packets:
            return 0
        send_batch, sent = self.transport.send_batch, 0
        for peer_id in peer_ids:
            address = self.membership.address_of(peer_id) if self.membership else None
            if address is not None:
                if group_bytes:
                    sent += send_batch(address, packets, group_bytes=group_bytes)
                else:
                    sent += send_batch(address, packets)
        return sent

    def send_to_address(
        self,
        address: str,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
        *,
        dst: str | None = None,
        intro: bool = False,
    ) -> bool:
        """Send one packet to ``address``, for peer ``dst`` (signed with our pair key).

        ``intro``: an introduction, signed with the run key (``WireCodec.encode``);
        ``dst`` may then be None: the peer's id is not known yet, as for a HELLO to
        a bootstrap address.  Without ``intro`` a ``dst`` whose key we do not hold
        sends nothing (False).
        """
        if self.transport is None or self.closed:
            return False
        if not intro and (dst is None or dst not in self.codec.keys.by_id):
            self.codec.unkeyed += 1
            return False
        frames = self.codec.encode(kind, fields, payload, dst=dst, intro=intro)
        if kind < _FIRST_DATA_KIND:
            return self._send_control(address, frames)
        return self.transport.send(address, frames)

    # ------------------------------------------------------------------ receiving
    def on_frames(self, frames: list[memoryview]) -> None:
        """The transport's callback: decode, refresh liveness, dispatch by kind.

        A handler that raises is logged; the receive path goes on for every other
        packet.
        """
        pkt = self.codec.decode(frames, local=type(frames) is LocalFrames)
        if pkt is None or self.closed or self.membership is None or not self._admit(pkt):
            return
        if pkt.kind not in self.subscribers and (batch := self.batch_subscribers.get(pkt.kind)):
            self._call_batch(batch, [pkt])
            return
        self._call(pkt)

    def on_batch(self, batch: Sequence[list[memoryview]]) -> None:
        """A backend's callback for what one drain of its socket delivered, in order.

        Each packet is decoded and authenticated on its own (:meth:`WireCodec.decode_batch`);
        runs of consecutive packets for one batch subscriber go to it in one call, so
        the lossy engine adds a drain's chunks with a few tensor operations.
        """
        pkts = self.codec.decode_batch(batch)
        if self.closed or self.membership is None:
            return
        run: list[Packet] = []
        run_handler: BatchCallback | None = None
        now = self.clock.now()
        alive: set[tuple[str, int]] = set()  # whose liveness this drain refreshed
        for pkt in pkts:
            if pkt is None or not self._admit(pkt, now, alive):
                continue
            handler = self.batch_subscribers.get(pkt.kind)
            if run and handler is not run_handler:
                self._call_batch(run_handler, run)  # type: ignore[arg-type]
                run = []
            if handler is None:
                self._call(pkt)
                alive.clear()  # a control packet may have changed the membership
            else:
                run_handler = handler
                run.append(pkt)
        if run:
            self._call_batch(run_handler, run)  # type: ignore[arg-type]

    def _admit(
        self, pkt: Packet, now: float | None = None, alive: set[tuple[str, int]] | None = None
    ) -> bool:
        """Refresh liveness on a fresh directed packet; False if a request filter drops it.

        The packet's ``addr`` (node-control kinds only: where the sender listens) moves
        that sender's address: the packet is authenticated as the sender's own, so a
        member can redirect only its own traffic.

        ``now``/``alive``: a drain's time and the (sender, epoch) pairs it already
        refreshed, so a drain of a sender's data packets refreshes it once (the
        same call each time: no address, the same time) instead of per packet.
        """
        if pkt.fresh and pkt.directed:  # evidence of life now, not a late or stray copy
            addr = pkt.fields.get("addr") if pkt.kind < _FIRST_DATA_KIND else None
            address = addr if valid_address(addr) else None
            key = (pkt.src, pkt.epoch)
            if address is not None or alive is None or key not in alive:
                self.membership.heard_from(  # type: ignore[union-attr]
                    pkt.src, pkt.epoch, address, self.clock.now() if now is None else now
                )
                if alive is not None and address is None:
                    alive.add(key)
        rid = pkt.fields.get("rq")
        return rid is None or pkt.kind == NodeKind.ACK or self.accept_request(pkt, rid)

    def _call(self, pkt: Packet) -> None:
        handler = self.subscribers.get(pkt.kind)
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

    def _call_batch(self, handler: BatchCallback, pkts: list[Packet]) -> None:
        try:
            handler(pkts)
        except Exception:
            log.exception(
                "peer %s: batch handler for kind %d failed on %d packet(s)",
                self.peer_id,
                pkts[0].kind,
                len(pkts),
            )
