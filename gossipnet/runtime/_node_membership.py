"""A node's membership protocol: hello, views, heartbeats, leaving, waiting for peers.

:class:`NodeMembership` sits between the packet I/O (:mod:`gossipnet.runtime._node_io`)
and :class:`gossipnet.runtime.node.Node`.  Who is alive is decided by
:class:`gossipnet.runtime.membership.Membership` from the packets that arrive; this
layer produces those packets: a HELLO to every bootstrap address and newly
learned peer, a HEARTBEAT carrying our view (and the engines' beacons) every
interval, a LEAVE on close; and it answers them.  Why apart from the I/O: it
runs on its own timer, never on the per-packet data path.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import msgpack

from gossipnet.runtime._node_io import NodeIO, PacketCallback
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import MembershipCallback
from gossipnet.transport.wire import Packet

__all__ = ("NodeMembership",)

_MAX_VIEW_ENTRIES = 4096
#: Int beacon values are in [0, BEACON_LIMIT): far from int64's end, so no counter
#: taken from a beacon overflows what msgpack can encode.  (Other types, e.g. a
#: bytes digest, are bounded by the header size and pass.)
BEACON_LIMIT = 1 << 62

#: The node's records keep its logger name, whichever of its modules emits them.
log = logging.getLogger("gossipnet.runtime.node")


class NodeMembership(NodeIO):
    """Membership messages and the heartbeat loop over :class:`NodeIO` (the base of ``Node``)."""

    #: small fields (ints, short lists) every heartbeat carries; see ``_node.Node``.
    beacon: dict[str, Any]
    heartbeat_errors: collections.Counter[str]
    _bootstrap: list[str]
    _heartbeat_listeners: list[PacketCallback]

    def _on_hello(self, pkt: Packet) -> None:
        """Answer a HELLO: with our view if it names us, else with a HELLO that does.

        Why two steps for a HELLO sent to a bare address: it names no destination,
        so anyone could replay it to anyone; it makes us probe the sender (whose
        answer, addressed to us, is what marks it alive), never marks it alive.
        """
        addr = pkt.fields.get("addr")
        if not isinstance(addr, str) or self.membership is None:
            return
        if not pkt.directed:
            self.membership.learned(pkt.src, addr, self.clock.now())
            self.send_to_address(addr, NodeKind.HELLO, {"addr": self.address}, dst=pkt.src)
            return
        view = self._view_payload()
        self.send_to_address(addr, NodeKind.HELLO_ACK, {"addr": self.address}, view, dst=pkt.src)

    def on_heartbeat(self, callback: PacketCallback) -> None:
        """Also call ``callback`` with every heartbeat (to read others' beacons)."""
        self._heartbeat_listeners.append(callback)

    def _on_view(self, pkt: Packet) -> None:
        if pkt.kind == NodeKind.HEARTBEAT:
            if _beacon_ok(pkt):
                for cb in self._heartbeat_listeners:
                    cb(pkt)
            else:  # a huge round number would spread to every engine that reads it
                self.codec.rejects["beacon_range"] += 1
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
                and self.membership.learned(entry[0], entry[1], self.clock.now())
            ):
                self.send_to_address(entry[1], NodeKind.HELLO, {"addr": self.address}, dst=entry[0])

    def _on_leave(self, pkt: Packet) -> None:
        if self.membership is None or not pkt.directed:
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

    def _redial_the_dead(self, event: str, peer_id: str) -> None:
        """Close our sockets to a peer declared dead (or restarted); a later send redials.

        Why: a socket keeps dialing the path it chose when it opened.  A peer
        restarted on the same address may be reachable another way now (its
        same-host alias gone, or new), and probing again on the next send finds
        out; packets still queued for the dead process are lost anyway.
        """
        if event != "died" or self._closed or self.transport is None or self.membership is None:
            return
        address = self.membership.address_of(peer_id)
        if address is not None:
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
        """Expire the silent, probe the dead, announce ourselves; never dies of one beat.

        Why the guard: failure detection for the whole peer hangs on this task.  A
        beat that fails (a bad beacon value, a transport error) is counted in
        ``heartbeat_errors`` and logged, and the next interval tries again.
        """
        assert self.membership is not None
        interval = self.config.heartbeat_interval_s
        await self._connect_bootstrap()
        while not self._closed:
            try:
                self._beat()
            except Exception:
                self.heartbeat_errors["exception"] += 1
                if self.heartbeat_errors["exception"] in (1, 10, 100, 1000):
                    log.exception("peer %s: a heartbeat failed (going on)", self.peer_id)
            await self.clock.sleep(interval / 2 if self.membership.version == 0 else interval)

    def _beat(self) -> None:
        """One heartbeat interval's work (see :meth:`_heartbeat_loop`)."""
        assert self.membership is not None
        now = self.clock.now()
        self.membership.expire(now)
        for address in self.membership.prune(now, 10 * self.config.failure_timeout_s):
            self._forget(address)
        view = self._view_payload()
        beat: dict[str, object] = {"addr": self.address}
        for key, value in self.beacon.items():
            if not isinstance(value, int) or (type(value) is int and 0 <= value < BEACON_LIMIT):
                beat[key] = value
            else:  # an engine's bug or a value taken from a forged packet: not sent
                self.heartbeat_errors["beacon_range"] += 1
                if self.heartbeat_errors["beacon_range"] == 1:
                    log.error(
                        "peer %s: beacon %s=%r out of range; not sent", self.peer_id, key, value
                    )
        for info in self.membership.known():
            if info.alive:
                self.send_to_address(info.address, NodeKind.HEARTBEAT, beat, view, dst=info.peer_id)
            else:
                self.send_to_address(
                    info.address, NodeKind.HELLO, {"addr": self.address}, dst=info.peer_id
                )
        known_addresses = {p.address for p in self.membership.known() if p.alive}
        for address in self._bootstrap:
            if address not in known_addresses:
                self.send_to_address(address, NodeKind.HELLO, {"addr": self.address})

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


def _beacon_ok(pkt: Packet) -> bool:
    """Every int beacon field of a heartbeat is in [0, BEACON_LIMIT) (bools refused)."""
    return all(
        type(value) is int and 0 <= value < BEACON_LIMIT
        for value in pkt.fields.values()
        if isinstance(value, int)
    )
