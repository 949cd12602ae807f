"""The packet intake of the lossy all-reduce: what each arriving packet does.

Why its own module: the engine (:mod:`.engine`) drives rounds; this is the other
half, run from the transport's receive path.  A packet of the open round goes to
its phase (:mod:`.scatter`, :mod:`.gather`), a drain's data chunks in runs
(batched intake), a packet of a later round waits in a bounded buffer, an older
one is counted late (and teaches the reorder window how late), heartbeats and
ENDs carry the peers' round numbers and loss flags.  A round id from a peer is
its claim (:mod:`.claims`): one past our window is counted (``round_jump``) and
kept clamped, and a data packet that far ahead is dropped, never buffered.
:class:`Intake` is a mixin of :class:`~.engine.LossyAllReduce`: it reads and
moves the engine's state (declared below), so the two stay one object on the
loop thread.
"""

from __future__ import annotations

import collections
from typing import cast

from gossipnet.collectives.lossy import repair as _repair
from gossipnet.collectives.lossy.claims import RoundClaims
from gossipnet.collectives.lossy.context import PhaseContext, PhaseName
from gossipnet.collectives.lossy.cut import ReorderWindow, StallWindow
from gossipnet.collectives.lossy.gather import on_ag, on_ag_batch
from gossipnet.collectives.lossy.layout import layout_conflict
from gossipnet.collectives.lossy.loss_watch import LossWatch
from gossipnet.collectives.lossy.packets import EngineKinds
from gossipnet.collectives.lossy.round import Phase, Round
from gossipnet.collectives.lossy.round_id import MAX_LAYOUT_DESC, valid_mode, valid_round
from gossipnet.collectives.lossy.scatter import accept_rs_batch, on_rs, rs_parts
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("MAX_BUFFERED_PACKETS", "Intake")

#: Packets of rounds we have not started yet, kept at most (then ``buffer_full``).
MAX_BUFFERED_PACKETS = 200_000
#: Added to a data kind in :meth:`Intake._fast_kind`: a parity packet of that phase
#: (packet kinds are 16-bit, so no kind carries this bit).
_PARITY_RUN = 1 << 16


class Intake:
    """Receive side of :class:`~.engine.LossyAllReduce` (every method on the loop thread)."""

    node: Node
    tag: str
    k: EngineKinds
    next_round: int
    max_seen: int
    claims: RoundClaims
    dropped: collections.Counter[str]
    loss: LossWatch
    peer_layouts: dict[str, tuple[int, str]]
    _round: Round | None
    _last: Round | None
    _buffered: dict[int, list[Packet]]
    _nbuffered: int
    _spans: dict[PhaseName, collections.deque[float]]
    _reorder: ReorderWindow
    _stalls: StallWindow
    _stall_key: str
    _loss_key: str
    _layout_key: str

    @property
    def _ctx(self) -> PhaseContext:
        """This engine as its phases see it (the engine satisfies the protocol)."""
        return cast(PhaseContext, self)

    def _on_batch(self, pkts: list[Packet]) -> None:
        """Packets of one drain, in order.  Data chunks of our open round go in runs
        of one kind: reduce-scatter contributions are checked one by one and added
        together (:func:`.scatter.accept_rs_batch`), all-gather chunks written
        together (:func:`.gather.on_ag_batch`), parity packets taken one by one; any
        other packet first flushes the run before it, then takes :meth:`_on_packet`:
        all act in arrival order."""
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

    def _replay_early(self, rnd: Round, pkts: list[Packet]) -> None:
        """Packets of ``rnd`` that came before we started it, in arrival order.

        Reduce-scatter chunks go in runs (:func:`.scatter.accept_rs_batch`): on a
        busy machine most of a round's contributions can arrive before our own
        compute ends, and one call chain per chunk cost as much as the drain
        that buffered them.  Every other packet takes :meth:`_dispatch`.
        """
        run: list[Packet] = []
        rs = self.k.rs_data
        for pkt in pkts:
            if pkt.fields.get("m", 0) != rnd.mode:
                self.dropped["mode_mismatch"] += 1
                continue
            if self._fast_kind(rnd, pkt) == rs:
                run.append(pkt)
                continue
            if run:
                self._flush(rnd, rs, run)
                run = []
            self._dispatch(rnd, pkt)
        if run:
            self._flush(rnd, rs, run)

    def _flush(self, rnd: Round, kind: int, run: list[Packet]) -> None:
        parity, kind = kind & _PARITY_RUN, kind & ~_PARITY_RUN
        if kind == self.k.ag_data:
            now = self.node.clock.now()
            for pkt in run:  # its reduce-scatter is sent (as _on_packet notes)
                rnd.rs.passed(pkt.src, now)
            if not parity:
                on_ag_batch(self._ctx, rnd, run)
                return
        if parity:  # each rebuilds at most one chunk: one call each
            take = on_ag if kind == self.k.ag_data else on_rs
            for pkt in run:
                take(self._ctx, rnd, pkt)
            return
        parts, vals, where = rs_parts(self._ctx, rnd, run)
        if parts:
            accept_rs_batch(self._ctx, rnd, parts, vals, where)

    def _fast_kind(self, rnd: Round, pkt: Packet) -> int:
        """``pkt``'s kind if it is a data chunk of our round that :meth:`_on_packet`
        would hand straight to :func:`.scatter.on_rs` or :func:`.gather.on_ag`; that
        kind plus ``_PARITY_RUN`` for such a parity packet (``"g"``: the same checks,
        then one call each instead of :meth:`_on_packet`'s chain); else -1."""
        f, kind = pkt.fields, pkt.kind
        if kind == self.k.rs_data:
            if rnd.rs_closed:
                return -1
        elif kind != self.k.ag_data or rnd.sending:
            return -1
        r, m = f.get("r"), f.get("m", 0)
        if not (
            type(r) is int
            and r == rnd.r
            and type(m) is int
            and m == rnd.mode
            and f.get("L") == rnd.layout
            and pkt.src in rnd.members
            and "z" not in f  # compressed: decoded one by one (.scatter, .gather)
        ):
            return -1
        return kind | _PARITY_RUN if "g" in f else kind

    def _on_packet(self, pkt: Packet) -> None:
        r, mode = pkt.fields.get("r"), pkt.fields.get("m", 0)
        if not valid_round(r) or not valid_mode(mode):
            self.dropped["bad_round"] += 1
            return
        rnd = self._round
        if pkt.kind == self.k.repair:
            for candidate in (rnd, self._last):
                if candidate is not None and candidate.r == r:
                    _repair.serve_repair(self._ctx, candidate, pkt)
                    return
            self.dropped["repair_unknown_round"] += 1
            return
        current = rnd.r if rnd is not None else self.next_round
        if r > current and not self._claim(pkt.src, r)[1]:
            return  # beyond the window (counted): no round we can reach
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
            if self._nbuffered >= MAX_BUFFERED_PACKETS:
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
                self.note_stall(last, pkt)

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
            layout_conflict(self._ctx, rnd, pkt, layout)
            return
        kind = pkt.kind
        if "z" in pkt.fields and kind in (self.k.rs_data, self.k.ag_data):
            # compressed data (few packets a round): one sent twice arrives behind its
            # sender's later packets only where its original was lost (the replay
            # window drops a second arrival), so this sees the loss copies repaired;
            # unseen, the network would look quiet and the copies and ENDs stop
            top = rnd.top_seq.get(pkt.src, -1)
            if pkt.seq < top:
                rnd.arrived_behind += 1
            else:
                rnd.top_seq[pkt.src] = pkt.seq
        if kind == self.k.rs_data:
            on_rs(self._ctx, rnd, pkt)
        elif kind == self.k.ag_data:
            if rnd.sending:
                rnd.pending_ag.append(pkt)
            else:
                on_ag(self._ctx, rnd, pkt)
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

    def note_stall(self, rnd: Round, pkt: Packet) -> None:
        """A data packet of ``rnd`` arrived after its phase was over: if its sender had
        been cut mid-stream (no END, not complete), it was alive and only quiet."""
        if pkt.kind not in (self.k.rs_data, self.k.ag_data):
            return
        phase = rnd.rs if pkt.kind == self.k.rs_data else rnd.ag
        src = pkt.src
        last = phase.last.get(src)
        if last is None or src in phase.done or src in phase.ended or src in phase.resumed:
            return
        phase.resumed.add(src)
        self._stalls.observe(self.node.clock.now() - last, rnd.r)
        self.node.beacon[self._stall_key] = round(1000 * self._stalls.own(rnd.r))

    def quiet_wait(self, rnd: Round) -> float:
        return self._stalls.allowance(rnd.r)

    def _peer_loss_flag(self, pkt: Packet) -> None:
        """A peer's "I saw loss recently" flag, from its END markers or heartbeats."""
        self.loss.peer_flag(pkt.src, bool(pkt.fields.get("l", pkt.fields.get(self._loss_key))))

    def _on_heartbeat(self, pkt: Packet) -> None:
        self._peer_loss_flag(pkt)
        stall_ms = pkt.fields.get(self._stall_key, 0)
        if type(stall_ms) is int and 0 <= stall_ms <= 60_000:
            self._stalls.heard(pkt.src, stall_ms / 1000)
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
        nxt = self._claim(pkt.src, nxt, latest=True)[0]
        rnd = self._round
        if rnd is not None and nxt != rnd.r:
            # members and non-members alike: a peer that declared everyone dead while
            # it was frozen runs its next round alone, and hears them only here (who
            # of them counts is decided at alignment: .claims, the electorate)
            rnd.elsewhere[pkt.src] = max(nxt, rnd.elsewhere.get(pkt.src, -1))
        if rnd is not None and nxt > rnd.r and pkt.src in rnd.members:
            # its beacon names the round after ours: it finished ours
            now = self.node.clock.now()
            rnd.rs.passed(pkt.src, now)
            rnd.ag.passed(pkt.src, now)

    def _claim(self, src: str, r: int, *, latest: bool = False) -> tuple[int, bool]:
        """``src`` says it is at round ``r`` (:meth:`.claims.RoundClaims.claim`);
        one beyond the window is counted (``round_jump``) and kept clamped."""
        kept, within = self.claims.claim(src, r, self.next_round, latest=latest)
        if not within:
            self.dropped["round_jump"] += 1
        if kept > self.max_seen:
            self.max_seen = kept
        return kept, within
