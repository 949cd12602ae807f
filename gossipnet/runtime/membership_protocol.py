"""A node's membership protocol: hello, views, heartbeats, leaving, waiting for peers.

Who is alive is decided by :class:`gossipnet.runtime.membership.Membership` from the
packets that arrive (the packet I/O feeds it); :class:`MembershipProtocol` produces
and answers the packets that keep it right: a HELLO to every bootstrap address and
newly learned peer, a HEARTBEAT carrying our view (and the engines' beacons) every
interval, a LEAVE on close.

The handshake.  A HELLO is an *introduction*: signed with the run key, it carries
the sender's address and public key (``pk``) and whether it answers one (``re``).
Its receiver binds the sender's id to that key if :class:`~.admission.Admission`
allows, answers a first HELLO with its own (so the sender can bind ours) and, once
both hold each other's key, a HELLO_ACK with its view under the pair's key.  Only
packets under a peer's own key make it alive, move its address or announce its
departure; an introduction is anyone's claim and changes none of these.

Why apart from the packet I/O (:mod:`gossipnet.runtime.dispatch`): it runs on its own
timer and on control kinds only, never on the per-packet data path, and it is tested
alone over a :class:`~gossipnet.runtime.dispatch.PacketIO` on a memory network.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from typing import Any

import msgpack

from gossipnet.config import Config
from gossipnet.runtime.admission import Admission
from gossipnet.runtime.dispatch import PacketCallback, PacketIO
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.membership import Membership, MembershipCallback
from gossipnet.runtime.reliable import wait_future
from gossipnet.transport.address import valid_address
from gossipnet.transport.wire import Packet

__all__ = ("BEACON_LIMIT", "MembershipProtocol")

_MAX_VIEW_ENTRIES = 4096
#: A peer's HELLO is answered at most once per this share of the heartbeat interval
#: (anyone can replay an introduction; each answer costs us two packets).
_REPLY_SHARE = 0.25
#: Int beacon values are in [0, BEACON_LIMIT): far from int64's end, so no counter
#: taken from a beacon overflows what msgpack can encode.  (Other types, e.g. a
#: bytes digest, are bounded by the header size and pass.)
BEACON_LIMIT = 1 << 62

#: The node's records keep its logger name, whichever of its modules emits them.
log = logging.getLogger("gossipnet.runtime.node")


class MembershipProtocol:
    """Hello, views, heartbeats and leaving over ``io``; runs on the loop thread.

    Args:
        io: the packet I/O (it must be bound: :meth:`start` reads its address).
        config: heartbeat interval, failure timeout, control timeouts.
        bootstrap: addresses to HELLO until they answer.
    """

    def __init__(self, io: PacketIO, config: Config, bootstrap: Sequence[str] = ()) -> None:
        self.io = io
        self.config = config
        self.clock = io.clock
        self.bootstrap = list(dict.fromkeys(bootstrap))
        #: small int fields every heartbeat carries (e.g. an engine's next round), so
        #: peers that just joined or restarted learn where the others are.
        self.beacon: dict[str, Any] = {}
        #: heartbeats that failed or beacon values withheld, by reason
        self.heartbeat_errors: collections.Counter[str] = collections.Counter()
        self._heartbeat_listeners: list[PacketCallback] = []
        #: when the next beat is due; a beat much later than that means our loop
        #: stalled (see :meth:`Membership.excuse`)
        self._due: float | None = None
        # Only a stall that could make a live peer look dead is excused: one longer
        # than half of what the failure timeout leaves beyond a heartbeat interval
        # (a peer's silence is at most the stall plus an interval and its jitter).
        # Excusing every late beat would delay the detection of real deaths on a
        # loaded machine by however late our beats run.
        interval, timeout = config.heartbeat_interval_s, config.failure_timeout_s
        self._stall_threshold_s = max(interval, (timeout - interval) / 2)
        #: beats that found our loop stalled, and the seconds excused in all
        self.stalls = 0
        self.stalled_s = 0.0
        #: the binding rule of introductions (set by :meth:`start`)
        self.admission: Admission | None = None
        self._replied: dict[str, float] = {}  # peer id -> when we last answered its HELLO

    def start(self) -> Membership:
        """Create the alive view for ``io.address``, hand it to ``io`` and answer
        membership packets from now on; the view.  (The caller runs
        :meth:`heartbeat_loop` as a task.)"""
        io = self.io
        self.bootstrap = [a for a in self.bootstrap if a != io.address]
        members = Membership(
            io.peer_id, io.address, self.config.failure_timeout_s, self.config.max_peers
        )
        members.on_change(self._redial_the_dead)
        io.membership = members
        self.admission = Admission(
            io.codec, self.config, self.clock, members.is_alive, members.left_epoch
        )
        io.subscribe(NodeKind.HELLO, self._on_hello)
        io.subscribe(NodeKind.HELLO_ACK, self._on_view)
        io.subscribe(NodeKind.HEARTBEAT, self._on_view)
        io.subscribe(NodeKind.LEAVE, self._on_leave)
        return members

    # ------------------------------------------------------------------ answering
    def _on_hello(self, pkt: Packet) -> None:
        """An introduction: bind its key if the rule allows, then answer (rate-limited).

        A first HELLO (``re`` false) is answered with ours, so its sender can bind our
        key, and, where both keys are bound, with a HELLO_ACK under the pair's key:
        what makes us alive at the sender.  A HELLO that answers ours gets only the
        HELLO_ACK.  Answers go to the address we hold for the peer: once it is alive,
        only its own packets move that address, whatever an introduction says.
        """
        io, members, admission = self.io, self.io.membership, self.admission
        fields = pkt.fields
        addr, public = fields.get("addr"), fields.get("pk")
        if members is None or admission is None or pkt.directed:
            return
        if not valid_address(addr):
            io.codec.rejects["hello_fields"] += 1
            return
        assert isinstance(addr, str)
        outcome = admission.introduce(pkt.src, pkt.epoch, public)
        if outcome in ("new", "rebound"):
            members.bound(pkt.src, pkt.epoch, addr, self.clock.now())
        elif outcome != "same":
            return
        now = self.clock.now()
        last = self._replied.get(pkt.src)
        if last is not None and 0 <= now - last < _REPLY_SHARE * self.config.heartbeat_interval_s:
            return
        if len(self._replied) > 4 * self.config.max_peers:
            self._replied.clear()
        self._replied[pkt.src] = now
        reply_to = members.address_of(pkt.src) or addr
        if fields.get("re") is not True:
            io.send_to_address(reply_to, NodeKind.HELLO, self._hello(True), dst=pkt.src, intro=True)
        view = self._view_payload()
        io.send_to_address(reply_to, NodeKind.HELLO_ACK, {"addr": io.address}, view, dst=pkt.src)

    def _hello(self, answer: bool) -> dict[str, object]:
        """Our introduction's fields: address, public key, whether it answers one."""
        return {"addr": self.io.address, "pk": self.io.codec.identity.public, "re": answer}

    def on_heartbeat(self, callback: PacketCallback) -> None:
        """Also call ``callback`` with every heartbeat (to read others' beacons)."""
        self._heartbeat_listeners.append(callback)

    def _on_view(self, pkt: Packet) -> None:
        io = self.io
        if pkt.kind == NodeKind.HEARTBEAT:
            if _beacon_ok(pkt):
                for cb in self._heartbeat_listeners:
                    cb(pkt)
            else:  # a huge round number would spread to every engine that reads it
                io.codec.rejects["beacon_range"] += 1
        if not pkt.payload or io.membership is None:
            return
        try:
            view = msgpack.unpackb(
                pkt.payload,
                max_array_len=min(_MAX_VIEW_ENTRIES, self.config.max_peers),
                max_str_len=1024,
                max_bin_len=0,
                max_map_len=0,
                max_ext_len=0,
            )
        except Exception:
            io.codec.rejects["view_parse"] += 1
            return
        if not isinstance(view, list):
            io.codec.rejects["view_parse"] += 1
            return
        now, hello = self.clock.now(), self._hello(False)
        for entry in view:
            if (
                isinstance(entry, list)
                and len(entry) == 2
                and isinstance(entry[0], str)
                and 0 < len(entry[0]) <= 256
                and valid_address(entry[1])
                and io.membership.learned(entry[0], entry[1], now)
            ):
                io.send_to_address(entry[1], NodeKind.HELLO, hello, dst=entry[0], intro=True)

    def _on_leave(self, pkt: Packet) -> None:
        io = self.io
        if io.membership is None or not pkt.directed:
            return
        address = io.membership.address_of(pkt.src)
        io.membership.left(pkt.src, pkt.epoch)
        io.codec.forget(pkt.src)
        # after a grace period: the ACK of this LEAVE is still to be sent under its key
        grace = min(self.config.control_timeout_s, 10 * self.config.control_retry_s)
        self.clock.call_later(grace, lambda: self._forget(address, pkt.src, pkt.epoch))

    def _forget(self, address: str | None, peer_id: str | None = None, epoch: int = -1) -> None:
        """Release the transport's per-destination resources unless a peer uses it again,
        and ``peer_id``'s keys if they are still those of incarnation ``epoch``."""
        io = self.io
        if io.closed or io.transport is None or io.membership is None:
            return
        session = io.codec.keys.by_id.get(peer_id) if peer_id is not None else None
        if session is not None and session.epoch <= epoch and not session.pinned:
            io.codec.unbind(session.peer_id)
        if address is None or any(p.address == address for p in io.membership.known()):
            return
        io.transport.forget(address)

    def _redial_the_dead(self, event: str, peer_id: str) -> None:
        """Close our sockets to a peer declared dead (or restarted); a later send redials.

        Why: a socket keeps dialing the path it chose when it opened.  A peer
        restarted on the same address may be reachable another way now (its
        same-host alias gone, or new), and probing again on the next send finds
        out; packets still queued for the dead process are lost anyway.
        """
        io = self.io
        if event != "died" or io.closed or io.transport is None or io.membership is None:
            return
        address = io.membership.address_of(peer_id)
        if address is not None:
            io.transport.forget(address)

    def _view_payload(self) -> bytes:
        assert self.io.membership is not None
        return msgpack.packb([list(e) for e in self.io.membership.view()])

    # ------------------------------------------------------------------ announcing
    async def _connect(self, addresses: Sequence[str], timeout_s: float) -> None:
        """Wait (bounded) until our own sends to ``addresses`` would be accepted.

        Why: hearing from a peer says its socket to us is up, not ours to it; with
        ZeroMQ's ``IMMEDIATE`` the first packets would be dropped otherwise.
        Backends without lazy connections (no ``connect``) return at once.
        """
        transport = self.io.transport
        connect = getattr(transport, "connect", None) or getattr(
            getattr(transport, "inner", None), "connect", None
        )
        if connect is None or not addresses:
            return
        await asyncio.gather(*(connect(a, timeout_s) for a in addresses), return_exceptions=True)

    async def heartbeat_loop(self) -> None:
        """Expire the silent, probe the dead, announce ourselves; never dies of one beat.

        Why the guard: failure detection for the whole peer hangs on this task.  A
        beat that fails (a bad beacon value, a transport error) is counted in
        ``heartbeat_errors`` and logged, and the next interval tries again.
        """
        io = self.io
        assert io.membership is not None
        interval = self.config.heartbeat_interval_s
        # the first HELLO is not dropped: joining takes milliseconds, not an interval
        await self._connect(self.bootstrap, min(0.2, interval))
        while not io.closed:
            try:
                self._beat()
            except Exception:
                self.heartbeat_errors["exception"] += 1
                if self.heartbeat_errors["exception"] in (1, 10, 100, 1000):
                    log.exception("peer %s: a heartbeat failed (going on)", io.peer_id)
            pause = interval / 2 if io.membership.version == 0 else interval
            self._due = self.clock.now() + pause
            await self.clock.sleep(pause)

    def _beat(self) -> None:
        """One heartbeat interval's work (see :meth:`heartbeat_loop`)."""
        io, members = self.io, self.io.membership
        assert members is not None
        now = self.clock.now()
        late = now - self._due if self._due is not None else 0.0
        if late > self._stall_threshold_s:
            # our loop did not run: the others' packets wait unread, not lost
            members.excuse(late, now)
            self.stalls += 1
            self.stalled_s += late
            log.warning(
                "peer %s: our event loop stalled for %.1f s (process stopped, swapped out"
                " or starved of CPU); the other peers are not blamed for it", io.peer_id, late,
            )  # fmt: skip
        members.expire(now)
        for gone in members.prune(now, 10 * self.config.failure_timeout_s):
            self._forget(gone.address, gone.peer_id, gone.epoch)
        view = self._view_payload()
        beat: dict[str, object] = {"addr": io.address}
        for key, value in self.beacon.items():
            if not isinstance(value, int) or (type(value) is int and 0 <= value < BEACON_LIMIT):
                beat[key] = value
            else:  # an engine's bug or a value taken from a forged packet: not sent
                self.heartbeat_errors["beacon_range"] += 1
                if self.heartbeat_errors["beacon_range"] == 1:
                    log.error(
                        "peer %s: beacon %s=%r out of range; not sent", io.peer_id, key, value
                    )
        hello = self._hello(False)
        for info in members.known():
            if info.alive:
                io.send_to_address(info.address, NodeKind.HEARTBEAT, beat, view, dst=info.peer_id)
            else:
                io.send_to_address(
                    info.address, NodeKind.HELLO, hello, dst=info.peer_id, intro=True
                )
        known_addresses = {p.address for p in members.known() if p.alive}
        for address in self.bootstrap:
            if address not in known_addresses:
                io.send_to_address(address, NodeKind.HELLO, hello, intro=True)

    # ------------------------------------------------------------------ asking
    def alive_peers(self) -> list[str]:
        """Peers believed alive, sorted, us included (only us before start)."""
        members = self.io.membership
        return members.alive() if members else [self.io.peer_id]

    def on_membership(self, callback: MembershipCallback) -> None:
        """Call ``callback(event, peer_id)`` on every change (joined, left, died)."""
        assert self.io.membership is not None, "start() the node first"
        self.io.membership.on_change(callback)

    async def wait_for_peers(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` peers (self included) are alive or the deadline passes.

        Returns:
            True once they are alive (and our sockets to them connected), False at
            the deadline.
        """
        members = self.io.membership
        assert members is not None, "start() the node first"
        changed = asyncio.Event()

        def wake(_event: str, _peer: str) -> None:
            changed.set()

        members.on_change(wake)
        deadline = self.clock.now() + timeout_s
        try:
            while len(self.alive_peers()) < count:
                remaining = deadline - self.clock.now()
                if remaining <= 0:
                    return False
                changed.clear()
                waiter = asyncio.ensure_future(changed.wait())
                try:
                    await wait_future(self.clock, waiter, remaining)
                except TimeoutError:
                    pass
                finally:
                    waiter.cancel()
            addresses = (members.address_of(p) for p in self.alive_peers())
            await self._connect([a for a in addresses if a and a != self.io.address], 0.5)
            return True
        finally:
            members.off_change(wake)


def _beacon_ok(pkt: Packet) -> bool:
    """Every int beacon field of a heartbeat is in [0, BEACON_LIMIT) (bools refused)."""
    return all(
        type(value) is int and 0 <= value < BEACON_LIMIT
        for value in pkt.fields.values()
        if isinstance(value, int)
    )
