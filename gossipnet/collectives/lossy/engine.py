"""The engine of the loss-tolerant all-reduce: :class:`LossyAllReduce`.

The algorithm and its choices are described in :mod:`gossipnet.collectives.lossy`.
This module is the state kept across rounds (round numbers, early packets,
learned spans, the END-copy policy) and the round driver; the packet intake
(what each arriving packet does to that state) is :mod:`.intake`.
The phases are functions over a :class:`.context.PhaseContext` (what they need
of the engine, which satisfies it) and a :class:`.round.Round`; a round's knobs
are one :class:`.options.RoundOptions`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence

import torch

from gossipnet.collectives.lossy import repair as _repair
from gossipnet.collectives.lossy.claims import RoundClaims
from gossipnet.collectives.lossy.context import PhaseName
from gossipnet.collectives.lossy.cut import ReorderWindow, StallWindow, wait_phase
from gossipnet.collectives.lossy.gather import all_gather, replay_ag
from gossipnet.collectives.lossy.intake import Intake
from gossipnet.collectives.lossy.layout import layout_failure
from gossipnet.collectives.lossy.loss_watch import END_COPIES as END_COPIES
from gossipnet.collectives.lossy.loss_watch import LossWatch
from gossipnet.collectives.lossy.options import ReduceHook, RoundOptions
from gossipnet.collectives.lossy.packets import ALLREDUCE_KINDS, EngineKinds, chunk_sizes
from gossipnet.collectives.lossy.reducer import OwnedShard
from gossipnet.collectives.lossy.round import BufferPool, Round
from gossipnet.collectives.lossy.round_id import (
    Alignment,
    alignment,
    layout_of,
    valid_round,
)
from gossipnet.collectives.lossy.scatter import (
    announce_rs_end,
    finish_rs,
    send_rs,
)
from gossipnet.collectives.lossy.stale_step import StaleStep
from gossipnet.collectives.lossy.wirebytes import ByteMeter, dense_bytes
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import DTYPE_CODES, Packet

__all__ = (
    "ALLREDUCE_KINDS",
    "END_COPIES",
    "EngineKinds",
    "LossyAllReduce",
    "OwnedShard",
    "ReduceHook",
    "RoundOptions",
)

log = logging.getLogger(__name__)

_SPAN_HISTORY = 64
_RS_SHARE = 0.6


class LossyAllReduce(Intake):
    """The all-reduce engine of one node; every method runs on the loop thread."""

    def __init__(
        self, node: Node, *, tag: str = "ar", kinds: EngineKinds = ALLREDUCE_KINDS
    ) -> None:
        self.node = node
        self.tag = tag
        self._loss_key = tag + ".loss"  # our heartbeat's "I saw loss recently" flag
        self.k = kinds
        self.next_round = 0
        # the highest round a peer claimed (clamped to the window); a plain call
        # catches up to no more than this and the electorate's quorum (.claims)
        self.max_seen = -1
        self.claims = RoundClaims()
        self._round: Round | None = None
        self._last: Round | None = None  # serves repair requests after it ended
        self._buffered: dict[int, list[Packet]] = collections.defaultdict(list)
        self._nbuffered = 0
        self._spans: dict[PhaseName, collections.deque[float]] = {
            "rs": collections.deque(maxlen=_SPAN_HISTORY),
            "ag": collections.deque(maxlen=_SPAN_HISTORY),
        }
        self._reorder = ReorderWindow()  # how long an END waits for data it overtook
        self._stalls = StallWindow()  # how long a phase waits for a sender gone quiet
        self._stall_key = tag + ".q"  # our heartbeat's longest observed stall, ms
        self._lock = asyncio.Lock()
        self._pool = BufferPool()
        self.loss = LossWatch()  # recent loss, ours and our peers': END copies, parity
        self.dropped: collections.Counter[str] = collections.Counter()
        node.drop_counters[f"lossy:{tag}"] = self.dropped  # in node.stats()
        # every round's bytes (.wirebytes), late repair answers included: node.stats()
        self.wire = ByteMeter()
        node.sent_counters[f"lossy:{tag}"] = lambda: self.wire.total
        # each peer's latest layout (fingerprint, description) from its heartbeats, to
        # name both layouts when a round hears another one
        self.peer_layouts: dict[str, tuple[int, str]] = {}
        self._layout_key = tag + ".L"
        for kind in kinds.all():
            node.subscribe(kind, self._on_packet)  # a packet at a time (per-packet backends)
            node.subscribe_batch(kind, self._on_batch)  # a drain's run (PacketIO.on_batch)
        node.on_heartbeat(self._on_heartbeat)
        node.on_membership(self._on_membership)
        node.beacon[self.tag] = 0
        node.beacon[self._loss_key] = 1  # until our own rounds show a quiet network
        node.beacon[self._stall_key] = 0

    # ------------------------------------------------------------------ public
    async def run(
        self, src: Sequence[torch.Tensor], options: RoundOptions | None = None
    ) -> CollectiveReport:
        """One round: reduce-scatter ``src``, then all-gather into ``options.dst``.

        Args:
            src: flat 1-D CPU buckets (contiguous), same layout on every peer.
            options: what the round is asked to do (default: a plain average
                into ``src``); see :class:`.options.RoundOptions`.

        Returns:
            The :class:`CollectiveReport` of the round; network faults never raise.
            ``extra["ahead"]`` / ``extra["behind"]``: members heard only in later /
            earlier rounds (see :meth:`alignment`).

        Raises:
            ValueError: a bucket that is not a contiguous 1-D CPU tensor of a wire
                dtype, or a ``round_id`` already run.
            LayoutMismatchError: a participant's packets carried another tensor layout.
        """
        opts = options if options is not None else RoundOptions()
        for b in src:
            if b.dim() != 1 or not b.is_contiguous() or b.device.type != "cpu":
                raise ValueError("buckets must be contiguous 1-D CPU tensors")
            if b.dtype not in DTYPE_CODES:
                raise ValueError(f"dtype {b.dtype} cannot go on the wire")
        async with self._lock:
            return await self._run(list(src), opts)

    def spans(self, phase: PhaseName) -> collections.deque[float]:
        """Recent spans of ``phase`` (seconds per packet), which learn its cut times."""
        return self._spans[phase]

    @property
    def participants_seen(self) -> frozenset[str]:
        """Peers whose data (reduce-scatter contributions or all-gather chunks) this
        engine took in one of its last :data:`.claims.PARTICIPANT_ROUNDS` rounds.

        Read-only; what "took part with us" means wherever one peer's word about
        rounds must be weighed (:mod:`.claims`): an id outside it has not shown it
        is a participant, whatever it claims.
        """
        return self.claims.participants()

    def end_copies(self, rnd: Round) -> int:
        """END copies for this round (``.loss_watch.LossWatch.end_copies``)."""
        return self.loss.end_copies(self._others(rnd), rnd.redundancy)

    # ------------------------------------------------------------------ the round
    async def _run(self, src: list[torch.Tensor], opts: RoundOptions) -> CollectiveReport:
        node, clock = self.node, self.node.clock
        t0 = clock.now()
        timeout_s = node.config.collective_timeout_s if opts.timeout_s is None else opts.timeout_s
        deadline = t0 + timeout_s
        rnd = self._start_round(src, opts)
        parity_group = opts.parity_group
        if parity_group is None:
            parity_group = node.config.parity_for(optimizer=False)
        rnd.fec_k = self.loss.parity_group(
            self._others(rnd), parity_group, node.config.parity_always
        )
        dense_settings = (rnd.redundancy, rnd.fec_k)  # what a dense round would send
        if opts.compress is not None:
            rnd.fec_k = 0  # parity XORs payloads of one length
            copies = node.config.compressed_copies
            if (
                opts.redundancy is None
                and copies > rnd.redundancy
                and (node.config.parity_always or self.loss.lossy(self._others(rnd)))
            ):
                rnd.redundancy = copies  # copies instead, while loss is seen
                rnd.ag_redundancy = copies
        if opts.stale_step is not None:
            rnd.step_mag = StaleStep.fresh(rnd)
        try:
            # the reduce-scatter may use at most 60% of the bound: the all-gather needs
            # the rest, or a silent dead peer would leave every chunk stale
            rs_deadline = t0 + _RS_SHARE * (deadline - t0)
            rs_timed_out = not await self._reduce_scatter(rnd, opts.weight, rs_deadline)
            shards = finish_rs(rnd)
            values = opts.on_reduced(shards) if opts.on_reduced else [s.average for s in shards]
            # all-gather: our averaged shards to everyone, then wait for the others'
            ag_timed_out = not await all_gather(self, rnd, shards, values, deadline)
            if opts.repair:
                rnd.repaired = True  # its repair answers arrive after ENDs by design
                ag_timed_out = not await _repair.repair(self, rnd, deadline) or ag_timed_out
            report = rnd.report(clock.now() - t0, rs_timed_out or ag_timed_out)
            self.claims.took_part(p for p in report.contributors if p != rnd.me)
            if rnd.codec is not None:
                report.extra.update(rnd.codec.finish(rnd))
                self._compare_dense(rnd, report, *dense_settings)
            if opts.stale_step is not None:  # chunks_stale still counts them: not delivered
                report.extra["estimated"] = float(opts.stale_step.apply(rnd))
            self._note_loss(report)
            align = self.alignment(rnd)
            report.extra["ahead"] = float(len(align.ahead))
            report.extra["behind"] = float(len(align.behind))
            if rnd.layout_conflicts:
                raise await layout_failure(self, rnd)
            return report
        finally:
            rnd.fec_held.clear()  # frees the received frames kept for parity
            self._round = None
            self._last = rnd
            node.beacon[self.tag] = self.next_round

    def _start_round(self, src: list[torch.Tensor], opts: RoundOptions) -> Round:
        """Pick the round number and view, make the round current, drop older buffers.

        Averages our shard inside ``src`` where ``dst`` is ``src``, except in
        repaired rounds (resyncs): their broadcast is served again after the
        round, from memory the caller must not have changed since.
        """
        node = self.node
        parts = tuple(sorted(opts.participants)) if opts.participants else node.alive_peers()
        self.claims.keep(parts)
        if opts.round_id is None:
            r = max(self.next_round, min(self.max_seen, self._quorum_round()))
        elif opts.round_id < self.next_round:
            raise ValueError(
                f"round id {opts.round_id} was already run (next is {self.next_round})"
            )
        else:
            r = opts.round_id
        redundancy = node.config.redundancy if opts.redundancy is None else opts.redundancy
        dst = list(opts.dst) if opts.dst is not None else src
        rnd = Round(
            r, node.peer_id, tuple(parts), src, dst, opts.weight,
            chunk_sizes(node, src, len(parts), opts.compress, opts.on_reduced is not None),
            opts.mode, redundancy, self._pool, not opts.repair, robust=opts.robust,
        )  # fmt: skip
        if opts.compress is not None:  # before any packet of the round is taken in
            rnd.codec = opts.compress
            # another setting elsewhere is another layout (.layout), not a stream of drops
            rnd.layout, rnd.layout_desc = layout_of(rnd.plans, opts.compress.setting())
            rnd.ident["L"] = rnd.layout
            opts.compress.begin(rnd, opts.on_reduced is not None)
        rnd.wire_total = self.wire
        self._round = rnd
        self.next_round = r + 1
        node.beacon[self.tag] = r  # "I am in round r": others catch up to r, not past it
        node.beacon[self._layout_key] = [rnd.layout, rnd.layout_desc]
        for stale in [k for k in self._buffered if k < r]:
            self._nbuffered -= len(self._buffered.pop(stale))
        return rnd

    async def _reduce_scatter(self, rnd: Round, weight: float, deadline: float) -> bool:
        """Replay what came early, send our contributions, wait; True if complete.

        All-gather packets that arrived while we were still sending are applied
        only now: written into ``dst`` (often ``src`` itself) earlier, they would
        change contributions not sent yet.
        """
        rnd.rs.start = self.node.clock.now()
        early = self._buffered.pop(rnd.r, [])
        self._nbuffered -= len(early)
        self._replay_early(rnd, early)
        await send_rs(self, rnd, weight)
        rnd.sending = False
        replay_ag(self, rnd, rnd.pending_ag)
        rnd.pending_ag.clear()
        return await wait_phase(
            self.node,
            rnd.rs,
            self._spans["rs"],
            deadline,
            lambda _peer: rnd.expect_rs,
            lambda: announce_rs_end(self, rnd),
            lambda: self.quiet_wait(rnd),
        )

    def _compare_dense(
        self, rnd: Round, report: CollectiveReport, redundancy: int, fec_k: int
    ) -> None:
        """``bytes_dense`` and ``compression_ratio`` of a compressed round (.wirebytes)."""
        sizes = chunk_sizes(self.node, rnd.src, len(rnd.participants))
        dense = dense_bytes(rnd, sizes, redundancy, fec_k)
        sent = rnd.wire.total
        report.extra["bytes_dense"] = float(dense)
        report.extra["compression_ratio"] = dense / sent if sent else 1.0

    def _note_loss(self, report: CollectiveReport) -> None:
        """Remember whether this round saw loss; tell the peers through our heartbeat."""
        self.loss.note(report)
        self.node.beacon[self._loss_key] = int(self.loss.recent)
        # our own observed stalls, as they age out of the window (.cut.StallWindow)
        self.node.beacon[self._stall_key] = round(1000 * self._stalls.own(report.round))

    def _others(self, rnd: Round) -> list[str]:
        return [p for p in rnd.participants if p != rnd.me]

    # ------------------------------------------------------------------ identity
    async def rewind(self, round_id: int) -> None:
        """Make ``round_id`` the next round again (a caller restored an older state,
        e.g. the optimizer loaded a checkpoint); forget what was buffered after it."""
        if not valid_round(round_id):
            raise ValueError(f"round_id must be an int in [0, 2**53), got {round_id!r}")
        async with self._lock:
            self.next_round = round_id
            self.max_seen = min(self.max_seen, round_id - 1)
            self.claims.cap(round_id - 1)
            self._buffered.clear()
            self._nbuffered = 0
            self._last = None

    def alignment(self, rnd: Round | None = None) -> Alignment:
        """Who shared round ``rnd`` (default: the last) and who was heard elsewhere."""
        rnd = rnd if rnd is not None else self._last
        if rnd is None:
            return alignment(self.node.peer_id, set(), {}, self.next_round)
        heard = set(rnd.rs.received) | set(rnd.ag.received) | rnd.rs.done | rnd.ag.done
        voters = self._electorate()  # an id that never took part carries no weight
        elsewhere = {p: x for p, x in rnd.elsewhere.items() if p in voters}
        return alignment(rnd.me, heard, elsewhere, rnd.r)

    def _electorate(self) -> frozenset[str]:
        """Whose round claims count (:meth:`.claims.RoundClaims.electorate`)."""
        return self.claims.electorate(self.node.alive_peers(), self.node.peer_id)

    def _quorum_round(self) -> int:
        """The highest round a majority of the electorate claims to have reached."""
        return self.claims.quorum(self._electorate())

    def senders_ahead(self) -> frozenset[str]:
        """Peers whose round packets (data or END; never heartbeats) for rounds after
        ours are held here: they run rounds with us in their view.  The only sign a
        peer that joined a run under way has of who takes part, before any round of
        its own was shared (``training._evidence``).  Loop thread; costs one pass
        over the held packets."""
        return frozenset(p.src for held in self._buffered.values() for p in held)

    def _on_membership(self, event: str, peer: str) -> None:
        if event != "joined":
            self._stalls.forget(peer)
        rnd = self._round
        if rnd is None or event == "joined":
            return
        for phase in (rnd.rs, rnd.ag):
            phase.expected.discard(peer)
            phase.wake.set()
