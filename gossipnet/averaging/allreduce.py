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
(three copies, so all three are lost with probability p^3) that says how
many packets it sent.  A phase ends the moment every expected END arrived,
so time per round does not grow with the loss rate.  A deadline learned
from the spans of recent complete phases (``phase_deadline_factor`` x the
median span), capped by the call's timeout, bounds a phase when ENDs or a
whole peer are lost.

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
from dataclasses import dataclass, field

import torch

from .._node import Node
from ..rounds import CollectiveReport
from ..transport.wire import DTYPE_CODES, DTYPES, Kind, Packet
from .chunks import ChunkPlan, ShardMap, all_finite, as_bytes, auto_chunk_bytes, from_bytes

__all__ = ("ALLREDUCE_KINDS", "MOSHPIT_KINDS", "EngineKinds", "LossyAllReduce", "OwnedShard")

log = logging.getLogger(__name__)

END_COPIES = 5  # all lost with p^5: 0.2% per link at 30% loss
_YIELD_EVERY = 32  # packets sent between yields, so receiving never starves
_MAX_BUFFERED_PACKETS = 200_000
_SPAN_HISTORY = 64
_RS_SHARE = 0.6

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


@dataclass(slots=True)
class OwnedShard:
    """This peer's shard of one bucket after the reduce-scatter."""

    bucket: int
    start: int  # element offset in the bucket
    average: torch.Tensor  # averaged values (float32/float64), length = shard size
    weights: torch.Tensor  # per owned chunk: sum of weights that arrived
    contributors: torch.Tensor  # per owned chunk: number of contributions that arrived


@dataclass
class _Phase:
    """END bookkeeping of one phase (reduce-scatter or all-gather)."""

    expected: set[str]
    start: float = 0.0
    done: set[str] = field(default_factory=set)
    declared: dict[str, int] = field(default_factory=dict)
    received: collections.Counter[str] = field(default_factory=collections.Counter)
    first: dict[str, float] = field(default_factory=dict)  # first arrival per sender
    last: dict[str, float] = field(default_factory=dict)  # latest arrival per sender
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return self.expected <= self.done

    def arrived(self, src: str, now: float) -> None:
        if src not in self.first:
            self.first[src] = now
            self.wake.set()  # a new sender is active: its own deadline starts now
        self.last[src] = now

    def finish(self, src: str, now: float) -> float:
        """``src`` is complete; return its span per packet (first arrival to END / count).

        Per packet, so a history learned on small tensors still fits large ones.
        """
        self.arrived(src, now)
        self.done.add(src)
        self.wake.set()
        return (now - self.first[src]) / max(1, self.received[src])


class _Round:
    """State of one collective round on this peer."""

    def __init__(
        self,
        r: int,
        me: str,
        participants: tuple[str, ...],
        src: Sequence[torch.Tensor],
        dst: Sequence[torch.Tensor],
        weight: float,
        chunk_bytes: Sequence[int],
        mode: int = 0,
    ) -> None:
        self.r = r
        self.mode = mode
        self.me = me
        self.participants = participants
        # No private copy: every backend copies (or freezes) mutable frames inside
        # ``send`` (the Transport contract), so the caller may reuse ``src`` afterwards.
        self.src = list(src)
        self.dst = list(dst)
        self.plans = [
            ChunkPlan(int(b.numel()), b.dtype, cb)
            for b, cb in zip(self.src, chunk_bytes, strict=True)
        ]
        self.maps = [ShardMap(plan, participants) for plan in self.plans]
        self.owned = [m.chunks_of(me) for m in self.maps]
        self.acc: list[torch.Tensor] = []
        self.wsum: list[torch.Tensor] = []
        self.count: list[torch.Tensor] = []
        for b, buf in enumerate(self.src):
            span = self.maps[b].owned_range(me)
            acc_dtype = torch.float64 if buf.dtype == torch.float64 else torch.float32
            own = buf.narrow(0, span.start, len(span))
            self.acc.append(own.to(acc_dtype) * weight)
            n_owned = len(self.owned[b])
            self.wsum.append(torch.full((n_owned,), float(weight), dtype=torch.float64))
            self.count.append(torch.ones(n_owned, dtype=torch.int32))
        self.seen: set[tuple[str, int, int]] = set()
        self.got = [torch.zeros(p.nchunks, dtype=torch.bool) for p in self.plans]
        others = {p for p in participants if p != me}
        owns_any = any(len(o) for o in self.owned)
        self.rs = _Phase(expected=set(others) if owns_any else set())
        self.ag = _Phase(
            expected={p for p in others if any(len(m.chunks_of(p)) for m in self.maps)}
        )
        self.sending = True
        self.pending_ag: list[Packet] = []
        self.broadcast: list[bytes] = []  # our averaged shards' bytes, kept for repairs
        self.sent = 0
        self.late = 0
        self.ag_chunks_sent = 0
        # what a sender that shares our view sends us; receiving all of it completes
        # that sender even if all its END copies were lost
        self.expect_rs = sum(len(o) for o in self.owned)


class LossyAllReduce:
    """The all-reduce engine of one node; every method runs on the loop thread."""

    def __init__(
        self, node: Node, *, tag: str = "ar", kinds: EngineKinds = ALLREDUCE_KINDS
    ) -> None:
        self.node = node
        self.tag = tag
        self.k = kinds
        self.next_round = 0
        self.max_seen = -1
        self._round: _Round | None = None
        self._last: _Round | None = None  # serves repair requests after it ended
        self._buffered: dict[int, list[Packet]] = collections.defaultdict(list)
        self._nbuffered = 0
        self._spans: dict[str, collections.deque[float]] = {
            "rs": collections.deque(maxlen=_SPAN_HISTORY),
            "ag": collections.deque(maxlen=_SPAN_HISTORY),
        }
        self._lock = asyncio.Lock()
        self.dropped: collections.Counter[str] = collections.Counter()
        for kind in kinds.all():
            node.subscribe(kind, self._on_packet)
        node.on_heartbeat(self._on_heartbeat)
        node.on_membership(self._on_membership)
        node.beacon[self.tag] = 0

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

        Returns:
            The :class:`CollectiveReport` of the round; network faults never raise.
        """
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
    ) -> CollectiveReport:
        node, clock = self.node, self.node.clock
        t0 = clock.now()
        deadline = t0 + timeout_s
        r = max(self.next_round, self.max_seen)
        parts = tuple(sorted(participants)) if participants else tuple(node.alive_peers())
        rnd = _Round(r, node.peer_id, parts, src, dst, weight, self._chunk_sizes(src), mode)
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
                rnd.rs, "rs", rs_deadline, lambda _peer: rnd.expect_rs
            )
            shards = self._finish_rs(rnd)
            values = on_reduced(shards) if on_reduced else [s.average for s in shards]
            # all-gather: our averaged shards to everyone, then wait for the others'
            rnd.ag.start = clock.now()
            await self._send_ag(rnd, shards, values)
            ag_timed_out = not await self._wait_phase(
                rnd.ag, "ag", deadline, lambda peer: self._ag_default(rnd, peer)
            )
            if repair:
                ag_timed_out = not await self._repair(rnd, deadline) or ag_timed_out
            return self._report(rnd, clock.now() - t0, rs_timed_out or ag_timed_out)
        finally:
            self._round = None
            self._last = rnd
            node.beacon[self.tag] = self.next_round

    def _chunk_sizes(self, src: Sequence[torch.Tensor]) -> list[int]:
        """Per bucket: ``Config.chunk_bytes`` if set, else grown with the bucket."""
        fixed = self.node.config.chunk_bytes
        transport = self.node.transport
        base = transport.default_chunk_bytes if transport is not None else 64 * 1024
        cap = getattr(transport, "max_chunk_bytes", base)
        return [fixed or auto_chunk_bytes(b.numel() * b.element_size(), base, cap) for b in src]

    async def _send_rs(self, rnd: _Round, weight: float) -> None:
        node = self.node
        per_dest: collections.Counter[str] = collections.Counter()
        sent = 0
        for b, (buf, plan, smap) in enumerate(zip(rnd.src, rnd.plans, rnd.maps, strict=True)):
            code = DTYPE_CODES[buf.dtype]
            raw = as_bytes(buf)  # one view of the bucket, sliced per chunk: no per-chunk copy
            for c in range(plan.nchunks):
                owner = smap.owner(c)
                if owner == rnd.me:
                    continue
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
                if node.send(owner, self.k.rs_data, fields, raw[plan.byte_slice(c)]):
                    rnd.sent += 1
                per_dest[owner] += 1
                sent += 1
                if sent % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        for peer in rnd.participants:
            if peer != rnd.me:
                for _ in range(END_COPIES):
                    node.send(peer, self.k.rs_end, {"r": rnd.r, "m": rnd.mode, "n": per_dest[peer]})

    def _finish_rs(self, rnd: _Round) -> list[OwnedShard]:
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
        self, rnd: _Round, shards: list[OwnedShard], values: list[torch.Tensor]
    ) -> None:
        node = self.node
        others = [p for p in rnd.participants if p != rnd.me]
        sent = 0
        for shard, value in zip(shards, values, strict=True):
            b = shard.bucket
            out = rnd.dst[b].narrow(0, shard.start, value.numel())
            out.copy_(value)  # cast to the bucket dtype
            plan = rnd.plans[b]
            code = DTYPE_CODES[out.dtype]
            # sent from a private copy: ``dst`` changes after the round, queued sends don't;
            # ``bytes`` so that ZeroMQ sends it to every destination without copying
            mine = bytes(as_bytes(out))
            rnd.broadcast.append(mine)
            raw = memoryview(mine)
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
                rnd.sent += node.send_many(others, self.k.ag_data, fields, payload)
                sent += len(others)
                if sent >= _YIELD_EVERY:
                    sent = 0
                    await asyncio.sleep(0)
        end = {"r": rnd.r, "m": rnd.mode, "n": rnd.ag_chunks_sent}
        for _ in range(END_COPIES):
            node.send_many(others, self.k.ag_end, end)

    async def _wait_phase(
        self, phase: _Phase, name: str, deadline: float, expected: Callable[[str], int]
    ) -> bool:
        """Wait until every expected END arrived, or give up; True if complete.

        Each sender gets its own learned allowance, counted from its first packet
        of the phase: ``phase_deadline_factor`` x the median first-packet-to-END
        span of recent senders, and never while it is still sending.  Why per
        sender: peers start a round at different times (compute skew), so a clock
        started at our own start would cut slow-but-alive peers, while one started
        at their first packet only cuts peers whose remaining packets are lost.
        A sender that sent nothing yet is waited for until ``deadline`` (the
        call's bound) or until membership declares it dead.
        """
        clock = self.node.clock
        history = self._spans[name]
        while not phase.complete:
            # re-read each pass: senders finishing this very phase teach a cold engine
            per_packet = statistics.median(history) if history else float("inf")
            now = clock.now()
            if now >= deadline:
                return False
            pending = phase.expected - phase.done
            cut_at = deadline
            if all(p in phase.first for p in pending):
                cut_at = min(
                    deadline,
                    max(self._cut_time(phase, p, per_packet, expected(p)) for p in pending),
                )
                if now >= cut_at:
                    return False
            phase.wake.clear()
            waiter = asyncio.ensure_future(phase.wake.wait())
            try:
                await self.node._wait_future(waiter, max(0.0, cut_at - now))
            except TimeoutError:
                pass
            finally:
                waiter.cancel()
        return True

    def _cut_time(self, phase: _Phase, peer: str, per_packet: float, expected: int) -> float:
        """When to stop waiting for ``peer``: ``factor x`` its expected sending time
        (learned seconds per packet x packets expected) after its first packet, and
        never while it sent anything within ``phase_min_wait_s``."""
        cfg = self.node.config
        allowance = max(
            cfg.phase_min_wait_s, cfg.phase_deadline_factor * per_packet * max(1, expected)
        )
        return max(phase.first[peer] + allowance, phase.last[peer] + cfg.phase_min_wait_s)

    async def _repair(self, rnd: _Round, deadline: float) -> bool:
        """Re-request missing all-gather chunks from their owners; True when none is left.

        Requests are plain lossy packets (a lost request is simply sent again next
        pass); owners answer from the round's kept broadcast, also after they moved on.
        """
        clock = self.node.clock
        spans = self._spans["ag"]
        interval = max(
            self.node.config.phase_min_wait_s, 2 * statistics.median(spans) if spans else 0.05
        )
        while True:
            missing = self._missing(rnd)
            if not missing:  # nothing left that a live owner could still send
                return all(
                    bool(rnd.got[b][: o.start].all()) and bool(rnd.got[b][o.stop :].all())
                    for b, o in enumerate(rnd.owned)
                )
            if clock.now() >= deadline:
                return False
            for (owner, b), chunks in missing.items():
                for i in range(0, len(chunks), 4096):
                    part = torch.tensor(chunks[i : i + 4096], dtype=torch.int32)
                    self.node.send(
                        owner,
                        self.k.repair,
                        {"r": rnd.r, "b": b, "dt": "i32", "n": part.numel()},
                        as_bytes(part),
                    )
            await clock.sleep(min(interval, max(0.0, deadline - clock.now())))

    def _missing(self, rnd: _Round) -> dict[tuple[str, int], list[int]]:
        """(owner, bucket) -> chunk indices whose all-gather never arrived."""
        out: dict[tuple[str, int], list[int]] = {}
        for b, smap in enumerate(rnd.maps):
            mask = rnd.got[b].clone()
            owned = rnd.owned[b]
            mask[owned.start : owned.stop] = True
            for c in torch.nonzero(~mask).flatten().tolist():
                owner = smap.owner(c)
                if self.node.membership is not None and self.node.membership.is_alive(owner):
                    out.setdefault((owner, b), []).append(c)
        return out

    def _serve_repair(self, rnd: _Round, pkt: Packet) -> None:
        b = pkt.fields.get("b")
        if (
            not isinstance(b, int)
            or not 0 <= b < len(rnd.broadcast)
            or pkt.fields.get("dt") != "i32"
        ):
            self.dropped["bad_repair"] += 1
            return
        chunks = from_bytes(pkt.payload, torch.int32, len(pkt.payload) // 4).tolist()
        plan, owned = rnd.plans[b], rnd.owned[b]
        raw = memoryview(rnd.broadcast[b])
        base = owned.start * plan.chunk_elems * plan.itemsize
        code = DTYPE_CODES[rnd.dst[b].dtype]
        for c in chunks[:4096]:
            if c not in owned:
                continue
            _, count = plan.chunk(c)
            span = plan.byte_slice(c)
            fields = {"r": rnd.r, "m": rnd.mode, "b": b, "c": c, "dt": code, "n": count}
            if self.node.send(
                pkt.src, self.k.ag_data, fields, raw[span.start - base : span.stop - base]
            ):
                rnd.sent += 1

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
                    self._serve_repair(candidate, pkt)
                    return
            self.dropped["repair_unknown_round"] += 1
            return
        current = rnd.r if rnd is not None else self.next_round
        if r > self.max_seen:
            self.max_seen = r
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

    def _dispatch(self, rnd: _Round, pkt: Packet) -> None:
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
            if pkt.src not in phase.done:
                span = phase.finish(pkt.src, self.node.clock.now())
                self._spans["rs" if kind == self.k.rs_end else "ag"].append(span)

    def _chunk_of(self, rnd: _Round, pkt: Packet) -> tuple[int, int, torch.Tensor] | None:
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

    def _on_rs(self, rnd: _Round, pkt: Packet) -> None:
        w = pkt.fields.get("w", 1.0)
        if not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
            self.dropped["bad_weight"] += 1
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

    def _on_ag(self, rnd: _Round, pkt: Packet) -> None:
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
        if rnd.ag.received[pkt.src] >= self._ag_default(rnd, pkt.src) and (
            pkt.src not in rnd.ag.done
        ):
            self._spans["ag"].append(rnd.ag.finish(pkt.src, self.node.clock.now()))

    def _on_heartbeat(self, pkt: Packet) -> None:
        nxt = pkt.fields.get(self.tag)
        if isinstance(nxt, int) and nxt > self.max_seen:
            self.max_seen = nxt

    def _on_membership(self, event: str, peer: str) -> None:
        rnd = self._round
        if rnd is None or event == "joined":
            return
        for phase in (rnd.rs, rnd.ag):
            phase.expected.discard(peer)
            phase.wake.set()

    # ------------------------------------------------------------------ reporting
    def _report(self, rnd: _Round, elapsed: float, timed_out: bool) -> CollectiveReport:
        expected = 0
        received = 0
        for phase, default in ((rnd.rs, self._rs_default), (rnd.ag, self._ag_default)):
            for peer in phase.expected | phase.done:
                expected += phase.declared.get(peer, default(rnd, peer))
            received += sum(phase.received.values())
        contributors = {rnd.me} | set(rnd.rs.received) | set(rnd.ag.received)
        stale = 0
        total = 0
        for b, plan in enumerate(rnd.plans):
            total += plan.nchunks
            mask = rnd.got[b].clone()
            owned = rnd.owned[b]
            mask[owned.start : owned.stop] = True
            stale += int((~mask).sum())
        lost = max(0, expected - received)
        return CollectiveReport(
            round=rnd.r,
            method="allreduce",
            participants=rnd.participants,
            contributors=tuple(sorted(contributors)),
            missing=tuple(sorted(set(rnd.participants) - contributors)),
            packets_sent=rnd.sent,
            packets_received=received,
            packets_lost=lost,
            chunks_total=total,
            chunks_stale=stale,
            delivered_fraction=received / expected if expected else 1.0,
            elapsed_s=elapsed,
            timed_out=timed_out,
            extra={"late": float(rnd.late)},
        )

    @staticmethod
    def _rs_default(rnd: _Round, peer: str) -> int:
        return sum(len(o) for o in rnd.owned)

    @staticmethod
    def _ag_default(rnd: _Round, peer: str) -> int:
        return sum(len(m.chunks_of(peer)) for m in rnd.maps if peer in m.participants)
