"""State of one all-reduce round on one peer: phases, reducers, the report.

Split from :mod:`gossipnet.collectives.lossy.engine` so the protocol modules (the
engine there, the phases in :mod:`.scatter` and :mod:`.gather`) hold what is
sent when and what a packet does, and this one the bookkeeping they update:
per-phase END accounting, the reduce-scatter's reducers (:mod:`.reducer`, the
arithmetic alone), which all-gather chunks arrived, and the
:class:`CollectiveReport` built from them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gossipnet.collectives.chunks import ChunkPlan, ShardMap
from gossipnet.collectives.lossy.compressed import ChunkCodec
from gossipnet.collectives.lossy.reducer import ShardReducer
from gossipnet.collectives.lossy.robust import CenteredClip, ClippingReducer
from gossipnet.collectives.lossy.round_id import layout_of
from gossipnet.collectives.lossy.wirebytes import ByteMeter
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.waker import Waker
from gossipnet.transport.wire import Packet

__all__ = ("BufferPool", "Phase", "Round")


class BufferPool:
    """Scratch tensors of an engine's rounds (accumulators, broadcast copies), reused.

    Why: a round of a 25M-element all-reduce on 4 peers needs a 25 MB accumulator
    and broadcast copy per peer; fresh ones cost a page fault per 4 KiB, measured
    at ~10% of the CPU of a whole round.  Why two sets used in alternation: the
    previous round's buffers still back its broadcast, which answers repair
    requests after the round ended and may still sit in a slow peer's send queue.
    A buffer reused while a packet of it is still queued makes that packet fail
    its MAC at the receiver (counted, never used): see ``transport.base.is_frozen``.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[int, str, int], torch.Tensor] = {}
        self._parity = 0

    def next_round(self) -> int:
        """Switch to the other set; returns its index, to pass to :meth:`get`."""
        self._parity ^= 1
        return self._parity

    def get(
        self, parity: int, name: str, bucket: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """An uninitialised 1-D tensor, the same one as two rounds ago if the shape fits."""
        key = (parity, name, bucket)
        t = self._slots.get(key)
        if t is None or t.numel() != numel or t.dtype != dtype:
            t = torch.empty(numel, dtype=dtype)
            self._slots[key] = t
        return t

    def scratch(self, name: str, bucket: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`get` from a single set, the same tensor every round: for what no
        packet is sent from and nothing reads once the reduce-scatter is averaged
        (the reducers' stores of contributions)."""
        return self.get(-1, name, bucket, numel, dtype)


@dataclass
class Phase:
    """END bookkeeping of one phase (reduce-scatter or all-gather)."""

    expected: set[str]
    start: float = 0.0
    done: set[str] = field(default_factory=set)
    declared: dict[str, int] = field(default_factory=dict)
    received: collections.Counter[str] = field(default_factory=collections.Counter)
    first: dict[str, float] = field(default_factory=dict)  # first arrival per sender
    last: dict[str, float] = field(default_factory=dict)  # latest arrival per sender
    latest: float = float("-inf")  # latest arrival from any sender
    # when we learned the sender is past this phase (a later phase's or round's packet,
    # a heartbeat's round): whatever it sent here is sent, so lost ENDs cost little
    moved_on: dict[str, float] = field(default_factory=dict)
    # when each sender's END arrived, and, for an END that arrived ahead of some of
    # the data it closes, until when we still wait for that data (a learned window)
    ended: dict[str, float] = field(default_factory=dict)
    hold: dict[str, float] = field(default_factory=dict)
    # senders cut mid-stream whose late packets already taught their stall (.cut.StallWindow)
    resumed: set[str] = field(default_factory=set)
    wake: Waker = field(default_factory=Waker)  # set on any change wait_phase must see

    @property
    def complete(self) -> bool:
        return self.expected <= self.done

    def arrived(self, src: str, now: float) -> None:
        if src not in self.first:
            self.first[src] = now
            self.wake.set()  # a new sender is active: its own deadline starts now
        self.last[src] = now
        self.latest = now

    def passed(self, src: str, now: float) -> None:
        """``src`` has moved past this phase: cut it shortly unless it completes."""
        if src in self.expected and src not in self.done and src not in self.moved_on:
            self.moved_on[src] = now
            self.wake.set()

    def held_back(self, src: str, declared: int) -> bool:
        """Whether ``src``'s END is waiting for data it declared that has not come."""
        return src in self.hold and self.received[src] < declared

    def end(
        self, src: str, declared: int | None, now: float, reorder_wait: Callable[[], float]
    ) -> float | None:
        """``src``'s END arrived, declaring ``declared`` packets; its span if complete.

        Not complete while data it declares is missing and ``reorder_wait()``
        (a learned window, :class:`.cut.ReorderWindow`) says that data may still
        come: the sender is held until then.  None also for a repeated END.
        """
        if declared is not None:
            self.declared[src] = declared
        if src in self.done or src in self.hold:
            return None
        self.ended.setdefault(src, now)
        if declared is not None and self.received[src] < declared:
            wait = reorder_wait()  # data it closes may be overtaken
            if wait > 0:
                self.arrived(src, now)
                self.hold[src] = now + wait
                self.wake.set()
                return None
        return self.finish(src, now)

    def finish(self, src: str, now: float) -> float:
        """``src`` is complete; return its span per packet (first arrival to END / count).

        Per packet, so a history learned on small tensors still fits large ones.
        """
        self.arrived(src, now)
        self.done.add(src)
        self.wake.set()
        return (now - self.first[src]) / max(1, self.received[src])


class Round:
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
        redundancy: int = 1,
        pool: BufferPool | None = None,
        in_place: bool = False,
        *,
        robust: CenteredClip | None = None,
    ) -> None:
        self.r = r
        self.mode = mode
        self.weight = weight
        self.codec: ChunkCodec | None = None  # set by the engine for a compressed round
        self.me = me
        self.participants = participants
        self.members = frozenset(participants)
        # No private copy: every backend copies (or freezes) mutable frames inside
        # ``send`` (the Transport contract), so the caller may reuse ``src`` afterwards.
        self.src = list(src)
        self.dst = list(dst)
        self.plans = [
            ChunkPlan(int(b.numel()), b.dtype, cb)
            for b, cb in zip(self.src, chunk_bytes, strict=True)
        ]
        self.maps = [ShardMap(plan, participants) for plan in self.plans]
        # every packet of the round says so to the transport (``Transport.send``), which
        # then keeps them on one channel per peer: an END never overtakes its data
        self.group_bytes = max((p.chunk_bytes for p in self.plans), default=0)
        self._ag_expect: dict[str, int] = {}  # ag_expected's answers
        # what every data packet carries so that no other layout is mixed in (.round_id)
        self.layout, self.layout_desc = layout_of(self.plans)
        self.ident = {"r": r, "m": mode, "L": self.layout}  # opens every packet's fields
        # members heard only in other rounds (latest id), and members whose packets
        # carried another layout (their fingerprint): see .round_id.alignment
        self.elsewhere: dict[str, int] = {}
        self.layout_conflicts: dict[str, int] = {}
        self.owned = [m.chunks_of(me) for m in self.maps]
        self.pool = pool or BufferPool()
        self.parity = self.pool.next_round()
        # the reduce-scatter's sums, one per bucket (.reducer: the arithmetic alone)
        self.reducers = [self._reducer(b, weight, in_place, robust) for b in range(len(self.src))]
        self.got = [torch.zeros(p.nchunks, dtype=torch.bool) for p in self.plans]
        # the same memory as numpy: one read or write per packet costs ~0.1 us, not ~3 us
        self.got_np = [g.numpy() for g in self.got]
        self._start_phases(redundancy)

    def _start_phases(self, redundancy: int) -> None:
        """Both phases' END bookkeeping and the round's counters, all at zero."""
        others = {p for p in self.participants if p != self.me}
        owns_any = any(len(o) for o in self.owned)
        self.rs = Phase(expected=set(others) if owns_any else set())
        self.ag = Phase(expected={p for p in others if any(len(m.chunks_of(p)) for m in self.maps)})
        self.sending = True
        self.rs_closed = False  # the shards are averaged: later contributions are late
        self.pending_ag: list[Packet] = []
        self.broadcast: list[memoryview] = []  # our averaged shards' bytes, kept for repairs
        self.sent = 0
        # bytes of the round's packets the transport accepted (.wirebytes), and the
        # engine's running total they are added to as well (set by the engine)
        self.wire = ByteMeter()
        self.wire_total = ByteMeter()
        # per phase ("rs", "ag"): header and MAC bytes of one of our data packets
        self.data_overhead: dict[str, int] = {}
        self.late = 0
        self.repaired = False  # NACK repair ran (a resync): late answers teach no reorder
        self.ag_chunks_sent = 0
        self.rs_sent_to: collections.Counter[str] = collections.Counter()
        self.redundancy = redundancy
        # the all-gather's copies (the engine raises both for compressed rounds)
        self.ag_redundancy = redundancy
        self.copies_sent = 0
        # compressed data packets that arrived behind a later packet of their sender
        # (a copy standing in for a lost original, or reordering): loss that the
        # copies hid, which LossWatch must still see (.intake, ._dispatch)
        self.top_seq: dict[str, int] = {}
        self.arrived_behind = 0
        # XOR parity (.parity): our group size this round (0 = none), the payloads of
        # streams that announce parity (kept to recover a group's one lost member)
        self.fec_k = 0
        self.fec_held: dict[tuple[str, int, int], memoryview] = {}
        self.parity_sent = 0
        self.recovered = 0
        # per bucket, the mean step of each chunk that arrived (NaN: not measured);
        # only while an optimizer estimates missed steps (.stale_step)
        self.step_mag: list[torch.Tensor] | None = None
        # what a sender that shares our view sends us; receiving all of it completes
        # that sender even if all its END copies were lost
        self.expect_rs = sum(len(o) for o in self.owned)

    def _reducer(
        self, b: int, weight: float, in_place: bool, robust: CenteredClip | None
    ) -> ShardReducer:
        """Bucket ``b``'s reducer over our own values of our shard (in ``src`` or a pool
        copy); with ``robust``, one that keeps every contribution (:mod:`.robust`)."""
        buf = self.src[b]
        span = self.maps[b].owned_range(self.me)
        acc_dtype = torch.float64 if buf.dtype == torch.float64 else torch.float32
        own = buf.narrow(0, span.start, len(span))
        if (
            in_place
            and weight > 0
            and acc_dtype == buf.dtype
            and buf.data_ptr() == (self.dst[b].data_ptr())
        ):
            # ``dst`` is ``src`` and no one reads our own shard of it before the
            # average lands there: accumulate in place, no copy in or out
            # (weight > 0: a chunk with no weight would need the values back)
            acc = own
        else:
            acc = self.pool.get(self.parity, "acc", b, len(span), acc_dtype)
            acc.copy_(own)
        step = self.plans[b].chunk_elems
        if robust is not None:
            return ClippingReducer(
                acc, self.owned[b], step, weight, robust, self.participants, self.me
            )
        # the others' parts, added in this (the round's) order: the sum does not
        # depend on arrival order, so a lossless round replays bit for bit
        senders = [p for p in self.participants if p != self.me]
        row = len(self.owned[b]) * step
        store = self.pool.scratch("parts", b, len(senders) * row, acc_dtype)
        store = store.view(len(senders), row)
        return ShardReducer(acc, self.owned[b], step, weight, senders, store=store)

    def rs_expected(self, peer: str) -> int:
        """Reduce-scatter packets ``peer`` sends us if it shares our view."""
        return self.expect_rs

    def ag_expected(self, peer: str) -> int:
        """All-gather packets ``peer`` sends us if it shares our view (its owned chunks)."""
        n = self._ag_expect.get(peer)
        if n is None:  # asked once per arriving chunk; the maps are the round's, fixed
            n = sum(len(m.chunks_of(peer)) for m in self.maps if peer in m.participants)
            self._ag_expect[peer] = n
        return n

    def owes_us(self, peer: str) -> bool:
        """Whether ``peer`` has data to send us this round if it shares our view: every
        other participant when we own a chunk (its contributions), else only the
        owners of chunks (their broadcasts).  Fixed by the round's maps, so a peer
        cut mid-round still owes what it never sent."""
        return bool(self.expect_rs) or self.ag_expected(peer) > 0

    def report(self, elapsed: float, timed_out: bool) -> CollectiveReport:
        """The round's :class:`CollectiveReport`: who contributed, sent, received, lost.

        ``missing`` names the participants that owed us data (:meth:`owes_us`) and
        sent nothing that arrived; one with nothing to send us (with fewer chunks
        than participants, a peer owning none, seen from another owning none) is not
        missing here: the owners it owed name it if it was absent.
        """
        rnd = self
        expected = 0
        received = 0
        for phase, default in ((rnd.rs, self.rs_expected), (rnd.ag, self.ag_expected)):
            for peer in phase.expected | phase.done:
                expected += phase.declared.get(peer, default(peer))
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
        received -= rnd.recovered  # rebuilt from parity: delivered, but lost on the wire
        lost = max(0, expected - received)
        return CollectiveReport(
            round=rnd.r,
            method="allreduce",
            participants=rnd.participants,
            contributors=tuple(sorted(contributors)),
            missing=tuple(
                sorted(p for p in rnd.participants if p not in contributors and rnd.owes_us(p))
            ),
            packets_sent=rnd.sent,
            packets_received=received,
            packets_lost=lost,
            chunks_total=total,
            chunks_stale=stale,
            delivered_fraction=received / expected if expected else 1.0,
            elapsed_s=elapsed,
            timed_out=timed_out,
            extra={
                "late": float(rnd.late),
                "copies_sent": float(rnd.copies_sent),
                "parity_sent": float(rnd.parity_sent),
                "recovered": float(rnd.recovered),
                "arrived_behind": float(rnd.arrived_behind),
                "bytes_sent": float(rnd.wire.total),
            },
        )
