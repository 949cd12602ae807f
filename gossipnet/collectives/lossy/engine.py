"""The engine of the loss-tolerant all-reduce: :class:`LossyAllReduce`.

The algorithm and its choices are described in :mod:`gossipnet.collectives.lossy`.
This module is the state kept across rounds (round numbers, early packets,
learned spans, the END-copy policy), the round driver and the packet intake.
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
from gossipnet.collectives.lossy.context import PhaseName
from gossipnet.collectives.lossy.cut import ReorderWindow, wait_phase
from gossipnet.collectives.lossy.gather import all_gather, on_ag, on_ag_batch
from gossipnet.collectives.lossy.layout import layout_conflict, layout_failure
from gossipnet.collectives.lossy.loss_watch import END_COPIES as END_COPIES
from gossipnet.collectives.lossy.loss_watch import LossWatch
from gossipnet.collectives.lossy.options import ReduceHook, RoundOptions
from gossipnet.collectives.lossy.packets import ALLREDUCE_KINDS, EngineKinds, chunk_sizes
from gossipnet.collectives.lossy.reducer import OwnedShard
from gossipnet.collectives.lossy.round import BufferPool, Phase, Round
from gossipnet.collectives.lossy.round_id import (
    MAX_LAYOUT_DESC,
    Alignment,
    alignment,
    valid_mode,
    valid_round,
)
from gossipnet.collectives.lossy.scatter import (
    accept_rs_batch,
    announce_rs_end,
    finish_rs,
    on_rs,
    rs_part,
    send_rs,
)
from gossipnet.collectives.lossy.stale_step import StaleStep
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

_MAX_BUFFERED_PACKETS = 200_000
_SPAN_HISTORY = 64
_RS_SHARE = 0.6


class LossyAllReduce:
    """The all-reduce engine of one node; every method runs on the loop thread."""

    def __init__(
        self, node: Node, *, tag: str = "ar", kinds: EngineKinds = ALLREDUCE_KINDS
    ) -> None:
        self.node = node
        self.tag = tag
        self._loss_key = tag + ".loss"  # our heartbeat's "I saw loss recently" flag
        self.k = kinds
        self.next_round = 0
        self.max_seen = -1
        self._round: Round | None = None
        self._last: Round | None = None  # serves repair requests after it ended
        self._buffered: dict[int, list[Packet]] = collections.defaultdict(list)
        self._nbuffered = 0
        self._spans: dict[PhaseName, collections.deque[float]] = {
            "rs": collections.deque(maxlen=_SPAN_HISTORY),
            "ag": collections.deque(maxlen=_SPAN_HISTORY),
        }
        self._reorder = ReorderWindow()  # how long an END waits for data it overtook
        self._lock = asyncio.Lock()
        self._pool = BufferPool()
        self.loss = LossWatch()  # recent loss, ours and our peers': END copies, parity
        self.dropped: collections.Counter[str] = collections.Counter()
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
        if opts.compress is not None:
            rnd.fec_k = 0  # parity XORs dense payloads
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
            if rnd.codec is not None:
                report.extra.update(rnd.codec.finish(rnd))
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
        if opts.round_id is None:
            r = max(self.next_round, self.max_seen)
        elif opts.round_id < self.next_round:
            raise ValueError(
                f"round id {opts.round_id} was already run (next is {self.next_round})"
            )
        else:
            r = opts.round_id
        parts = tuple(sorted(opts.participants)) if opts.participants else node.alive_peers()
        redundancy = node.config.redundancy if opts.redundancy is None else opts.redundancy
        dst = list(opts.dst) if opts.dst is not None else src
        rnd = Round(
            r, node.peer_id, tuple(parts), src, dst, opts.weight,
            chunk_sizes(node, src, len(parts), opts.compress, opts.on_reduced is not None),
            opts.mode, redundancy, self._pool, not opts.repair,
        )  # fmt: skip
        if opts.compress is not None:  # before any packet of the round is taken in
            rnd.codec = opts.compress
            opts.compress.begin(rnd, opts.on_reduced is not None)
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
        for pkt in self._buffered.pop(rnd.r, []):
            self._nbuffered -= 1
            if pkt.fields.get("m", 0) != rnd.mode:
                self.dropped["mode_mismatch"] += 1
                continue
            self._dispatch(rnd, pkt)
        await send_rs(self, rnd, weight)
        rnd.sending = False
        for pkt in rnd.pending_ag:
            on_ag(self, rnd, pkt)
        rnd.pending_ag.clear()
        return await wait_phase(
            self.node,
            rnd.rs,
            self._spans["rs"],
            deadline,
            lambda _peer: rnd.expect_rs,
            lambda: announce_rs_end(self, rnd),
        )

    def _note_loss(self, report: CollectiveReport) -> None:
        """Remember whether this round saw loss; tell the peers through our heartbeat."""
        self.loss.note(report)
        self.node.beacon[self._loss_key] = int(self.loss.recent)

    def _others(self, rnd: Round) -> list[str]:
        return [p for p in rnd.participants if p != rnd.me]

    # ------------------------------------------------------------------ receiving
    def _on_batch(self, pkts: list[Packet]) -> None:
        """Packets of one drain, in order.  Data chunks of our open round go in runs
        of one kind: reduce-scatter contributions are checked one by one and added
        together (:func:`.scatter.accept_rs_batch`), all-gather chunks written
        together (:func:`.gather.on_ag_batch`); any other packet first flushes the
        run before it, then takes :meth:`_on_packet`: all act in arrival order."""
        rnd = self._round
        run: list[Packet] = []
        run_kind = -1
        for pkt in pkts:
            kind = self._fast_kind(rnd, pkt) if rnd is not None else -1
            if run and kind != run_kind:
                self._flush(rnd, run_kind, run)  # type: ignore[arg-type]
                run = []
            if kind < 0:
                self._on_packet(pkt)
            else:
                run_kind = kind
                run.append(pkt)
        if run:
            self._flush(rnd, run_kind, run)  # type: ignore[arg-type]

    def _flush(self, rnd: Round, kind: int, run: list[Packet]) -> None:
        if kind == self.k.ag_data:
            now = self.node.clock.now()
            for pkt in run:  # its reduce-scatter is sent (as _on_packet notes)
                rnd.rs.passed(pkt.src, now)
            on_ag_batch(self, rnd, run)
            return
        parts = [p for p in (rs_part(self, rnd, pkt) for pkt in run) if p is not None]
        if parts:
            accept_rs_batch(self, rnd, parts)

    def _fast_kind(self, rnd: Round, pkt: Packet) -> int:
        """``pkt``'s kind if it is a data chunk of our round that :meth:`_on_packet`
        would hand straight to :func:`.scatter.on_rs` or :func:`.gather.on_ag`
        (no parity, no steps measured); else -1."""
        f, kind = pkt.fields, pkt.kind
        if kind == self.k.rs_data:
            if rnd.rs_closed:
                return -1
        elif kind != self.k.ag_data or rnd.sending or rnd.step_mag is not None:
            return -1
        r, m = f.get("r"), f.get("m", 0)
        if not (
            type(r) is int
            and r == rnd.r
            and type(m) is int
            and m == rnd.mode
            and f.get("L") == rnd.layout
            and pkt.src in rnd.members
            and "g" not in f
            and "z" not in f  # compressed: decoded one by one (.scatter, .gather)
        ):
            return -1
        if r > self.max_seen:
            self.max_seen = r
        return kind

    def _on_packet(self, pkt: Packet) -> None:
        r, mode = pkt.fields.get("r"), pkt.fields.get("m", 0)
        if not valid_round(r) or not valid_mode(mode):
            self.dropped["bad_round"] += 1
            return
        rnd = self._round
        if pkt.kind == self.k.repair:
            for candidate in (rnd, self._last):
                if candidate is not None and candidate.r == r:
                    _repair.serve_repair(self, candidate, pkt)
                    return
            self.dropped["repair_unknown_round"] += 1
            return
        current = rnd.r if rnd is not None else self.next_round
        if r > self.max_seen:
            self.max_seen = r
        if rnd is not None and r >= rnd.r and pkt.src in rnd.members:
            now = self.node.clock.now()
            if r > rnd.r:  # the sender finished our round
                rnd.rs.passed(pkt.src, now)
                rnd.ag.passed(pkt.src, now)
            elif pkt.kind in (self.k.ag_data, self.k.ag_end):  # its reduce-scatter is sent
                rnd.rs.passed(pkt.src, now)
        if rnd is not None and pkt.src in rnd.members and (r != rnd.r or mode != rnd.mode):
            # heard in another round: behind or ahead of us, unless it shows up here too
            rnd.elsewhere[pkt.src] = max(r, rnd.elsewhere.get(pkt.src, -1))
        if rnd is not None and r == rnd.r:
            if mode != rnd.mode:
                self.dropped["mode_mismatch"] += 1
                return
            self._dispatch(rnd, pkt)
        elif r >= current:
            if self._nbuffered >= _MAX_BUFFERED_PACKETS:
                self.dropped["buffer_full"] += 1
                return
            self._buffered[r].append(pkt)
            self._nbuffered += 1
        else:
            self.dropped["late"] += 1
            if rnd is not None:
                rnd.late += 1
            last = self._last
            if last is not None and r == last.r and not last.repaired:
                self.note_after_end(last, pkt)  # it came too late: learn how late

    def _dispatch(self, rnd: Round, pkt: Packet) -> None:
        if pkt.src not in rnd.members:
            # outside this round's view (a Moshpit peer of another group, a peer that
            # joined after we started): its layout is not ours and no phase expects it
            self.dropped["not_participant"] += 1
            return
        layout = pkt.fields.get("L")
        if layout != rnd.layout:
            if type(layout) is not int:  # malformed (a forgery or a bug): not a layout
                self.dropped["bad_layout"] += 1
                return
            layout_conflict(self, rnd, pkt, layout)
            return
        kind = pkt.kind
        if kind == self.k.rs_data:
            on_rs(self, rnd, pkt)
        elif kind == self.k.ag_data:
            if rnd.sending:
                rnd.pending_ag.append(pkt)
            else:
                on_ag(self, rnd, pkt)
        elif kind == self.k.rs_end:
            self._on_end(rnd, rnd.rs, "rs", pkt)
        elif kind == self.k.ag_end:
            self._on_end(rnd, rnd.ag, "ag", pkt)

    def _on_end(self, rnd: Round, phase: Phase, name: PhaseName, pkt: Packet) -> None:
        """A sender's END of ``phase`` (:meth:`.round.Phase.end`); its flag of loss."""
        self._peer_loss_flag(pkt)
        n = pkt.fields.get("n")
        declared = n if isinstance(n, int) and n >= 0 else None
        now = self.node.clock.now()
        span = phase.end(pkt.src, declared, now, lambda: self._reorder.allowance(rnd.r))
        if span is not None:
            self._spans[name].append(span)

    def note_after_end(self, rnd: Round, pkt: Packet) -> None:
        """A data packet of ``rnd`` arrived after its sender's END: learn the lag."""
        if pkt.kind not in (self.k.rs_data, self.k.ag_data):
            return
        phase = rnd.rs if pkt.kind == self.k.rs_data else rnd.ag
        ended = phase.ended.get(pkt.src)
        if ended is not None:
            self._reorder.observe(self.node.clock.now() - ended, rnd.r)

    def _peer_loss_flag(self, pkt: Packet) -> None:
        """A peer's "I saw loss recently" flag, from its END markers or heartbeats."""
        self.loss.peer_flag(pkt.src, bool(pkt.fields.get("l", pkt.fields.get(self._loss_key))))

    def _on_heartbeat(self, pkt: Packet) -> None:
        self._peer_loss_flag(pkt)
        lay = pkt.fields.get(self._layout_key)
        if (
            isinstance(lay, list)
            and len(lay) == 2
            and type(lay[0]) is int
            and isinstance(lay[1], str)
            and len(lay[1]) <= MAX_LAYOUT_DESC
        ):
            self.peer_layouts[pkt.src] = (lay[0], lay[1])
        nxt = pkt.fields.get(self.tag)
        if nxt is None:
            return
        if not valid_round(nxt):
            self.dropped["bad_round"] += 1
            return
        if nxt > self.max_seen:
            self.max_seen = nxt
        rnd = self._round
        if rnd is not None and nxt != rnd.r:
            # members and non-members alike: a peer that declared everyone dead while
            # it was frozen runs its next round alone, and hears them only here
            rnd.elsewhere[pkt.src] = max(nxt, rnd.elsewhere.get(pkt.src, -1))
        if rnd is not None and nxt > rnd.r and pkt.src in rnd.members:
            # its beacon names the round after ours: it finished ours
            now = self.node.clock.now()
            rnd.rs.passed(pkt.src, now)
            rnd.ag.passed(pkt.src, now)

    # ------------------------------------------------------------------ identity
    async def rewind(self, round_id: int) -> None:
        """Make ``round_id`` the next round again (a caller restored an older state,
        e.g. the optimizer loaded a checkpoint); forget what was buffered after it."""
        if not valid_round(round_id):
            raise ValueError(f"round_id must be an int in [0, 2**53), got {round_id!r}")
        async with self._lock:
            self.next_round = round_id
            self.max_seen = min(self.max_seen, round_id - 1)
            self._buffered.clear()
            self._nbuffered = 0
            self._last = None

    def alignment(self, rnd: Round | None = None) -> Alignment:
        """Who shared round ``rnd`` (default: the last) and who was heard elsewhere."""
        rnd = rnd if rnd is not None else self._last
        if rnd is None:
            return alignment(self.node.peer_id, set(), {}, self.next_round)
        heard = set(rnd.rs.received) | set(rnd.ag.received) | rnd.rs.done | rnd.ag.done
        return alignment(rnd.me, heard, rnd.elsewhere, rnd.r)

    def _on_membership(self, event: str, peer: str) -> None:
        rnd = self._round
        if rnd is None or event == "joined":
            return
        for phase in (rnd.rs, rnd.ag):
            phase.expected.discard(peer)
            phase.wake.set()
