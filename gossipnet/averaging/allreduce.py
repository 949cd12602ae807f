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
so time per round does not grow with the loss rate.  A deadline learned
from the spans of recent complete phases (``phase_deadline_factor`` x the
median span), capped by the call's timeout, bounds a phase when ENDs or a
whole peer are lost.  Where no loss has been seen for ``_QUIET_ROUNDS``
rounds, by us or by any peer (a flag on its END markers and heartbeats), one
END copy goes out instead of five: a sender whose data all arrived is complete
without its END, and at 1M elements the copies were half of all packets sent.

Redundancy (``Config.redundancy`` = k > 1): every data packet goes out k
times, the copies trailing the originals by a few hundred packets, so a chunk
is lost only if all copies are (about p^k under random loss).  It is
proactive, never a retransmission: no one waits, the traffic is k-fold.

Rounds: peers call collectives in lockstep; round ``r`` is the larger of
our own next round and the highest one any peer announced (data packets,
heartbeat beacons), so a restarted or late peer catches up in one call.
Packets for a round we have not started yet are buffered (bounded); older
ones are dropped and counted as late.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._node import Node
from ..rounds import CollectiveReport
from ..transport.base import Buffer
from ..transport.wire import DTYPE_CODES, DTYPES, Kind, Packet
from . import _repair
from ._round import BufferPool, OwnedShard, Phase, Round
from .chunks import all_finite, as_bytes, auto_chunk_bytes, from_bytes

__all__ = ("ALLREDUCE_KINDS", "MOSHPIT_KINDS", "EngineKinds", "LossyAllReduce", "OwnedShard")

log = logging.getLogger(__name__)

END_COPIES = 5  # all lost with p^5: 0.2% per link at 30% loss
#: Loss-free rounds (ours, and every peer's as their heartbeats say) before ENDs go out once.
_QUIET_ROUNDS = 4
_YIELD_EVERY = 32  # packets sent between yields, so receiving never starves
_MAX_BUFFERED_PACKETS = 200_000
_SPAN_HISTORY = 64
_RS_SHARE = 0.6
#: Redundant copies trail their originals by this many packets (see ``_send_copy``);
#: well inside the default replay window of 8192 sequence numbers.
_COPY_LAG = 256
#: How long after a sender is known to have moved past a phase we still wait for its
#: packets of that phase (in flight, or reordered behind its later packets).
_MOVED_ON_GRACE_S = 0.02
#: While a phase waits, our own END is re-sent after this long, then at doubling intervals.
_END_REPEAT_S = 0.02
_END_REPEAT_MAX_S = 0.1

#: One data packet's destinations and encoded frames, kept for redundant copies.
_Send = tuple[Sequence[str], list[Buffer]]

#: ``on_reduced`` receives the owned shards with their averaged values and returns
#: the values to broadcast for those ranges (same order), e.g. stepped parameters.
ReduceHook = Callable[[list["OwnedShard"]], list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class EngineKinds:
    """Packet kinds an engine instance owns, so several engines (the global
    all-reduce, Moshpit's group rounds) can live on one node without mixing."""

    rs_data: int
    ag_data: int
    rs_end: int
    ag_end: int
    repair: int

    def all(self) -> tuple[int, ...]:
        return (self.rs_data, self.ag_data, self.rs_end, self.ag_end, self.repair)


ALLREDUCE_KINDS = EngineKinds(Kind.RS_DATA, Kind.AG_DATA, Kind.RS_END, Kind.AG_END, Kind.REPAIR)
MOSHPIT_KINDS = EngineKinds(
    Kind.MOSH_RS_DATA, Kind.MOSH_AG_DATA, Kind.MOSH_RS_END, Kind.MOSH_AG_END, Kind.MOSH_REPAIR
)


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
        self._lock = asyncio.Lock()
        self._pool = BufferPool()
        self._rounds_run = 0
        self._loss_at = 0  # ``_rounds_run`` when we last saw loss (cold engines count as lossy)
        self._lossy_peers: set[str] = set()  # peers whose heartbeats say they saw loss
        self.dropped: collections.Counter[str] = collections.Counter()
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

        Returns:
            The :class:`CollectiveReport` of the round; network faults never raise.
        """
        if redundancy is not None and not (isinstance(redundancy, int) and redundancy >= 1):
            raise ValueError(f"redundancy must be an int >= 1, got {redundancy!r}")
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
    ) -> CollectiveReport:
        node, clock = self.node, self.node.clock
        t0 = clock.now()
        deadline = t0 + timeout_s
        r = max(self.next_round, self.max_seen)
        parts = tuple(sorted(participants)) if participants else tuple(node.alive_peers())
        rnd = Round(
            r, node.peer_id, parts, src, dst, weight, self._chunk_sizes(src, len(parts)), mode,
            node.config.redundancy if redundancy is None else redundancy, self._pool,
        )  # fmt: skip
        self._round = rnd
        self.next_round = r + 1
        node.beacon[self.tag] = r  # "I am in round r": others catch up to r, not past it
        for stale in [k for k in self._buffered if k < r]:
            self._nbuffered -= len(self._buffered.pop(stale))
        try:
            # reduce-scatter: replay what came early, then send our contributions
            rnd.rs.start = clock.now()
            for pkt in self._buffered.pop(r, []):
                self._nbuffered -= 1
                if pkt.fields.get("m", 0) != mode:
                    self.dropped["mode_mismatch"] += 1
                    continue
                self._dispatch(rnd, pkt)
            await self._send_rs(rnd, weight)
            rnd.sending = False
            for pkt in rnd.pending_ag:
                self._on_ag(rnd, pkt)
            rnd.pending_ag.clear()
            # the reduce-scatter may use at most 60% of the bound: the all-gather needs
            # the rest, or a silent dead peer would leave every chunk stale
            rs_deadline = t0 + _RS_SHARE * (deadline - t0)
            rs_timed_out = not await self._wait_phase(
                rnd.rs,
                "rs",
                rs_deadline,
                lambda _peer: rnd.expect_rs,
                lambda: self._announce_rs_end(rnd),
            )
            shards = self._finish_rs(rnd)
            rnd.rs_closed = True
            values = on_reduced(shards) if on_reduced else [s.average for s in shards]
            # all-gather: our averaged shards to everyone, then wait for the others'
            rnd.ag.start = clock.now()
            await self._send_ag(rnd, shards, values)
            ag_timed_out = not await self._wait_phase(
                rnd.ag,
                "ag",
                deadline,
                lambda peer: rnd.ag_expected(peer),
                lambda: self._announce_ag_end(rnd),
            )
            if repair:
                ag_timed_out = not await _repair.repair(self, rnd, deadline) or ag_timed_out
            report = rnd.report(clock.now() - t0, rs_timed_out or ag_timed_out)
            self._note_loss(report)
            return report
        finally:
            self._round = None
            self._last = rnd
            node.beacon[self.tag] = self.next_round

    def _note_loss(self, report: CollectiveReport) -> None:
        """Remember whether this round saw loss; tell the peers through our heartbeat."""
        self._rounds_run += 1
        if report.packets_lost or report.timed_out or report.chunks_stale:
            self._loss_at = self._rounds_run
        self.node.beacon[self._loss_key] = int(self._recent_loss())

    def _recent_loss(self) -> bool:
        return self._rounds_run - self._loss_at < _QUIET_ROUNDS

    def _end_copies(self, rnd: Round) -> int:
        """END copies for this round: ``END_COPIES`` unless the network has been quiet.

        Why quiet means one: ENDs only matter to a receiver that lost data (all of a
        sender's data completes it without one).  Why peers' flags count too (on
        their END markers and heartbeats): loss on our outgoing links shows at the
        receivers, not here.  If loss starts
        while we send one copy, a receiver that lost data and that END waits for
        our END re-announce or its learned cut, for that round only.
        """
        if rnd.redundancy > 1 or self._recent_loss():
            return END_COPIES
        if any(p in self._lossy_peers for p in rnd.participants if p != rnd.me):
            return END_COPIES
        return 1

    def _chunk_sizes(self, src: Sequence[torch.Tensor], participants: int) -> list[int]:
        """Per bucket: ``Config.chunk_bytes`` if set, else grown with the bucket."""
        fixed = self.node.config.chunk_bytes
        transport = self.node.transport
        base = transport.default_chunk_bytes if transport is not None else 64 * 1024
        cap = getattr(transport, "max_chunk_bytes", base)
        return [
            fixed or auto_chunk_bytes(b.numel() * b.element_size(), base, cap, participants)
            for b in src
        ]

    async def _send_rs(self, rnd: Round, weight: float) -> None:
        node = self.node
        per_dest: collections.Counter[str] = collections.Counter()
        copies: collections.deque[_Send] | None = (
            collections.deque() if rnd.redundancy > 1 else None
        )
        codes = [DTYPE_CODES[buf.dtype] for buf in rnd.src]
        # Sliced per chunk: no per-chunk copy.  Read-only = frozen (transport.base.is_frozen):
        # sent without a copy, as ``src`` does not change while the round runs.  What can
        # change it is our own all-gather writing a chunk whose owner already cut us
        # (dst is src for an in-place call) or the caller's next step while a packet to
        # a peer we cut still sits in a queue; such a packet is useless to its owner by
        # then, and fails its MAC there (counted, never used) instead of arriving stale.
        raws = [as_bytes(buf).toreadonly() for buf in rnd.src]
        for sent, (owner, b, c) in enumerate(self._rs_order(rnd), 1):
            plan = rnd.plans[b]
            raw, code = raws[b], codes[b]
            _, count = plan.chunk(c)
            fields = {
                "r": rnd.r,
                "m": rnd.mode,
                "b": b,
                "c": c,
                "w": weight,
                "dt": code,
                "n": count,
            }
            frames = node.codec.encode(self.k.rs_data, fields, raw[plan.byte_slice(c)])
            rnd.sent += node.send_frames((owner,), frames)
            if copies is not None:
                copies.append(((owner,), frames))
                if len(copies) > _COPY_LAG:
                    self._send_copy(rnd, copies.popleft())
            per_dest[owner] += 1
            if sent % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
        await self._send_copies(rnd, copies)
        rnd.rs_sent_to = per_dest
        self._announce_rs_end(rnd, self._end_copies(rnd))

    def _announce_rs_end(self, rnd: Round, copies: int = 1) -> None:
        """END of our reduce-scatter to each other participant: how many we sent it.

        ``copies`` are the same packet (one encoding): the first to arrive counts,
        the receiver's replay window drops the others.
        """
        codec = self.node.codec
        lossy = int(self._recent_loss())
        for peer in rnd.participants:
            if peer != rnd.me:
                end = {"r": rnd.r, "m": rnd.mode, "n": rnd.rs_sent_to[peer], "l": lossy}
                frames = codec.encode(self.k.rs_end, end)
                for _ in range(copies):
                    self.node.send_frames((peer,), frames)

    def _announce_ag_end(self, rnd: Round, copies: int = 1) -> None:
        """END of our all-gather to every other participant (one encoding for all)."""
        others = [p for p in rnd.participants if p != rnd.me]
        end = {"r": rnd.r, "m": rnd.mode, "n": rnd.ag_chunks_sent, "l": int(self._recent_loss())}
        frames = self.node.codec.encode(self.k.ag_end, end)
        for _ in range(copies):
            self.node.send_frames(others, frames)

    @staticmethod
    def _rs_order(rnd: Round) -> list[tuple[str, int, int]]:
        """(owner, bucket, chunk) in sending order: round-robin over the owners,
        each peer starting at the owner after itself.

        Why: shards are contiguous, so chunk order would make every peer send to
        the first owner at once, then all to the second: one receiver's buffers
        overflow while the others idle.  Staggered round-robin spreads the load
        over all receivers at every moment (and over a paced link's queues).
        """
        per_owner: dict[str, list[tuple[str, int, int]]] = {}
        for b, smap in enumerate(rnd.maps):
            for p in smap.participants:
                if p == rnd.me:
                    continue
                chunks = smap.chunks_of(p)
                if len(chunks):
                    per_owner.setdefault(p, []).extend((p, b, c) for c in chunks)
        parts = rnd.participants
        me = parts.index(rnd.me) if rnd.me in parts else 0
        ring = [parts[(me + i) % len(parts)] for i in range(1, len(parts))]
        queues = [per_owner[p] for p in ring if p in per_owner]
        longest = max((len(q) for q in queues), default=0)
        return [q[i] for i in range(longest) for q in queues if i < len(q)]

    def _finish_rs(self, rnd: Round) -> list[OwnedShard]:
        shards = []
        for b, plan in enumerate(rnd.plans):
            span = rnd.maps[b].owned_range(rnd.me)
            wsum = rnd.wsum[b]
            acc = rnd.acc[b]
            avg = acc
            if len(span):
                # one in-place pass: divide each chunk by the weight that arrived for it
                safe = wsum.to(acc.dtype).clamp_min(1e-30)
                n_full = len(span) // plan.chunk_elems
                if n_full:
                    acc[: n_full * plan.chunk_elems].view(n_full, plan.chunk_elems).div_(
                        safe[:n_full, None]
                    )
                if len(span) > n_full * plan.chunk_elems:
                    acc[n_full * plan.chunk_elems :].div_(safe[n_full])
                zero = wsum <= 0
                if bool(zero.any()):  # no weight arrived: keep our own values, never 0/0
                    own = rnd.src[b].narrow(0, span.start, len(span))
                    for c in torch.nonzero(zero).flatten().tolist():
                        lo = c * plan.chunk_elems
                        hi = min(lo + plan.chunk_elems, len(span))
                        acc[lo:hi].copy_(own[lo:hi])
            shards.append(OwnedShard(b, span.start, avg, wsum, rnd.count[b]))
        return shards

    async def _send_ag(
        self, rnd: Round, shards: list[OwnedShard], values: list[torch.Tensor]
    ) -> None:
        node = self.node
        others = [p for p in rnd.participants if p != rnd.me]
        sent = 0
        copies: collections.deque[_Send] | None = (
            collections.deque() if rnd.redundancy > 1 else None
        )
        for shard, value in zip(shards, values, strict=True):
            b = shard.bucket
            out = rnd.dst[b].narrow(0, shard.start, value.numel())
            out.copy_(value)  # cast to the bucket dtype
            plan = rnd.plans[b]
            code = DTYPE_CODES[out.dtype]
            # Sent from memory private to the round (``dst`` changes after the round,
            # queued sends must not), read-only so that ZeroMQ sends it to every
            # destination without copying.  The accumulator itself when it is what we
            # broadcast (a plain all-reduce): no copy at all.
            if value is shard.average and value.dtype == out.dtype:
                private = value
            else:
                private = rnd.pool.get(rnd.parity, "bcast", b, out.numel(), out.dtype)
                private.copy_(out)
            raw = as_bytes(private).toreadonly()
            rnd.broadcast.append(raw)
            base = shard.start * plan.itemsize
            owned = rnd.owned[b]
            for c in owned:
                if shard.weights[c - owned.start] <= 0:
                    continue  # no weighted contribution arrived: no average exists to share
                rnd.ag_chunks_sent += 1
                _, count = plan.chunk(c)
                span = plan.byte_slice(c)
                payload = raw[span.start - base : span.stop - base]
                fields = {"r": rnd.r, "m": rnd.mode, "b": b, "c": c, "dt": code, "n": count}
                # one encoding (one MAC) for every destination
                frames = node.codec.encode(self.k.ag_data, fields, payload)
                rnd.sent += node.send_frames(others, frames)
                if copies is not None:
                    copies.append((others, frames))
                    if len(copies) > _COPY_LAG:
                        self._send_copy(rnd, copies.popleft())
                sent += len(others)
                if sent >= _YIELD_EVERY:
                    sent = 0
                    await asyncio.sleep(0)
        await self._send_copies(rnd, copies)
        self._announce_ag_end(rnd, self._end_copies(rnd))

    def _send_copy(self, rnd: Round, send: _Send) -> None:
        """Send ``redundancy - 1`` more copies of one data packet.

        Why copies trail the originals by ``_COPY_LAG`` packets instead of going
        back to back: a burst of loss takes neighbouring packets together, so
        spaced copies are lost together far less often.  Why not a whole second
        pass: the receiver's replay window only spans ``replay_window_packets``
        sequence numbers, and a copy older than that would be dropped even when
        the original was lost.  The copies are the same packets (same sequence
        numbers): whichever arrives first counts, the replay window drops the rest.
        """
        peers, frames = send
        for _ in range(rnd.redundancy - 1):
            n = self.node.send_frames(peers, frames)
            rnd.sent += n
            rnd.copies_sent += n

    async def _send_copies(self, rnd: Round, sends: collections.deque[_Send] | None) -> None:
        """Flush the copies still trailing at the end of a phase's sends."""
        sent = 0
        while sends:
            peers, _ = send = sends.popleft()
            self._send_copy(rnd, send)
            sent += len(peers)
            if sent >= _YIELD_EVERY:
                sent = 0
                await asyncio.sleep(0)

    async def _wait_phase(
        self,
        phase: Phase,
        name: str,
        deadline: float,
        expected: Callable[[str], int],
        announce: Callable[[], None] | None = None,
    ) -> bool:
        """Wait until every expected END arrived, or give up; True if complete.

        Each sender gets its own learned allowance, counted from its first packet
        of the phase: ``phase_deadline_factor`` x the median first-packet-to-END
        span of recent senders, and never while it is still sending.  Why per
        sender: peers start a round at different times (compute skew), so a clock
        started at our own start would cut slow-but-alive peers, while one started
        at their first packet only cuts peers whose remaining packets are lost.
        A sender known to have moved past the phase (its packets of the next
        phase or round arrived, or its heartbeat announced a later round) is cut
        ``_MOVED_ON_GRACE_S`` after we learned it: everything it sent here is on
        the wire, and what has not arrived by then was lost.  This bounds the cost
        of lost END markers under bursty loss, and of a sender whose every packet
        was lost.  A silent sender with no such sign is waited for until
        ``deadline`` (the call's bound) or until membership declares it dead: it
        may simply have started late.

        ``announce`` re-sends our own END marker of the phase while we wait, at
        growing intervals (``_END_REPEAT_S`` doubling up to ``_END_REPEAT_MAX_S``):
        a tiny control packet, not data.  Why: under bursty loss all back-to-back
        END copies can be lost, and two peers that lost all of each other's
        packets would otherwise each wait for the other until the deadline.
        """
        clock = self.node.clock
        history = self._spans[name]
        interval = _END_REPEAT_S
        next_announce = clock.now() + interval
        while not phase.complete:
            # re-read each pass: senders finishing this very phase teach a cold engine
            per_packet = statistics.median(history) if history else float("inf")
            now = clock.now()
            if now >= deadline:
                return False
            pending = phase.expected - phase.done
            cut_at = deadline
            if all(p in phase.first or p in phase.moved_on for p in pending):
                cut_at = min(
                    deadline,
                    max(self._cut_time(phase, p, per_packet, expected(p)) for p in pending),
                )
                if now >= cut_at:
                    return False
            if announce is not None and now >= next_announce:
                announce()
                interval = min(2 * interval, _END_REPEAT_MAX_S)
                next_announce = now + interval
            wake_at = min(cut_at, next_announce) if announce is not None else cut_at
            phase.wake.clear()
            waiter = asyncio.ensure_future(phase.wake.wait())
            try:
                await self.node._wait_future(waiter, max(0.0, wake_at - now))
            except TimeoutError:
                pass
            finally:
                waiter.cancel()
        return True

    def _cut_time(self, phase: Phase, peer: str, per_packet: float, expected: int) -> float:
        """When to stop waiting for ``peer``: ``factor x`` its expected sending time
        (learned seconds per packet x packets expected) after its first packet, and
        never while it sent anything within ``phase_min_wait_s``."""
        cfg = self.node.config
        moved = phase.moved_on.get(peer)
        if moved is not None:
            return max(moved, phase.last.get(peer, moved)) + _MOVED_ON_GRACE_S
        allowance = max(
            cfg.phase_min_wait_s, cfg.phase_deadline_factor * per_packet * max(1, expected)
        )
        return max(phase.first[peer] + allowance, phase.last[peer] + cfg.phase_min_wait_s)

    # ------------------------------------------------------------------ receiving
    def _on_packet(self, pkt: Packet) -> None:
        r = pkt.fields.get("r")
        if not isinstance(r, int):
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
        if rnd is not None and r == rnd.r:
            if pkt.fields.get("m", 0) != rnd.mode:
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

    def _dispatch(self, rnd: Round, pkt: Packet) -> None:
        if pkt.src not in rnd.members:
            # outside this round's view (a Moshpit peer of another group, a peer that
            # joined after we started): its layout is not ours and no phase expects it
            self.dropped["not_participant"] += 1
            return
        kind = pkt.kind
        if kind == self.k.rs_data:
            self._on_rs(rnd, pkt)
        elif kind == self.k.ag_data:
            if rnd.sending:
                rnd.pending_ag.append(pkt)
            else:
                self._on_ag(rnd, pkt)
        elif kind in (self.k.rs_end, self.k.ag_end):
            phase = rnd.rs if kind == self.k.rs_end else rnd.ag
            n = pkt.fields.get("n")
            if isinstance(n, int) and n >= 0:
                phase.declared[pkt.src] = n
            self._peer_loss_flag(pkt)
            if pkt.src not in phase.done:
                span = phase.finish(pkt.src, self.node.clock.now())
                self._spans["rs" if kind == self.k.rs_end else "ag"].append(span)

    def _chunk_of(self, rnd: Round, pkt: Packet) -> tuple[int, int, torch.Tensor] | None:
        """Validate (bucket, chunk, dtype, count) against our plan; None = drop."""
        b, c = pkt.fields.get("b"), pkt.fields.get("c")
        if not (isinstance(b, int) and isinstance(c, int) and 0 <= b < len(rnd.plans)):
            self.dropped["bad_chunk"] += 1
            return None
        plan = rnd.plans[b]
        if not 0 <= c < plan.nchunks:
            self.dropped["bad_chunk"] += 1
            return None
        dtype = DTYPES.get(pkt.fields.get("dt", ""))
        _, count = plan.chunk(c)
        if dtype != plan.dtype or pkt.fields.get("n") != count:
            self.dropped["layout_mismatch"] += 1
            return None
        values = from_bytes(pkt.payload, dtype, count)
        if not all_finite(values):
            self.dropped["non_finite"] += 1
            return None
        return b, c, values

    def _on_rs(self, rnd: Round, pkt: Packet) -> None:
        w = pkt.fields.get("w", 1.0)
        if not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
            self.dropped["bad_weight"] += 1
            return
        if rnd.rs_closed:  # our averages are taken (and may be on the wire): too late
            self.dropped["late"] += 1
            rnd.late += 1
            return
        got = self._chunk_of(rnd, pkt)
        if got is None:
            return
        b, c, values = got
        owned = rnd.owned[b]
        if c not in owned:
            self.dropped["not_owner"] += 1  # the sender's view differs from ours
            return
        key = (pkt.src, b, c)
        if key in rnd.seen:
            self.dropped["duplicate"] += 1
            return
        rnd.seen.add(key)
        offset, count = rnd.plans[b].chunk(c)
        start = rnd.maps[b].owned_range(rnd.me).start
        rnd.acc[b][offset - start : offset - start + count].add_(values, alpha=float(w))
        rnd.wsum[b][c - owned.start] += float(w)
        rnd.count[b][c - owned.start] += 1
        rnd.rs.received[pkt.src] += 1
        rnd.rs.arrived(pkt.src, self.node.clock.now())
        if rnd.rs.received[pkt.src] >= rnd.expect_rs and pkt.src not in rnd.rs.done:
            self._spans["rs"].append(rnd.rs.finish(pkt.src, self.node.clock.now()))

    def _on_ag(self, rnd: Round, pkt: Packet) -> None:
        got = self._chunk_of(rnd, pkt)
        if got is None:
            return
        b, c, values = got
        if c in rnd.owned[b]:
            self.dropped["not_owner"] += 1
            return
        if bool(rnd.got[b][c]):
            self.dropped["duplicate"] += 1
            return
        rnd.plans[b].view(rnd.dst[b], c).copy_(values)
        rnd.got[b][c] = True
        rnd.ag.received[pkt.src] += 1
        rnd.ag.arrived(pkt.src, self.node.clock.now())
        if rnd.ag.received[pkt.src] >= rnd.ag_expected(pkt.src) and (pkt.src not in rnd.ag.done):
            self._spans["ag"].append(rnd.ag.finish(pkt.src, self.node.clock.now()))

    def _peer_loss_flag(self, pkt: Packet) -> None:
        """A peer's "I saw loss recently" flag, from its END markers or heartbeats."""
        if pkt.fields.get("l", pkt.fields.get(self._loss_key)):
            self._lossy_peers.add(pkt.src)
        else:
            self._lossy_peers.discard(pkt.src)

    def _on_heartbeat(self, pkt: Packet) -> None:
        self._peer_loss_flag(pkt)
        nxt = pkt.fields.get(self.tag)
        if not isinstance(nxt, int):
            return
        if nxt > self.max_seen:
            self.max_seen = nxt
        rnd = self._round
        if rnd is not None and nxt > rnd.r and pkt.src in rnd.members:
            # its beacon names the round after ours: it finished ours
            now = self.node.clock.now()
            rnd.rs.passed(pkt.src, now)
            rnd.ag.passed(pkt.src, now)

    def _on_membership(self, event: str, peer: str) -> None:
        rnd = self._round
        if rnd is None or event == "joined":
            return
        for phase in (rnd.rs, rnd.ag):
            phase.expected.discard(peer)
            phase.wake.set()
