"""Moshpit matchmaking: leading, following, failing over; the packet handlers.

The protocol is described in :mod:`gossipnet.collectives.moshpit.averager`; this module
is its state machine, split off to keep modules small.  :class:`Matchmaking`
is a mixin of :class:`~gossipnet.collectives.moshpit.averager.MoshpitAverager` and uses
the attributes its constructor sets (``node``, ``_cfg``, ``_cur``, ...).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack

from gossipnet.collectives.moshpit.engine import members_of, wait_any
from gossipnet.collectives.moshpit.grid import leader_rank
from gossipnet.collectives.moshpit.kinds import MoshpitKind
from gossipnet.collectives.moshpit.options import MoshpitConfig
from gossipnet.transport.wire import Packet

if TYPE_CHECKING:
    from gossipnet.runtime.node import Node

__all__ = ("Matchmaking",)

log = logging.getLogger("gossipnet.collectives.moshpit.averager")

_MAX_EARLY = 4096  # buffered JOINs for rounds we have not reached


@dataclass
class _Assembly:
    """A leader's group in the making."""

    t: int
    start: float
    expected: set[str]
    cap: int
    joined: dict[str, float] = field(default_factory=dict)  # member -> when it gives up
    first: float | None = None
    last: float | None = None
    closed: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Current:
    """This peer's matchmaking in round ``t``."""

    t: int
    leader: str  # whom we follow now (ourselves when leading)
    assembly: _Assembly | None = None  # set once we lead
    pending: list[tuple[Packet, float]] = field(default_factory=list)  # JOINs while following


class Matchmaking:
    """Group assembly for one round, and every Moshpit control packet."""

    node: Node
    next_round: int
    max_seen: int
    beacons: dict[str, int]
    _cfg: MoshpitConfig
    _cur: _Current | None
    _early: collections.defaultdict[int, list[tuple[Packet, float]]]
    _replies: dict[tuple[int, str], Packet]
    _reply_wake: asyncio.Event
    _spreads: collections.deque[float]
    _newcomers: set[str]

    async def _lead(self, t: int, expected: list[str], cap: int, deadline: float) -> list[str]:
        """Collect joiners until the planned ones are in (or dead, or late); confirm."""
        node, clock, me, cfg = self.node, self.node.clock, self.node.peer_id, self._cfg
        cur = self._cur
        assert cur is not None
        asm = cur.assembly = _Assembly(t, clock.now(), set(expected), cap)
        cur.leader = me
        pending, cur.pending = cur.pending, []
        for pkt, arrived in pending:
            self._admit(asm, pkt, arrived)
        invite_at = asm.start + cfg.join_min_wait_s
        while True:
            alive = node.membership.is_alive if node.membership else (lambda _p: True)
            pending_ids = {p for p in asm.expected if p not in asm.joined and alive(p)}
            now = clock.now()
            if not pending_ids or now >= deadline:
                break
            if now >= invite_at:
                # planned members that are busy elsewhere this round (their view put
                # them in another group) say so, instead of being waited for; asked
                # again now and then, as one may only have reached the round since
                for p in pending_ids:
                    node.send(p, MoshpitKind.GROUP, {"t": t, "st": "invite"})
                invite_at = now + max(cfg.join_min_wait_s, cfg.matchmaking_timeout_s / 10)
            # Nobody joined yet: we may simply be early (compute skew), so wait up to the
            # deadline.  Once someone joined, the rest get the learned allowance, and we
            # never keep a joiner past the moment it said it gives up.
            cut = min(deadline, invite_at)
            if asm.joined:
                cut = min(cut, min(asm.joined.values()))
                if self._spreads and asm.first is not None:
                    typical = statistics.median(self._spreads)
                    allowance = max(cfg.join_min_wait_s, cfg.join_wait_factor * typical)
                    cut = min(cut, asm.first + allowance)
            if now >= cut:
                break
            asm.wake.clear()
            await wait_any(clock, [asm.wake.wait()], cut - now)
        asm.closed = True
        now = clock.now()
        if asm.expected <= set(asm.joined) and asm.last is not None and asm.first is not None:
            self._spreads.append(asm.last - asm.first)
        # a joiner whose stated give-up time passed has moved on: listing it would cost
        # its slice (half the margin absorbs timer granularity at our own cut)
        late = now - cfg.reply_margin_s / 2
        members = sorted({me} | {q for q, gives_up in asm.joined.items() if gives_up >= late})
        payload = msgpack.packb(members)
        for q in members:
            if q != me:
                self._reply(q, {"t": t, "st": "ok"}, payload)
        log.debug("peer %s: round %d leads %s", me, t, members)
        return members

    async def _follow(
        self, t: int, before: list[str], after: list[str], cap: int, deadline: float
    ) -> tuple[list[str], int]:
        """Join the first live member ranked before us; lead the rest if none is left.

        "Live" is what its node says: a JOIN that is not acknowledged within
        ``ack_timeout_s`` (or a member membership declares dead) is presumed
        failed, and the next-ranked member takes over.  A member that
        acknowledges is alive and is waited for until the deadline: it may
        just be a little behind (compute skew), and group rounds are what keeps
        peers in step, so an alive leader is not abandoned.
        """
        clock, me, cfg = self.node.clock, self.node.peer_id, self._cfg
        cur = self._cur
        assert cur is not None
        give_up = deadline + 2 * cfg.reply_margin_s
        failovers = 0
        for candidate in before:
            if clock.now() >= deadline:
                break
            outcome, members = await self._join(t, candidate, give_up)
            if outcome == "ok":
                self._settle_pending(cur, "redirect")
                return members, failovers
            if outcome != "lost":
                break
            failovers += 1
            log.debug("peer %s: round %d: leader %s is gone, next one", me, t, candidate)
        else:
            if after and clock.now() < deadline:
                return await self._lead(t, after, cap, deadline), failovers
        self._settle_pending(cur, "refuse")
        return [me], failovers

    async def _join(self, t: int, target: str, stop: float) -> tuple[str, list[str]]:
        """JOIN ``target`` (following redirects to earlier-ranked peers) until ``stop``.

        Returns ("ok", members), ("refuse", []) (refused, or no answer in time),
        or ("lost", []): ``target`` never acknowledged or died.
        """
        node, clock, me, cfg = self.node, self.node.clock, self.node.peer_id, self._cfg
        seed, cur = node.config.run, self._cur
        assert cur is not None
        for _hop in range(4):
            ttl = stop - clock.now()
            if ttl <= 0:
                break
            cur.leader = target
            fields = {"t": t, "ttl": ttl}
            send = asyncio.ensure_future(
                node.send_reliable(target, MoshpitKind.JOIN, fields, timeout_s=cfg.ack_timeout_s)
            )
            try:
                reply = await self._await_reply(t, target, send, stop)
            finally:
                send.cancel()
            if reply is None:
                alive = node.membership is None or node.membership.is_alive(target)
                acked = send.done() and not send.cancelled() and send.result() is True
                return ("refuse" if acked and alive else "lost"), []
            status, nxt = reply.fields.get("st"), reply.fields.get("to")
            if status == "ok":
                members = members_of(reply.payload)
                return ("ok", members) if me in members else ("refuse", [])
            if (
                status != "redirect"
                or not isinstance(nxt, str)
                or nxt == me
                or leader_rank(seed, t, nxt) >= leader_rank(seed, t, target)
            ):
                return "refuse", []
            target = nxt
        return "refuse", []

    async def _await_reply(
        self, t: int, target: str, send: asyncio.Future[bool], stop: float
    ) -> Packet | None:
        clock, membership = self.node.clock, self.node.membership
        while True:
            reply = self._replies.pop((t, target), None)
            if reply is not None:
                return reply
            if send.done() and (send.cancelled() or send.exception() or not send.result()):
                return None  # never acknowledged: gone or unreachable
            if membership is not None and not membership.is_alive(target):
                return None
            now = clock.now()
            if now >= stop:
                return None
            self._reply_wake.clear()
            waits: list[Awaitable[object]] = [self._reply_wake.wait()]
            if not send.done():
                waits.append(send)
            await wait_any(clock, waits, stop - now)

    def _announce(self, t: int) -> None:
        """Tell every alive peer we are at round ``t`` (after a restart or a jump):
        they plan us in from their next round instead of after our next heartbeat."""
        for p in self.node.alive_peers():
            if p != self.node.peer_id:
                self.node.send(p, MoshpitKind.GROUP, {"t": t, "st": "here"})

    # ------------------------------------------------------------------ receiving
    def _reply(self, peer: str, fields: dict[str, object], payload: bytes = b"") -> None:
        send = self.node.send_reliable(
            peer, MoshpitKind.GROUP, fields, payload, timeout_s=self._cfg.matchmaking_timeout_s
        )
        self.node.spawn(send, "moshpit-reply")

    def _saw(self, t: int) -> None:
        if t > self.max_seen:
            self.max_seen = t

    def _on_join(self, pkt: Packet) -> None:
        t, ttl = pkt.fields.get("t"), pkt.fields.get("ttl")
        if type(t) is not int or not isinstance(ttl, int | float) or t < 0:
            return
        self._saw(t)
        self.beacons[pkt.src] = max(t, self.beacons.get(pkt.src, t))  # it is at round t
        self._newcomers.discard(pkt.src)
        cur, now = self._cur, self.node.clock.now()
        if cur is not None and cur.t == t:
            if cur.assembly is not None:
                self._admit(cur.assembly, pkt, now)
            else:  # answered once our own leader answers us or is presumed failed
                cur.pending.append((pkt, now))
        elif t > (cur.t if cur is not None else self.next_round - 1):
            if sum(map(len, self._early.values())) < _MAX_EARLY:
                self._early[t].append((pkt, now))
        else:
            self._reply(pkt.src, {"t": t, "st": "refuse"})

    def _admit(self, asm: _Assembly, pkt: Packet, arrived: float) -> None:
        """A JOIN for the group we lead (``arrived``: when it reached us)."""
        now = self.node.clock.now()
        gives_up = arrived + float(pkt.fields["ttl"]) - self._cfg.reply_margin_s
        if asm.closed:
            if asm.first is not None:  # a late member: allow more next time
                self._spreads.append(now - asm.first)
            self._reply(pkt.src, {"t": asm.t, "st": "refuse"})
        elif gives_up < now - self._cfg.reply_margin_s / 2:
            return  # it has moved on (to another candidate, or alone)
        elif pkt.src not in asm.joined and len(asm.joined) + 1 >= asm.cap:
            self._reply(pkt.src, {"t": asm.t, "st": "refuse"})
        else:
            asm.joined[pkt.src] = gives_up
            asm.first = now if asm.first is None else asm.first
            if pkt.src in asm.expected:
                asm.last = now
            asm.wake.set()

    def _settle_pending(self, cur: _Current, how: str) -> None:
        """Answer the JOINs that came while we were following: redirect or refuse."""
        pending, cur.pending = cur.pending, []
        for pkt, _ in pending:
            if how == "redirect":
                self._reply(pkt.src, {"t": cur.t, "st": "redirect", "to": cur.leader})
            else:
                self._reply(pkt.src, {"t": cur.t, "st": "refuse"})

    def _on_group(self, pkt: Packet) -> None:
        t, status = pkt.fields.get("t"), pkt.fields.get("st")
        if type(t) is not int:
            return
        cur = self._cur
        if status == "invite":
            engaged = cur is not None and cur.t == t and cur.leader != pkt.src
            if engaged or t < (cur.t if cur is not None else self.next_round):
                self.node.send(pkt.src, MoshpitKind.GROUP, {"t": t, "st": "busy"})
            return  # not at round t yet: the inviter may still see us join
        if status == "here":
            self._saw(t)
            self.beacons[pkt.src] = max(t, self.beacons.get(pkt.src, t))
            self._newcomers.discard(pkt.src)
            return
        if status == "busy":
            if cur is not None and cur.t == t and cur.assembly is not None:
                cur.assembly.expected.discard(pkt.src)
                cur.assembly.wake.set()
            return
        if t < self.next_round:
            return
        self._replies[(t, pkt.src)] = pkt
        self._reply_wake.set()

    def _on_heartbeat(self, pkt: Packet) -> None:
        t = pkt.fields.get("mpt")
        if type(t) is int:
            self._saw(t)
            self.beacons[pkt.src] = t
            if t > 0:
                self._newcomers.discard(pkt.src)

    def _on_membership(self, event: str, peer: str) -> None:
        if event == "joined":
            if self.next_round > 0:  # a restart or a late joiner: planned in once it averages
                self._newcomers.add(peer)
            return
        self.beacons.pop(peer, None)
        cur = self._cur
        if cur is not None and cur.assembly is not None:
            cur.assembly.wake.set()  # a planned member died: stop waiting for it
        self._reply_wake.set()  # a leader died: fail over now
