"""Loss-tolerant all-reduce: reduce-scatter + all-gather over lossy packets.

Weintraub, Banner & Orda, *Distributed Training under Packet Loss* (2025):
every peer owns a contiguous shard of each flat bucket (``ShardMap``).  In
the reduce-scatter each peer sends every chunk it does not own to the
chunk's owner, once, never retransmitted.  The owner averages, per chunk,
the contributions that arrived, weighting each by the sender's weight and
dividing by the weights that arrived (its own always counts), so under
random loss the estimate is unbiased; dividing by N instead would be
biased low by about (1 - p).  In the all-gather each owner sends its
averaged chunks to everyone; a peer that misses one keeps its own value
for it (stale, never zero) and the report counts it.

Why phases end early: after its data every sender sends a tiny END marker
(``END_COPIES`` copies, so all are lost with probability p^5) that says how
many packets it sent.  A phase ends the moment every expected END arrived,
so time per round does not grow with the loss rate.  An END that overtook
data it declares (a reordering network) holds its sender a little longer,
but only while packets have recently been seen to arrive after their END
(``_cut.ReorderWindow``, learned from arrival times): pure loss teaches no
such wait, since lost packets never arrive.  A deadline learned
from the spans of recent complete phases (``phase_deadline_factor`` x the
median span), capped by the call's timeout, bounds a phase when ENDs or a
whole peer are lost.  Where no loss has been seen for ``QUIET_ROUNDS``
rounds, by us or by any peer (a flag on its END markers and heartbeats), no
END goes out (one where an all-gather withheld chunks): a sender whose data all
arrived is complete without its END, and at 1M elements ENDs were half of all
packets sent.

Redundancy (``Config.redundancy`` = k > 1): every data packet goes out k
times, the copies trailing the originals by a few hundred packets, so a chunk
is lost only if all copies are (about p^k under random loss).  It is
proactive, never a retransmission: no one waits, the traffic is k-fold.
Parity (``Config.parity_group`` = k > 0, :mod:`._parity`): one XOR packet per
k data packets recovers any one lost packet of its group, at 1/k the traffic;
the lossy optimizer turns it on by default (``Config.parity_for``).

Rounds: a caller that knows what its round is passes its id (the optimizer:
a function of the training step, :mod:`._round_id`), so peers pair rounds by
what they are, never by how many calls each made.  Plain calls (no id) take
the larger of our own next round and the highest one any peer announced
(data packets, heartbeat beacons), so a restarted or late peer catches up in
one call.  Every data and END packet carries the round id, its mode and a
layout fingerprint: a packet of another mode or layout is never mixed in
(counted; a layout that differs raises ``LayoutMismatchError`` after the
round).  Packets for a round we have not started yet are buffered (bounded);
older ones are dropped and counted as late.  Round ids and modes from headers
are range-checked before use (``._round_id.valid_round``).

Layout: this module is the engine, i.e. the state kept across rounds (round
numbers, early packets, learned spans, the END-copy policy), the round driver
and the packet intake.  The phases are functions over the engine and a round:
:mod:`._scatter` the reduce-scatter, :mod:`.broadcast` the all-gather, :mod:`._cut`
when a phase ends, :mod:`._packets` redundant copies, chunk checks and
:class:`EngineKinds`; :mod:`._round` a round's bookkeeping, :mod:`._repair` NACKs,
:mod:`._parity` XOR parity, :mod:`._loss_watch` what recent loss makes us spend.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence

import torch

from gossipnet.collectives.chunks import auto_chunk_bytes
from gossipnet.collectives.lossy import repair as _repair
from gossipnet.collectives.lossy.cut import ReorderWindow, wait_phase
from gossipnet.collectives.lossy.gather import all_gather, on_ag
from gossipnet.collectives.lossy.loss_watch import END_COPIES as END_COPIES
from gossipnet.collectives.lossy.loss_watch import LossWatch
from gossipnet.collectives.lossy.packets import ALLREDUCE_KINDS, EngineKinds
from gossipnet.collectives.lossy.parity import MAX_GROUP
from gossipnet.collectives.lossy.round import BufferPool, OwnedShard, Round
from gossipnet.collectives.lossy.round_id import (
    MAX_LAYOUT_DESC,
    Alignment,
    alignment,
    layout_conflict,
    layout_failure,
    valid_mode,
    valid_round,
)
from gossipnet.collectives.lossy.scatter import announce_rs_end, finish_rs, on_rs, send_rs
from gossipnet.collectives.lossy.stale_step import StaleStep
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import DTYPE_CODES, Packet

__all__ = ("ALLREDUCE_KINDS", "EngineKinds", "LossyAllReduce", "OwnedShard")

log = logging.getLogger(__name__)

_MAX_BUFFERED_PACKETS = 200_000
_SPAN_HISTORY = 64
_RS_SHARE = 0.6

#: ``on_reduced`` receives the owned shards with their averaged values and returns
#: the values to broadcast for those ranges (same order), e.g. stepped parameters.
ReduceHook = Callable[[list["OwnedShard"]], list[torch.Tensor]]


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
        self._spans: dict[str, collections.deque[float]] = {
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
            node.subscribe(kind, self._on_packet)
        node.on_heartbeat(self._on_heartbeat)
        node.on_membership(self._on_membership)
        node.beacon[self.tag] = 0
        node.beacon[self._loss_key] = 1  # until our own rounds show a quiet network

    # ------------------------------------------------------------------ public
    async def run(
        self,
        src: Sequence[torch.Tensor],
        *,
        dst: Sequence[torch.Tensor] | None = None,
        weight: float = 1.0,
        timeout_s: float | None = None,
        on_reduced: ReduceHook | None = None,
        participants: Sequence[str] | None = None,
        mode: int = 0,
        repair: bool = False,
        redundancy: int | None = None,
        stale_step: StaleStep | None = None,
        parity_group: int | None = None,
        round_id: int | None = None,
    ) -> CollectiveReport:
        """One round: reduce-scatter ``src``, then all-gather into ``dst`` (default ``src``).

        Args:
            src: flat 1-D CPU buckets (contiguous), same layout on every peer.
            dst: where the gathered values go; chunks whose broadcast was lost keep
                the values ``dst`` already holds.
            weight: this peer's weight (e.g. micro-batches done); >= 0.  A chunk whose
                arrived weights sum to 0 keeps this peer's own values.
            timeout_s: bound of the whole round (default ``Config.collective_timeout_s``).
            on_reduced: maps the averaged owned shards to the values to broadcast
                (default: the averages themselves).
            participants: override the membership view (tests, Moshpit groups).
            mode: what the round carries (e.g. 0 gradients, 1 parameters); packets of
                another mode are dropped, so peers that disagree on it never mix
                gradients into parameters.
            repair: after the all-gather, re-request lost chunks from their owners
                until none is missing or the deadline passes (used for resyncs that
                must leave every peer identical).
            redundancy: copies of every data packet (default ``Config.redundancy``);
                2 turns a loss rate p into about p^2 for twice the traffic.
            stale_step: estimate the chunks of ``dst`` whose broadcast was lost
                (an optimizer's parameters, ``src`` its gradient) instead of keeping
                them: see :mod:`._stale_step`; the report's ``extra["estimated"]``.
            parity_group: XOR parity group size while loss is seen (default
                ``Config.parity_for(optimizer=False)``); 0 for none.
            round_id: what this round is, the same on every peer (the optimizer's:
                :func:`._round_id.optimizer_round`); above every id run before.
                Default: the next call, caught up to the highest round announced.

        Returns:
            The :class:`CollectiveReport` of the round; network faults never raise.
            ``extra["ahead"]`` / ``extra["behind"]``: members heard only in later /
            earlier rounds (see :meth:`alignment`).

        Raises:
            LayoutMismatchError: a participant's packets carried another tensor layout.
        """
        if round_id is not None and not valid_round(round_id):
            raise ValueError(f"round_id must be an int in [0, 2**53), got {round_id!r}")
        if redundancy is not None and not (isinstance(redundancy, int) and redundancy >= 1):
            raise ValueError(f"redundancy must be an int >= 1, got {redundancy!r}")
        if parity_group is not None and not (
            isinstance(parity_group, int) and 0 <= parity_group <= MAX_GROUP
        ):
            raise ValueError(f"parity_group must be an int in [0, {MAX_GROUP}], got {parity_group}")
        if weight < 0 or weight != weight:
            raise ValueError(f"weight must be a finite number >= 0, got {weight}")
        for b in src:
            if b.dim() != 1 or not b.is_contiguous() or b.device.type != "cpu":
                raise ValueError("buckets must be contiguous 1-D CPU tensors")
            if b.dtype not in DTYPE_CODES:
                raise ValueError(f"dtype {b.dtype} cannot go on the wire")
        async with self._lock:
            return await self._run(
                list(src),
                list(dst) if dst is not None else list(src),
                weight,
                self.node.config.collective_timeout_s if timeout_s is None else timeout_s,
                on_reduced,
                participants,
                mode,
                repair,
                redundancy,
                stale_step,
                parity_group,
                round_id,
            )

    # ------------------------------------------------------------------ the round
    async def _run(
        self,
        src: list[torch.Tensor],
        dst: list[torch.Tensor],
        weight: float,
        timeout_s: float,
        on_reduced: ReduceHook | None,
        participants: Sequence[str] | None,
        mode: int,
        repair: bool,
        redundancy: int | None,
        stale_step: StaleStep | None,
        parity_group: int | None,
        round_id: int | None,
    ) -> CollectiveReport:
        node, clock = self.node, self.node.clock
        t0 = clock.now()
        deadline = t0 + timeout_s
        rnd = self._start_round(
            src, dst, weight, participants, mode, redundancy, not repair, round_id
        )
        if parity_group is None:
            parity_group = node.config.parity_for(optimizer=False)
        rnd.fec_k = self.loss.parity_group(
            self._others(rnd), parity_group, node.config.parity_always
        )
        if stale_step is not None:
            rnd.step_mag = StaleStep.fresh(rnd)
        try:
            # the reduce-scatter may use at most 60% of the bound: the all-gather needs
            # the rest, or a silent dead peer would leave every chunk stale
            rs_deadline = t0 + _RS_SHARE * (deadline - t0)
            rs_timed_out = not await self._reduce_scatter(rnd, weight, rs_deadline)
            shards = finish_rs(rnd)
            rnd.rs_closed = True
            values = on_reduced(shards) if on_reduced else [s.average for s in shards]
            # all-gather: our averaged shards to everyone, then wait for the others'
            ag_timed_out = not await all_gather(self, rnd, shards, values, deadline)
            if repair:
                rnd.repaired = True  # its repair answers arrive after ENDs by design
                ag_timed_out = not await _repair.repair(self, rnd, deadline) or ag_timed_out
            report = rnd.report(clock.now() - t0, rs_timed_out or ag_timed_out)
            if stale_step is not None:  # chunks_stale still counts them: not delivered
                report.extra["estimated"] = float(stale_step.apply(rnd))
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

    def _start_round(
        self,
        src: list[torch.Tensor],
        dst: list[torch.Tensor],
        weight: float,
        participants: Sequence[str] | None,
        mode: int,
        redundancy: int | None,
        in_place: bool = False,
        round_id: int | None = None,
    ) -> Round:
        """Pick the round number and view, make the round current, drop older buffers.

        ``in_place``: where ``dst`` is ``src``, average our shard inside it.  Not for
        repaired rounds (resyncs): their broadcast is served again after the round,
        from memory the caller must not have changed since.
        """
        node = self.node
        if round_id is None:
            r = max(self.next_round, self.max_seen)
        elif round_id < self.next_round:
            raise ValueError(f"round id {round_id} was already run (next is {self.next_round})")
        else:
            r = round_id
        parts = tuple(sorted(participants)) if participants else tuple(node.alive_peers())
        rnd = Round(
            r, node.peer_id, parts, src, dst, weight, self._chunk_sizes(src, len(parts)), mode,
            node.config.redundancy if redundancy is None else redundancy, self._pool,
            in_place,
        )  # fmt: skip
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

    def _end_copies(self, rnd: Round) -> int:
        """END copies for this round (``_loss_watch.LossWatch.end_copies``)."""
        return self.loss.end_copies(self._others(rnd), rnd.redundancy)

    def _chunk_sizes(self, src: Sequence[torch.Tensor], participants: int) -> list[int]:
        """Per bucket: ``Config.chunk_bytes`` if set, else grown with the bucket,
        never past ``Config.max_payload_bytes`` (a receiver would drop it)."""
        fixed = self.node.config.chunk_bytes
        transport = self.node.transport
        limit = self.node.config.max_payload_bytes
        base = transport.default_chunk_bytes if transport is not None else 64 * 1024
        base = min(base, limit)
        cap = min(getattr(transport, "max_chunk_bytes", base), limit)
        return [
            fixed or auto_chunk_bytes(b.numel() * b.element_size(), base, cap, participants)
            for b in src
        ]

    # ------------------------------------------------------------------ receiving
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
        elif kind in (self.k.rs_end, self.k.ag_end):
            phase = rnd.rs if kind == self.k.rs_end else rnd.ag
            n = pkt.fields.get("n")
            if isinstance(n, int) and n >= 0:
                phase.declared[pkt.src] = n
            self._peer_loss_flag(pkt)
            if pkt.src in phase.done or pkt.src in phase.hold:
                return
            now = self.node.clock.now()
            phase.ended.setdefault(pkt.src, now)
            if isinstance(n, int) and phase.received[pkt.src] < n:
                wait = self._reorder.allowance(rnd.r)  # data it closes may be overtaken
                if wait > 0:
                    phase.arrived(pkt.src, now)
                    phase.hold[pkt.src] = now + wait
                    phase.wake.set()
                    return
            span = phase.finish(pkt.src, now)
            self._spans["rs" if kind == self.k.rs_end else "ag"].append(span)

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
