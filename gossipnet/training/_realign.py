"""The all-reduce strategy's repairs: realign a peer that fell out of step, and
repair a replica whose digest the others outvoted; both only on evidence.

Why downloads: in the sharded optimizer every peer steps the shard it owns and
broadcasts it, so a peer whose parameters are no longer the others' (it missed
steps while stalled, ran a step alone, or a resync left it stale) would push
its wrong values into everyone's replica the next time it owns a shard.
Averaging it back in would only spread the error; taking the position (step
count, round numbering) and the parameters the others hold ends it.

Why evidence (:mod:`._evidence`): whoever sets a peer's replica sets the model.
So "behind" and "ahead" count only verified participants (peers heard taking part
in our recent rounds), and a state is adopted only when a quorum of them claim the
same position in the manifests they serve; of the parameters, only the chunks that
a quorum lists with the same digest are taken, and each downloaded chunk must hash
to that digest.  The peers are asked for their parameters at a *target* step a
little ahead of where they are, so honest ones publish at the same step.  Chunks
without a quorum (a broadcast one of them lost, or our own shard, which each of
them estimated alone while we were away) stay ours; the next round's broadcasts
overwrite every chunk but our own shard.  Nothing else comes from a donor:
hyperparameters and optimizer state stay ours (the sharded optimizer state is
each peer's own; no other peer could vouch for a donor's copy of it).  The bytes
are raw parameters of our own layout, never unpickled; a manifest of another size
is refused before anything is kept.  A state not adopted is counted
(:attr:`Realigner.rejected`, ``node.stats()``) and reported, and training goes on.

Downloads run on the training thread between steps, where the tensors are ours.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Collection, Mapping
from typing import Any, Protocol

import torch

from gossipnet.collectives.lossy.round_id import (
    EXPLICIT_RESYNC,
    Alignment,
    optimizer_round,
    step_of_round,
)
from gossipnet.collectives.statesync.manifest import DIGEST_BYTES
from gossipnet.collectives.statesync.snapshot import chunk_digest
from gossipnet.collectives.statesync.sync import Manifests, Snapshot, TransferReport
from gossipnet.reports import CollectiveReport
from gossipnet.training import _snapshot
from gossipnet.training._evidence import LIVE, Claim, ParticipantLog, vouched, vouched_chunks
from gossipnet.training._evidence import quorum as quorum_of
from gossipnet.training.host import TrainingHost
from gossipnet.training.replicas import ReplicaCheck, digest

__all__ = ("Realigner", "Replica")

log = logging.getLogger(__name__)

#: Steps past a donor's current one at which it is asked to publish its live state:
#: far enough that every donor is still short of it when asked, so all publish there.
TARGET_LEAD_STEPS = 2


class Replica(Protocol):
    """What realignment reads and replaces: the all-reduce strategy's replica."""

    #: held while a step, resync or download changes parameters or optimizer state
    state_lock: threading.Lock
    #: steps done
    step_count: int

    @property
    def round_base(self) -> int: ...

    def param_buckets(self) -> list[torch.Tensor]: ...

    def adopt_rounds(self, round_base: int, next_round: int | None = None) -> None: ...


class Realigner:
    """Serves our replica's state and replaces it with a vouched one when needed.

    Args:
        host: the peer.
        replica: the strategy whose state is served and replaced.
        sync_timeout_s: bound of gathering claims, and of downloading, in seconds.
    """

    def __init__(self, host: TrainingHost, replica: Replica, sync_timeout_s: float) -> None:
        self.host = host
        self.replica = replica
        self.sync_timeout_s = sync_timeout_s
        #: the last state download (realignment or replica repair), its report
        self.last_sync: TransferReport | None = None
        #: the last replica-digest verdict acted on (see :meth:`after_step`)
        self.last_replica_check: ReplicaCheck | None = None
        #: states not adopted, by reason ("unvouched": no position had a quorum;
        #: "non_finite", "layout": the vouched chunks could not be written)
        self.rejected: collections.Counter[str] = collections.Counter()
        self.participants = ParticipantLog(host.peer_id)
        self.digest_rid: int | None = None  # the resync our latest digest is of
        self._checked_rid: int | None = None  # the resync whose verdict we acted on
        self._serving = False
        self._fallback: frozenset[str] = frozenset()  # see ParticipantLog.verified
        self._hint = 0  # a live target learned from claims that came in too far along
        #: (step, next round, report): the position last taken was the others' right
        #: after their resync at that step, which needs no round of ours while we stand
        #: there (see :meth:`_after_their_resync`); None otherwise
        self.resynced: tuple[int, int, CollectiveReport] | None = None
        host.node.drop_counters["realign"] = self.rejected  # in node.stats()

    # ------------------------------------------------------------------ evidence
    def judge(self, align: Alignment) -> Alignment:
        """Record who took part in the round just run and return its alignment with
        only verified participants in "ahead" and "behind" (loop thread)."""
        self.participants.note(align)
        if not self.participants.verified():
            self._fallback = self.host.optimizer_engine.senders_ahead()
        return self.participants.judge(align, self._fallback)

    def verified(self) -> frozenset[str]:
        """The verified participants now (not us)."""
        return self.participants.verified(self._fallback)

    # ------------------------------------------------------------------ serving
    def _live(self) -> Snapshot:
        """Our parameters and their claim, as a snapshot (the caller holds the lock
        or is the training thread)."""
        replica, sync = self.replica, self.host.statesync
        assert sync is not None
        buckets = replica.param_buckets()
        claim = Claim(
            replica.step_count,
            replica.round_base,
            self.host.optimizer_engine.next_round,
            _snapshot.layout_key(buckets),
        )
        data = _snapshot.pack_params(buckets)
        return _snapshot.snapshot(data, sync.chunk_bytes, claim.step, claim.to_meta())

    def _live_wanted(self) -> bool:
        sync = self.host.statesync
        if sync is None:
            return False
        target = sync.wanted_at(LIVE)
        return sync.wanted or (target is not None and target <= self.replica.step_count)

    def publish_state(self) -> None:
        """Serve our parameters with their claim (training thread, between steps)."""
        sync = self.host.statesync
        if sync is None:
            return
        snap = self._live()

        async def on_loop() -> None:
            _snapshot.install(sync, snap)

        self.host.call(on_loop())

    def serve_idle(self) -> None:
        """A peer asked for our state (loop thread): publish it now if the trainer is not
        inside a step and we are where it asked, so a peer that must realign is served
        even when we are between steps or done training; else the trainer publishes
        after the step that gets there."""
        sync = self.host.statesync
        if sync is None or self._serving or not self._live_wanted():
            return
        self._serving = True
        lock = self.replica.state_lock

        def build() -> Snapshot | None:  # a worker thread: hashing must not stall the loop
            if not lock.acquire(blocking=False):
                return None
            try:
                return self._live()
            finally:
                lock.release()

        async def publish() -> None:
            try:
                snap = await asyncio.to_thread(build)
                if snap is not None:
                    _snapshot.install(sync, snap)
            finally:
                self._serving = False

        sync.node.spawn(publish(), "state-publish")

    # ------------------------------------------------------------------ repairing
    def after_step(self, report: CollectiveReport, align: Alignment | None) -> None:
        """Realign if this round showed us out of step (``align``: judged, see
        :meth:`judge`), else act on the last resync's digest verdict; then serve our
        state if a peer asked for it here."""
        if align is not None and (align.we_are_behind or align.we_are_ahead):
            others = align.ahead if align.we_are_behind else align.behind
            where = "behind" if align.we_are_behind else "ahead of"
            voters = self.verified() & set(self.host.alive_peers())
            base = self.replica.round_base
            steps = [step_of_round(max(0, r - base)) for r in others.values()]
            at = _robust_top(steps, quorum_of(len(voters) + 1))
            why = f"{where} the others ({len(others)} heard only in other rounds)"
            ok = self.adopt_vouched(voters, at, why, report)
            report.extra["realigned"] = float(ok)
        elif self.digest_rid is not None and self.digest_rid != self._checked_rid:
            self._check_replicas(report)
        if self._live_wanted():
            self.publish_state()

    def _check_replicas(self, report: CollectiveReport) -> None:
        """Act on the digest verdict of our last resync once it is decided: say which
        replicas disagree, and adopt the majority's state if it outvotes us."""
        me = self.host.peer_id
        check = self.host.replica_check()
        if not _decided(check, len(check.digests) + len(check.missing)):
            return
        self._checked_rid = check.round_id
        self.last_replica_check = check
        if check.disagree:
            report.extra["replicas_disagree"] = float(len(check.disagree))
            log.warning(
                "peer %s: replicas disagree after resync round %s: %s differ from the"
                " majority", me, check.round_id, list(check.disagree),
            )  # fmt: skip
        if check.outvoted(me):
            voters = (set(check.digests) | set(check.missing)) - {me}
            why = "our replica disagrees with the majority"
            ok = self.adopt_vouched(voters, self.replica.step_count, why, report)
            report.extra["replica_repaired"] = float(ok)

    def adopt_vouched(
        self, voters: Collection[str], at: int, why: str, report: CollectiveReport
    ) -> bool:
        """Take the position a quorum of ``voters`` claim, and the parameter chunks a
        quorum of them agree on; True if the position was taken.

        ``at``: the step the voters are at (or about to finish); they are asked for
        their parameters at step ``at + TARGET_LEAD_STEPS``.  Never raises for what a
        peer sent: a state not adopted is counted in :attr:`rejected` and in
        ``report.extra``.
        """
        sync = self.host.statesync
        if sync is None or not voters:
            return False
        n = len(voters) + 1
        buckets = self.replica.param_buckets()
        size, layout = _snapshot.raw_size(buckets), _snapshot.layout_key(buckets)
        coro = sync.manifests(
            sorted(voters), [(LIVE, max(at + TARGET_LEAD_STEPS, self._hint))],
            timeout_s=self.sync_timeout_s, max_bytes=size,
            enough=lambda got: _position(got, n, layout, size)[0] is not None,
        )  # fmt: skip
        got = self.host.call(coro, self.sync_timeout_s + 30)
        if not got and self._hint <= at:
            # nobody reached the target: the donors stopped short of it (training over,
            # or paused between runs of steps), so ask for where they stand; donors
            # that stopped at one step publish one state there, and a quorum can vouch
            coro = sync.manifests(
                sorted(voters), [(LIVE, at)],
                timeout_s=self.sync_timeout_s, max_bytes=size,
                enough=lambda got: _position(got, n, layout, size)[0] is not None,
            )  # fmt: skip
            got = self.host.call(coro, self.sync_timeout_s + 30)
        claim, holders = _position(got, n, layout, size)
        if claim is None:
            self._unvouched(got, voters, n, why, report)
            return False
        chunk = int(holders[0][1]["cb"])
        vouch = vouched_chunks({p: _digests(m) for p, m in holders}, n)
        ours = _digests_of(_snapshot.pack_params(buckets), chunk)
        wanted = {c: d for c, d in vouch.items() if ours[c] != d}
        parts, rep = self.host.call(
            sync.fetch_chunks(wanted, holders, timeout_s=self.sync_timeout_s),
            self.sync_timeout_s + 30,
        )
        self.last_sync = rep
        replica = self.replica
        with replica.state_lock:
            reason = _snapshot.write_chunks(buckets, parts, chunk)
            if not reason:
                replica.step_count = claim.step
                replica.adopt_rounds(claim.round_base, claim.next_round)
        if reason:
            self._reject(reason, report)
            log.warning("peer %s: %s: the vouched parameters were not adopted (%s)",
                        self.host.peer_id, why, reason)  # fmt: skip
            return False
        self._hint = 0
        total = len(ours)
        report.extra["chunks_adopted"] = float(len(parts))
        report.extra["chunks_kept"] = float(total - len(vouch) + len(wanted) - len(parts))
        self._adopted(claim, rep, n, len(holders), (len(vouch), total), why, report)
        self._after_their_resync(claim, [p for p, _ in holders], buckets)
        return True

    def _after_their_resync(
        self, claim: Claim, holders: list[str], buckets: list[torch.Tensor]
    ) -> None:
        """Take over the resync a taken position already ran, if it ran one.

        A position whose next round is past its step's first resync slot holds the
        donors' parameters after their resync at that step (the last round they ran,
        ``next_round - 1``): typically the end of training, where they ran the final
        ``opt.resync()`` before we came back.  Our own resync at that step would run a
        round no one else runs (theirs is over) and announce a digest no one else
        announces, so every verdict would be ours alone.  Instead the parameters just
        taken are that resync's result: their digest is announced for that round, with
        the holders as its voters (``net.replicas_agree()`` then compares them with
        theirs), and :attr:`resynced` lets the strategy's next resync at this step
        return at once while we stand there (no step, no round since).
        """
        self.resynced = None
        first = claim.round_base + optimizer_round(claim.step, EXPLICIT_RESYNC)
        replicas = self.host.replicas
        if claim.next_round <= first or replicas is None:
            return
        rid = claim.next_round - 1
        value = digest(buckets)
        me = self.host.peer_id

        async def on_loop() -> None:
            replicas.publish(rid, value, holders)

        self.host.call(on_loop())
        self.digest_rid = rid  # acted on after our next step, as any resync's verdict
        self.resynced = (
            claim.step,
            claim.next_round,
            CollectiveReport(
                round=rid,
                method="resync",
                participants=tuple(sorted({me, *holders})),
                contributors=tuple(sorted({me, *holders})),
                extra={"realigned": 1.0},
            ),
        )

    def _adopted(
        self,
        claim: Claim,
        rep: TransferReport,
        n: int,
        holders: int,
        chunks: tuple[int, int],
        why: str,
        report: CollectiveReport,
    ) -> None:
        me = self.host.peer_id
        log.warning(
            "peer %s: %s: took step %d, which %d of %d participants claim, and the %d of %d"
            " parameter chunks a quorum of them agree on (%d bytes from %s in %.2f s)",
            me, why, claim.step, holders, n, chunks[0], chunks[1], rep.nbytes,
            list(rep.sources_tried), rep.elapsed_s,
        )  # fmt: skip
        if n == 2:
            report.extra["unwitnessed"] = 1.0
            log.warning(
                "peer %s: with one other participant no third peer can witness its state;"
                " taken on its word (training._evidence.ADOPT_ON_ONE_WORD)", me,
            )  # fmt: skip

    def _unvouched(
        self,
        got: Manifests,
        voters: Collection[str],
        n: int,
        why: str,
        report: CollectiveReport,
    ) -> None:
        """No position reached a quorum: count it, say what came, aim later next time."""
        self.last_sync = TransferReport(sources_tried=tuple(sorted(voters)))
        self._reject("unvouched", report)
        claims = [c for m in got.values() if (c := Claim.from_meta(m["m"])) is not None]
        if claims:  # donors were past the target: ask beyond them next time
            steps = [c.step for c in claims]
            self._hint = _robust_top(steps, quorum_of(n)) + TARGET_LEAD_STEPS
        positions = collections.Counter((c.step, c.round_base, c.next_round) for c in claims)
        log.warning(
            "peer %s: %s, but no position has a quorum of the %d participants behind it"
            " (%d manifests; positions %s): training on with ours",
            self.host.peer_id, why, n, len(got), dict(positions),
        )  # fmt: skip

    def _reject(self, reason: str, report: CollectiveReport) -> None:
        self.rejected[reason] += 1
        report.extra["state_rejected"] = report.extra.get("state_rejected", 0.0) + 1.0


def _robust_top(steps: list[int], need: int) -> int:
    """The highest step that at least ``need`` of ``steps`` reach (or, with fewer,
    the lowest): one peer announcing a step far ahead cannot move a target there."""
    ranked = sorted(steps, reverse=True)
    return ranked[min(len(ranked), max(1, need)) - 1]


def _digests(man: Mapping[str, Any]) -> list[bytes]:
    """A manifest's chunk digests, one per chunk."""
    d = man["d"]
    return [d[i : i + DIGEST_BYTES] for i in range(0, len(d), DIGEST_BYTES)]


def _digests_of(data: bytes, chunk: int) -> list[bytes]:
    """The chunk digests of ``data`` cut in ``chunk``-byte chunks (as a manifest lists)."""
    view = memoryview(data)
    n = max(1, -(-len(data) // chunk))
    return [chunk_digest(view[c * chunk : (c + 1) * chunk]) for c in range(n)]


def _position(
    got: Manifests, n: int, layout: str, size: int
) -> tuple[Claim | None, list[tuple[str, Mapping[str, Any]]]]:
    """The claim a quorum of ``n`` holds among manifests of our layout and size, with
    each holder's manifest (all of one chunking); (None, []) if none has."""
    groups: dict[int, dict[str, Claim]] = collections.defaultdict(dict)
    mans: dict[str, Mapping[str, Any]] = {}
    for (peer, _target), man in got.items():
        claim = Claim.from_meta(man["m"])
        if claim is not None and claim.layout == layout and man["sz"] == size:
            groups[man["cb"]][peer] = claim
            mans[peer] = man
    for claims in groups.values():
        found = vouched(claims, n)
        if found is not None:
            claim, peers = found
            return claim, [(p, mans[p]) for p in peers]
    return None, []


def _decided(check: ReplicaCheck, voters: int) -> bool:
    """Whether the verdict can no longer change: every voter reported, or the majority
    already holds more than half of them."""
    if check.round_id is None:
        return False
    if not check.missing:
        return True
    return len(check.holders) * 2 > voters
