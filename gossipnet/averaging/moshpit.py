"""Moshpit averaging: group all-reduces on a virtual grid, matched without a server.

Ryabinin et al., *Moshpit SGD* (NeurIPS 2021); ALGORITHMS.md section 2.  In
round t every peer averages with the peers that share its shift-register key
(:mod:`._moshpit_grid`); with N = M^d and no faults, d rounds give every peer
the exact global mean, and with faults the spread still shrinks
geometrically, because a failure only costs its own group.

Matchmaking (hivemind uses a DHT; gossipnet has only membership views):

1. *Plan*: each peer computes the round's groups from its own view and the
   round number (pure, no message) and ranks its group's members by a
   per-round hash; the first leads.
2. *Join*: a follower sends JOIN (acknowledged, retried) to the first-ranked
   member with the seconds it will wait.  A leader waits for its planned
   members until all arrived or died, or a learned allowance
   (``join_wait_factor`` x the usual join spread) after the first one, never
   past ``matchmaking_timeout_s`` nor past the moment a joiner gives up.  It
   also takes joiners it did not plan for (their view differs), up to M.
   Planned members that have not joined after ``join_min_wait_s`` are
   invited; those busy elsewhere this round (their view differs) say so and
   are not waited for.
3. *Confirm*: the leader sends the final member list to every member; only
   that list is ever used, so all members of a group run the all-reduce with
   the same participants, and a peer runs in at most one group per round.
4. *Fail over*: a follower whose leader's node does not acknowledge the JOIN
   (or that membership declares dead) tries the next-ranked member; a peer
   whose higher-ranked members are all gone leads the rest.  JOINs it
   receives while still following wait for its own outcome (then: redirect,
   or lead them).  So no single peer's loss stops its group, only its own
   contribution; an alive but late leader is waited for (that wait is what
   keeps peers in step).

Disagreeing views resolve within the round: a peer asked to lead while it
follows redirects to its own leader, and redirects only go to peers ranked
strictly earlier, so they cannot cycle.  Every wait has a deadline on the
node's clock.  A member that gave up before its list arrived is listed but
absent: its slice keeps each member's own values (ALGORITHMS.md "a failed
reducer costs exactly its slice"), so no contribution is ever counted twice
or lost from the sum.  The group average is the loss-tolerant all-reduce
(:mod:`.allreduce`) on Moshpit's packet kinds: sum(w x) / sum(w) over the
members whose packets arrived.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

import msgpack
import torch

from .._node import Node
from ..rounds import CollectiveReport
from ..transport.wire import Kind, Packet
from ._moshpit_engine import GroupEngine, members_of, merge_reports, wait_any
from ._moshpit_grid import Grid, choose_grid, leader_rank, plan_round

__all__ = ("BEHIND_SWEEPS", "SWEEP_STRIDE", "MoshpitAverager", "MoshpitConfig", "merge_reports")

log = logging.getLogger(__name__)

_MAX_EARLY = 4096  # buffered JOINs for rounds we have not reached
#: round numbers per sweep (one call); more than any grid's d
SWEEP_STRIDE = 64
#: a peer this many sweeps behind is left out of plans (and should catch up by state);
#: one less behind is planned in, and its groups' waits pull it back in step
BEHIND_SWEEPS = 16
_HISTORY = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class MoshpitConfig:
    """Moshpit knobs (seconds in ``_s`` names).

    max_group_size: largest group M; the grid is chosen from the live peer count.
    min_fill: smallest acceptable grid fill (ALGORITHMS.md 2.3, 2.6).
    grid: force ``(M, d)`` instead (tests, benches); more peers than M^d raises.
    matchmaking_timeout_s: bound of group assembly in one round; also how much
        compute skew between peers a round absorbs (hivemind: 5-15 s).
    join_min_wait_s / join_wait_factor: a leader waits for missing members
        ``max(min, factor x median join spread)`` after the first one joined.
    ack_timeout_s: a leader whose node does not acknowledge a JOIN within this
        long is presumed gone and the next-ranked member takes over.
    reply_margin_s: time allowed for the member list to reach a member.
    round_timeout_s: bound of a group's all-reduce (None: ``Config.collective_timeout_s``).
    """

    max_group_size: int = 32
    min_fill: float = 0.75
    grid: tuple[int, int] | None = None
    matchmaking_timeout_s: float = 5.0
    join_min_wait_s: float = 0.1
    join_wait_factor: float = 3.0
    reply_margin_s: float = 0.1
    ack_timeout_s: float = 0.2
    round_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_group_size < 2 or not 0 < self.min_fill <= 1:
            raise ValueError("max_group_size must be >= 2 and min_fill in (0, 1]")
        if self.grid is not None and (self.grid[0] < 1 or self.grid[1] < 1):
            raise ValueError(f"grid must be (side >= 1, dims >= 1), got {self.grid}")
        for name in ("matchmaking_timeout_s", "join_wait_factor", "ack_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoshpitConfig.{name} must be > 0")
        if self.join_min_wait_s < 0 or self.reply_margin_s < 0:
            raise ValueError("join_min_wait_s and reply_margin_s must be >= 0")
        if self.round_timeout_s is not None and not self.round_timeout_s > 0:
            raise ValueError("round_timeout_s must be > 0 or None")


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


class MoshpitAverager:
    """Moshpit rounds for one node; every method runs on the node's loop thread."""

    def __init__(self, node: Node, config: MoshpitConfig | None = None) -> None:
        self.node = node
        self.config = config or MoshpitConfig()
        self.engine = GroupEngine(node)
        self.next_round = 0
        self.max_seen = -1
        self.last_rounds: list[CollectiveReport] = []
        #: the latest round each peer announced in its heartbeat (0: never averaged)
        self.beacons: dict[str, int] = {}
        self._cur: _Current | None = None
        self._cfg = self.config  # the running call's config
        self._early: dict[int, list[tuple[Packet, float]]] = collections.defaultdict(list)
        self._replies: dict[tuple[int, str], Packet] = {}
        self._reply_wake = asyncio.Event()
        self._spreads: collections.deque[float] = collections.deque(maxlen=_HISTORY)
        self._lock = asyncio.Lock()
        node.subscribe(Kind.MOSH_JOIN, self._on_join)
        node.subscribe(Kind.MOSH_GROUP, self._on_group)
        node.on_heartbeat(self._on_heartbeat)
        node.on_membership(self._on_membership)
        node.beacon["mpt"] = 0

    # ------------------------------------------------------------------ public
    def grid_for(self, n: int, config: MoshpitConfig | None = None) -> Grid:
        cfg = config or self.config
        if cfg.grid is not None:
            return Grid(*cfg.grid)
        return choose_grid(n, max_group_size=cfg.max_group_size, min_fill=cfg.min_fill)

    async def average(
        self,
        buckets: Sequence[torch.Tensor],
        *,
        rounds: int | None = None,
        weight: float = 1.0,
        config: MoshpitConfig | None = None,
        start_round: int | None = None,
    ) -> CollectiveReport:
        """Average ``buckets`` in place: one sweep of Moshpit rounds.

        Every call is a sweep: round numbers ``s * SWEEP_STRIDE + i`` for the
        call's sweep ``s`` and ``i = 0, 1, ...``; the next call starts sweep
        ``s + 1`` however many rounds this one ran.  Why: peers whose views
        differ for a moment choose grids of different d, so a count of rounds
        would drift apart between them; sweep numbers do not.

        Args:
            buckets: flat contiguous 1-D CPU tensors, the same layout on every peer.
            rounds: rounds to run (at most ``SWEEP_STRIDE``); None: the grid's d,
                which on a full grid yields the exact global mean.
            weight: this peer's weight in every group mean, >= 0.
            config: overrides :attr:`config` for this call.
            start_round: first round number (tests, benches: ``divmod`` by
                ``SWEEP_STRIDE`` gives sweep and offset); default :meth:`_start_round`.

        Returns:
            One merged :class:`CollectiveReport` (per-round ones in :attr:`last_rounds`).
        """
        if rounds is not None and not 1 <= rounds <= SWEEP_STRIDE:
            raise ValueError(f"rounds must be in [1, {SWEEP_STRIDE}] or None, got {rounds}")
        cfg = config or self.config
        async with self._lock:
            t = self._start_round() if start_round is None else start_round
            sweep = t - t % SWEEP_STRIDE
            todo = rounds or self.grid_for(len(self.view(t, cfg)), cfg).dims - (t - sweep)
            reports: list[CollectiveReport] = []
            for i in range(max(1, todo)):
                reports.append(await self._round(t + i, sweep, list(buckets), weight, cfg))
                self.next_round = max(self.next_round, t + i + 1)
                self.node.beacon["mpt"] = self.next_round
            if start_round is None:  # the next call is the next sweep
                self.next_round = max(self.next_round, sweep + SWEEP_STRIDE)
                self.node.beacon["mpt"] = self.next_round
            self.last_rounds = reports
            return merge_reports(reports)

    def view(self, t: int, config: MoshpitConfig | None = None) -> list[str]:
        """The peers planned into round ``t``: alive, and not far behind.

        Why the second filter: a peer that just restarted is alive (its node
        answers) long before it averages (it is still downloading state); in
        a plan it would hold its group until the deadline.  Its heartbeats
        announce the round it is at, so a peer ``BEHIND_SWEEPS`` behind is left
        out until it catches up (one heartbeat or JOIN after its first round).  A
        peer whose round we have not heard counts as at round 0: planned in at
        the start of a run, left out of a run under way.
        """
        me = self.node.peer_id
        lag = BEHIND_SWEEPS * SWEEP_STRIDE
        return [p for p in self.node.alive_peers() if p == me or self.beacons.get(p, 0) >= t - lag]

    def _start_round(self) -> int:
        """Where a call starts: our next sweep, unless the others are a whole sweep
        ahead (we restarted, or were cut off): then the round they announce.

        Why not always the highest round seen, as the all-reduce does: groups end
        their rounds at different times, so a peer a little late would see the
        next round announced and skip one its own group is still waiting for.
        """
        if self.max_seen >= self.next_round + SWEEP_STRIDE:
            return self.max_seen
        return self.next_round

    # ------------------------------------------------------------------ one round
    async def _round(
        self, t: int, sweep: int, buckets: list[torch.Tensor], weight: float, cfg: MoshpitConfig
    ) -> CollectiveReport:
        node, clock, me = self.node, self.node.clock, self.node.peer_id
        t0 = clock.now()
        view = self.view(t, cfg)
        grid = self.grid_for(len(view), cfg)
        seed = node.config.run
        ranked = sorted(
            plan_round(view, t, seed=seed, grid=grid, start=sweep).group_of(me),
            key=lambda p: leader_rank(seed, t, p),
        )
        j = ranked.index(me)
        node.beacon["mpt"] = t
        for stale in [r for r in self._early if r < t]:
            del self._early[stale]
        for key in [k for k in self._replies if k[0] < t]:
            del self._replies[key]
        self._cfg = cfg
        self._cur = _Current(t, ranked[0], pending=self._early.pop(t, []))
        cap = max(grid.side, len(ranked))
        deadline = t0 + cfg.matchmaking_timeout_s
        failovers = 0
        try:
            if j == 0:
                members = await self._lead(t, ranked[1:], cap, deadline)
            else:
                members, failovers = await self._follow(
                    t, ranked[:j], ranked[j + 1 :], cap, deadline
                )
        finally:
            # matchmaking of round t is over: later JOINs for it are refused at once
            self._cur = None
            self.next_round = max(self.next_round, t + 1)
        extra = {"group_size": float(len(members)), "leader": float(j == 0 or failovers == j)}
        extra.update(grid_side=float(grid.side), grid_dims=float(grid.dims))
        extra.update(matchmaking_s=clock.now() - t0, failovers=float(failovers))
        if len(members) < 2:
            rep = CollectiveReport(round=t, participants=(me,), contributors=(me,), extra=extra)
        else:
            timeout = cfg.round_timeout_s or node.config.collective_timeout_s
            rep = await self.engine.run_at(
                t, buckets, participants=members, weight=weight, timeout_s=timeout
            )
            rep.extra.update(extra)
        rep.method = "moshpit"
        rep.elapsed_s = clock.now() - t0
        if rep.elapsed_s > 1.0:
            log.warning(
                "SLOW peer %s round %d j=%d ranked=%s members=%s mm=%.2f total=%.2f view=%d",
                me,
                t,
                j,
                ranked,
                members,
                extra["matchmaking_s"],
                rep.elapsed_s,
                len(view),
            )
        return rep

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
        invited = False
        while True:
            alive = node.membership.is_alive if node.membership else (lambda _p: True)
            pending_ids = {p for p in asm.expected if p not in asm.joined and alive(p)}
            now = clock.now()
            if not pending_ids or now >= deadline:
                break
            if not invited and now >= asm.start + cfg.join_min_wait_s:
                # planned members that are busy elsewhere this round (their view put
                # them in another group) say so, instead of being waited for
                for p in pending_ids:
                    node.send(p, Kind.MOSH_GROUP, {"t": t, "st": "invite"})
                invited = True
            # Nobody joined yet: we may simply be early (compute skew), so wait up to the
            # deadline.  Once someone joined, the rest get the learned allowance, and we
            # never keep a joiner past the moment it said it gives up.
            cut = deadline if invited else min(deadline, asm.start + cfg.join_min_wait_s)
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
                node.send_reliable(target, Kind.MOSH_JOIN, fields, timeout_s=cfg.ack_timeout_s)
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

    # ------------------------------------------------------------------ receiving
    def _reply(self, peer: str, fields: dict[str, object], payload: bytes = b"") -> None:
        send = self.node.send_reliable(
            peer, Kind.MOSH_GROUP, fields, payload, timeout_s=self._cfg.matchmaking_timeout_s
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
                self.node.send(pkt.src, Kind.MOSH_GROUP, {"t": t, "st": "busy"})
            return  # not at round t yet: the inviter may still see us join
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

    def _on_membership(self, event: str, peer: str) -> None:
        if event == "joined":
            return
        self.beacons.pop(peer, None)
        cur = self._cur
        if cur is not None and cur.assembly is not None:
            cur.assembly.wake.set()  # a planned member died: stop waiting for it
        self._reply_wake.set()  # a leader died: fail over now
