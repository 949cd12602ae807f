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

Rounds and views: every call is one *sweep* (round numbers ``s * SWEEP_STRIDE
+ i``), so peers whose views briefly differ (and so choose grids of
different d) never drift apart in numbering; the optimizer derives ``s``
from its step count.  A peer that (re)joined after we started averaging is
planned in once it announces a round (heartbeat, JOIN, or the "here" it
sends on its first call), so a restarted peer still downloading state is
not waited for.

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
from collections.abc import Sequence

import torch

from gossipnet.collectives.lossy.options import RoundOptions
from gossipnet.collectives.moshpit.engine import GroupEngine, merge_reports
from gossipnet.collectives.moshpit.grid import Grid, choose_grid, leader_rank, plan_round
from gossipnet.collectives.moshpit.kinds import MoshpitKind
from gossipnet.collectives.moshpit.match import Matchmaking, _Current
from gossipnet.collectives.moshpit.options import MoshpitConfig
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("BEHIND_SWEEPS", "SWEEP_STRIDE", "MoshpitAverager", "MoshpitConfig", "merge_reports")

log = logging.getLogger(__name__)

#: round numbers per sweep (one call); more than any grid's d
SWEEP_STRIDE = 64
#: a peer this many sweeps behind is left out of plans (and should catch up by state);
#: one less behind is planned in, and its groups' waits pull it back in step
BEHIND_SWEEPS = 16
_HISTORY = 64


class MoshpitAverager(Matchmaking):
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
        self._early = collections.defaultdict(list)
        self._replies: dict[tuple[int, str], Packet] = {}
        self._reply_wake = asyncio.Event()
        self._spreads: collections.deque[float] = collections.deque(maxlen=_HISTORY)
        self._lock = asyncio.Lock()
        self._newcomers: set[str] = set()  # (re)joined after we started averaging
        node.subscribe(MoshpitKind.JOIN, self._on_join)
        node.subscribe(MoshpitKind.GROUP, self._on_group)
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
            if t - int(self.node.beacon.get("mpt", 0)) > SWEEP_STRIDE:
                self._announce(t)
            todo = rounds or self.grid_for(len(self.view(t, cfg)), cfg).dims - (t - sweep)
            reports: list[CollectiveReport] = []
            for i in range(max(1, todo)):
                reports.append(await self._round(t + i, sweep, list(buckets), weight, cfg))
                self.next_round = max(self.next_round, t + i + 1)
                self.node.beacon["mpt"] = self.next_round
            if rounds is None:  # the sweep is over for us: the next call is the next one
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
        out until it catches up (one heartbeat or JOIN after its first round).
        A peer that (re)joined after we started averaging is left out until it
        announces a round of its own; one that was there from the start is
        planned in before its first announcement (everybody starts at 0).
        """
        me = self.node.peer_id
        lag = BEHIND_SWEEPS * SWEEP_STRIDE

        def in_step(p: str) -> bool:
            at = self.beacons.get(p, 0)
            return at >= t - lag if at > 0 else p not in self._newcomers

        return [p for p in self.node.alive_peers() if p == me or in_step(p)]

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
    def _group(self, view: list[str], grid: Grid, t: int, sweep: int) -> list[str]:
        """Our group of round ``t``, in leader order (the same on every member)."""
        seed = self.node.config.run
        return sorted(
            plan_round(view, t, seed=seed, grid=grid, start=sweep).group_of(self.node.peer_id),
            key=lambda p: leader_rank(seed, t, p),
        )

    def _forget_before(self, t: int) -> None:
        """Drop early packets and replies of rounds before ``t``."""
        for stale in [r for r in self._early if r < t]:
            del self._early[stale]
        for key in [k for k in self._replies if k[0] < t]:
            del self._replies[key]

    async def _round(
        self, t: int, sweep: int, buckets: list[torch.Tensor], weight: float, cfg: MoshpitConfig
    ) -> CollectiveReport:
        node, clock, me = self.node, self.node.clock, self.node.peer_id
        t0 = clock.now()
        view = self.view(t, cfg)
        grid = self.grid_for(len(view), cfg)
        ranked = self._group(view, grid, t, sweep)
        j = ranked.index(me)
        node.beacon["mpt"] = t
        self._forget_before(t)
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
            opts = RoundOptions(participants=members, weight=weight, timeout_s=timeout)
            rep = await self.engine.run_at(t, buckets, opts)
            rep.extra.update(extra)
        rep.method = "moshpit"
        rep.elapsed_s = clock.now() - t0
        log.debug(
            "peer %s: round %d group %s (rank %d in %s), matchmaking %.3f s, %d in view",
            me,
            t,
            members,
            j,
            ranked,
            extra["matchmaking_s"],
            len(view),
        )
        return rep
