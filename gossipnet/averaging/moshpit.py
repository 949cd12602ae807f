"""Moshpit averaging: group all-reduces on a virtual grid, matched without a server.

Ryabinin et al., *Moshpit SGD* (NeurIPS 2021); ALGORITHMS.md section 2.  In
round t every peer averages with the peers that share its shift-register key
(:mod:`._moshpit_grid`); with N = M^d and no faults, d rounds give every peer
the exact global mean, and with faults the spread still shrinks
geometrically, because a failure only costs its own group.

Matchmaking (hivemind uses a DHT; gossipnet has only membership views):

1. *Plan*: each peer computes the round's groups from its own view and the
   round number (pure, no message) and picks its group's leader, the member
   ranked first by a per-round hash.
2. *Join*: a follower sends JOIN to its leader (acknowledged, retried) with
   the seconds it is still willing to wait.  A leader waits for its planned
   members until all arrived, the dead ones are declared dead, or a learned
   allowance (``join_wait_factor`` x the usual join spread) passes, never
   beyond ``matchmaking_timeout_s``.  It also takes joiners it did not plan
   for (their view differs), up to M members.
3. *Confirm*: the leader sends the final member list to every member; only
   that list is ever used, so all members of a group run the all-reduce with
   the same participants, and a peer runs in at most one group per round.
   Views that disagree resolve within the round: a peer asked to lead while it
   follows answers with a redirect to its own leader, and redirects only go to
   peers ranked strictly earlier, so they cannot cycle.  Nobody waits on
   anyone past a deadline: a lost leader leaves its followers averaging alone
   (values unchanged) and a listed member that never runs costs exactly its
   slice (the others keep their own values there): no contribution is ever
   counted twice or lost from the sum.
4. *Average*: the loss-tolerant all-reduce (:mod:`.allreduce`) on Moshpit's
   own packet kinds, with the round number we choose; members missing from
   the run are simply absent from the weighted mean sum(w x) / sum(w).
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
from ._moshpit_grid import Grid, choose_grid, leader_rank, plan_round
from .allreduce import MOSHPIT_KINDS, EngineKinds, LossyAllReduce

__all__ = ("MoshpitAverager", "MoshpitConfig", "merge_reports")

log = logging.getLogger(__name__)

_MAX_EARLY = 4096  # buffered JOINs for rounds we have not reached
_HISTORY = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class MoshpitConfig:
    """Moshpit knobs (seconds in ``_s`` names).

    max_group_size: largest group M; the grid is chosen from the live peer count.
    min_fill: smallest acceptable grid fill (ALGORITHMS.md 2.3, 2.6).
    grid: force ``(M, d)`` instead (tests, benches); more peers than M^d raises.
    matchmaking_timeout_s: bound of group assembly in one round.
    join_min_wait_s / join_wait_factor: a leader waits for missing members
        ``max(min, factor x median join spread)`` after the first joiner.
    reply_margin_s: time allowed for the member list to reach a member.
    round_timeout_s: bound of a group's all-reduce (None: ``Config.collective_timeout_s``).
    """

    max_group_size: int = 32
    min_fill: float = 0.75
    grid: tuple[int, int] | None = None
    matchmaking_timeout_s: float = 1.0
    join_min_wait_s: float = 0.1
    join_wait_factor: float = 3.0
    reply_margin_s: float = 0.1
    round_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_group_size < 2 or not 0 < self.min_fill <= 1:
            raise ValueError("max_group_size must be >= 2 and min_fill in (0, 1]")
        if self.grid is not None and (self.grid[0] < 1 or self.grid[1] < 1):
            raise ValueError(f"grid must be (side >= 1, dims >= 1), got {self.grid}")
        for name in ("matchmaking_timeout_s", "join_wait_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoshpitConfig.{name} must be > 0")
        if self.join_min_wait_s < 0 or self.reply_margin_s < 0:
            raise ValueError("join_min_wait_s and reply_margin_s must be >= 0")
        if self.round_timeout_s is not None and not self.round_timeout_s > 0:
            raise ValueError("round_timeout_s must be > 0 or None")


class _GroupEngine(LossyAllReduce):
    """The lossy all-reduce on Moshpit's kinds, run at a round number we choose.

    Why the participant filter: a packet from a peer outside the group's list
    (a stale or confused view) must never enter the average; the list from
    the leader is the single source of truth.
    """

    def __init__(self, node: Node, *, tag: str = "mp", kinds: EngineKinds = MOSHPIT_KINDS) -> None:
        super().__init__(node, tag=tag, kinds=kinds)

    async def run_at(self, r: int, buckets: list[torch.Tensor], **kw: object) -> CollectiveReport:
        # No await between these writes and run() reading them: the round is exactly r.
        self.next_round, self.max_seen = r, -1
        return await self.run(buckets, **kw)  # type: ignore[arg-type]

    def _dispatch(self, rnd: object, pkt: Packet) -> None:
        if pkt.src not in rnd.participants:  # type: ignore[attr-defined]
            self.dropped["not_participant"] += 1
            return
        super()._dispatch(rnd, pkt)  # type: ignore[arg-type]


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
    t: int
    leader: str
    assembly: _Assembly | None = None  # set when we lead


class MoshpitAverager:
    """Moshpit rounds for one node; every method runs on the node's loop thread."""

    def __init__(self, node: Node, config: MoshpitConfig | None = None) -> None:
        self.node = node
        self.config = config or MoshpitConfig()
        self.engine = _GroupEngine(node)
        self.next_round = 0
        self.max_seen = -1
        self.last_rounds: list[CollectiveReport] = []
        #: the latest round each peer announced in its heartbeat (0: never averaged)
        self.beacons: dict[str, int] = {}
        self._cur: _Current | None = None
        self._early: dict[int, list[Packet]] = collections.defaultdict(list)
        self._replies: dict[tuple[int, str], Packet] = {}
        self._reply_wake = asyncio.Event()
        self._spreads: collections.deque[float] = collections.deque(maxlen=_HISTORY)
        self._lock = asyncio.Lock()
        self._cfg = self.config  # the running call's config
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
        """Average ``buckets`` in place over ``rounds`` Moshpit rounds.

        Args:
            buckets: flat contiguous 1-D CPU tensors, the same layout on every peer.
            rounds: rounds to run; None runs to the end of the current sweep of d
                rounds (d when the peers are in step), so one call on a full grid
                yields the exact global mean.
            weight: this peer's weight in every group mean, >= 0.
            config: overrides :attr:`config` for this call.
            start_round: first round (tests, benches); default: where the peers are.

        Returns:
            One merged :class:`CollectiveReport` (per-round ones in :attr:`last_rounds`).
        """
        if rounds is not None and rounds < 1:
            raise ValueError(f"rounds must be >= 1 or None, got {rounds}")
        cfg = config or self.config
        async with self._lock:
            t = self._start_round(cfg) if start_round is None else start_round
            reports: list[CollectiveReport] = []
            todo = rounds
            while todo is None or len(reports) < todo:
                grid = self.grid_for(len(self.node.alive_peers()), cfg)
                if todo is None:
                    todo = grid.dims - t % grid.dims
                reports.append(await self._round(t, list(buckets), weight, cfg))
                t += 1
                self.next_round = t
                self.node.beacon["mpt"] = t
            self.last_rounds = reports
            return merge_reports(reports)

    def _start_round(self, cfg: MoshpitConfig) -> int:
        """Where a call starts: our next round, unless the others are a whole sweep
        ahead (we restarted, or were cut off): then their current round.

        Why not always the highest round seen, as the all-reduce does: groups end
        their rounds at different times, so a peer a little late would see round
        t + 1 announced and skip round t, which its own group is still waiting
        for; one skip puts its calls out of step with everyone's for good.
        """
        dims = self.grid_for(len(self.node.alive_peers()), cfg).dims
        if self.max_seen >= self.next_round + dims:
            return self.max_seen
        return self.next_round

    # ------------------------------------------------------------------ one round
    async def _round(
        self, t: int, buckets: list[torch.Tensor], weight: float, cfg: MoshpitConfig
    ) -> CollectiveReport:
        node, clock, me = self.node, self.node.clock, self.node.peer_id
        t0 = clock.now()
        view = node.alive_peers()
        grid = self.grid_for(len(view), cfg)
        plan = plan_round(view, t, seed=node.config.run, grid=grid)
        leader = plan.leader_of(me)
        self.node.beacon["mpt"] = t
        for stale in [r for r in self._early if r < t]:
            del self._early[stale]
        for key in [k for k in self._replies if k[0] < t]:
            del self._replies[key]
        mm_deadline = t0 + cfg.matchmaking_timeout_s
        self._cfg = cfg
        try:
            if leader == me:
                group = [p for p in plan.group_of(me) if p != me]
                members = await self._lead(t, group, max(grid.side, len(group) + 1), mm_deadline)
            else:
                members = await self._follow(t, leader, mm_deadline + 2 * cfg.reply_margin_s)
        finally:
            # matchmaking of round t is over: later JOINs for it are refused at once
            self._cur = None
            self.next_round = max(self.next_round, t + 1)
        extra = {"group_size": float(len(members)), "leader": float(leader == me)}
        extra.update(grid_side=float(grid.side), grid_dims=float(grid.dims))
        extra["matchmaking_s"] = clock.now() - t0
        if len(members) < 2:
            return CollectiveReport(
                round=t,
                method="moshpit",
                participants=(me,),
                contributors=(me,),
                elapsed_s=clock.now() - t0,
                extra=extra,
            )
        timeout = cfg.round_timeout_s or node.config.collective_timeout_s
        rep = await self.engine.run_at(
            t, buckets, participants=members, weight=weight, timeout_s=timeout
        )
        rep.extra.update(extra)
        rep.method = "moshpit"
        rep.elapsed_s = clock.now() - t0
        return rep

    async def _lead(self, t: int, expected: list[str], cap: int, deadline: float) -> list[str]:
        """Collect joiners until the planned ones are in (or dead, or late); confirm."""
        node, clock, me = self.node, self.node.clock, self.node.peer_id
        asm = _Assembly(t, clock.now(), set(expected), cap)
        self._cur = _Current(t, me, asm)
        for pkt in self._early.pop(t, []):
            self._on_join(pkt)
        cfg = self._cfg
        while True:
            membership = node.membership
            pending = {
                p
                for p in asm.expected
                if p not in asm.joined and (membership is None or membership.is_alive(p))
            }
            now = clock.now()
            if not pending or now >= deadline:
                break
            # Nobody joined yet: we may simply be early (compute skew), so wait up to the
            # deadline.  Once someone joined, the rest get the learned allowance.
            cut = deadline
            if self._spreads and asm.first is not None:
                typical = statistics.median(self._spreads)
                allowance = max(cfg.join_min_wait_s, cfg.join_wait_factor * typical)
                cut = min(deadline, asm.first + allowance)
                if now >= cut:
                    break
            asm.wake.clear()
            await _wait_any(clock, [asm.wake.wait()], cut - now)
        asm.closed = True
        now = clock.now()
        if asm.expected <= set(asm.joined) and asm.last is not None and asm.first is not None:
            self._spreads.append(asm.last - asm.first)
        members = sorted({me} | {q for q, gives_up in asm.joined.items() if gives_up > now})
        payload = msgpack.packb(members)
        for q in members:
            if q != me:
                self._reply(q, {"t": t, "st": "ok"}, payload)
        log.debug("peer %s: round %d leads %s", me, t, members)
        return members

    async def _follow(self, t: int, leader: str, give_up: float) -> list[str]:
        """Join ``leader`` (following redirects to earlier-ranked peers); the member list."""
        node, clock, me = self.node, self.node.clock, self.node.peer_id
        seed = node.config.run
        self._cur = _Current(t, leader)
        for pkt in self._early.pop(t, []):
            self._on_join(pkt)  # answered with a redirect to our leader
        target = leader
        for _hop in range(4):
            ttl = give_up - clock.now()
            if ttl <= 0:
                break
            send = asyncio.ensure_future(
                node.send_reliable(target, Kind.MOSH_JOIN, {"t": t, "ttl": ttl}, timeout_s=ttl)
            )
            try:
                reply = await self._await_reply(t, target, send, give_up)
            finally:
                send.cancel()
            if reply is None:
                break
            status = reply.fields.get("st")
            if status == "ok":
                members = _members(reply.payload)
                return members if me in members else [me]
            nxt = reply.fields.get("to")
            if (
                status != "redirect"
                or not isinstance(nxt, str)
                or nxt == me
                or leader_rank(seed, t, nxt) >= leader_rank(seed, t, target)
            ):
                break
            target = self._cur.leader = nxt
        return [me]

    async def _await_reply(
        self, t: int, target: str, send: asyncio.Future[bool], give_up: float
    ) -> Packet | None:
        clock = self.node.clock
        while True:
            reply = self._replies.pop((t, target), None)
            if reply is not None:
                return reply
            if send.done() and (send.cancelled() or send.exception() or not send.result()):
                return None  # the leader never acknowledged: gone or unreachable
            now = clock.now()
            if now >= give_up:
                return None
            self._reply_wake.clear()
            waits: list[Awaitable[object]] = [self._reply_wake.wait()]
            if not send.done():
                waits.append(send)
            await _wait_any(clock, waits, give_up - now)

    # ------------------------------------------------------------------ receiving
    def _reply(self, peer: str, fields: dict[str, object], payload: bytes = b"") -> None:
        timeout = self._cfg.matchmaking_timeout_s
        self.node.spawn(
            self.node.send_reliable(peer, Kind.MOSH_GROUP, fields, payload, timeout_s=timeout),
            "moshpit-reply",
        )

    def _saw(self, t: int) -> None:
        if t > self.max_seen:
            self.max_seen = t

    def _on_join(self, pkt: Packet) -> None:
        t, ttl = pkt.fields.get("t"), pkt.fields.get("ttl")
        if type(t) is not int or not isinstance(ttl, int | float) or t < 0:
            return
        self._saw(t)
        cur, now = self._cur, self.node.clock.now()
        if cur is not None and cur.t == t:
            asm = cur.assembly
            if asm is None:
                self._reply(pkt.src, {"t": t, "st": "redirect", "to": cur.leader})
            elif asm.closed:
                if asm.first is not None:  # a late member: allow more next time
                    self._spreads.append(now - asm.first)
                self._reply(pkt.src, {"t": t, "st": "refuse"})
            elif pkt.src not in asm.joined and len(asm.joined) + 1 >= asm.cap:
                self._reply(pkt.src, {"t": t, "st": "refuse"})
            else:
                asm.joined[pkt.src] = now + float(ttl) - self._cfg.reply_margin_s
                asm.first = now if asm.first is None else asm.first
                if pkt.src in asm.expected:
                    asm.last = now
                asm.wake.set()
        elif t > (cur.t if cur is not None else self.next_round - 1):
            if sum(map(len, self._early.values())) < _MAX_EARLY:
                self._early[t].append(pkt)
        else:
            self._reply(pkt.src, {"t": t, "st": "refuse"})

    def _on_group(self, pkt: Packet) -> None:
        t = pkt.fields.get("t")
        if type(t) is not int or t < self.next_round:
            return
        self._replies[(t, pkt.src)] = pkt
        self._reply_wake.set()

    def _on_heartbeat(self, pkt: Packet) -> None:
        t = pkt.fields.get("mpt")
        if type(t) is int:
            self._saw(t)
            self.beacons[pkt.src] = t

    def _on_membership(self, event: str, peer: str) -> None:
        if event != "joined":
            self.beacons.pop(peer, None)
        cur = self._cur
        if event != "joined" and cur is not None and cur.assembly is not None:
            cur.assembly.wake.set()  # a planned member died: stop waiting for it
        if event != "joined":
            self._reply_wake.set()


def _members(payload: memoryview) -> list[str]:
    try:
        members = msgpack.unpackb(bytes(payload), max_array_len=4096, max_str_len=1024)
    except Exception:
        return []
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        return []
    return sorted(set(members))


async def _wait_any(clock: object, aws: Sequence[Awaitable[object]], timeout_s: float) -> None:
    """Wait until one of ``aws`` finishes or ``timeout_s`` passes on the injected clock."""
    futs = [asyncio.ensure_future(a) for a in aws]
    sleeper = asyncio.ensure_future(clock.sleep(max(0.0, timeout_s)))  # type: ignore[attr-defined]
    try:
        await asyncio.wait({*futs, sleeper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        for f, a in zip(futs, aws, strict=True):
            if f is not a:  # a coroutine we wrapped: ours to cancel
                f.cancel()


def merge_reports(reports: Sequence[CollectiveReport]) -> CollectiveReport:
    """One report for a call of several rounds: sums, unions, and per-round extras."""
    if not reports:
        return CollectiveReport(method="moshpit")
    parts: set[str] = set()
    contrib: set[str] = set()
    missing: set[str] = set()
    for r in reports:
        parts.update(r.participants)
        contrib.update(r.contributors)
        missing.update(r.missing)
    received = sum(r.packets_received for r in reports)
    lost = sum(r.packets_lost for r in reports)
    sizes = [r.extra.get("group_size", 1.0) for r in reports]
    return CollectiveReport(
        round=reports[0].round,
        method="moshpit",
        participants=tuple(sorted(parts)),
        contributors=tuple(sorted(contrib)),
        missing=tuple(sorted(missing)),
        packets_sent=sum(r.packets_sent for r in reports),
        packets_received=received,
        packets_lost=lost,
        chunks_total=sum(r.chunks_total for r in reports),
        chunks_stale=sum(r.chunks_stale for r in reports),
        delivered_fraction=received / (received + lost) if received + lost else 1.0,
        elapsed_s=sum(r.elapsed_s for r in reports),
        timed_out=any(r.timed_out for r in reports),
        extra={
            "rounds": float(len(reports)),
            "last_round": float(reports[-1].round),
            "mean_group_size": sum(sizes) / len(sizes),
            "alone_rounds": float(sum(s < 2 for s in sizes)),
        },
    )
