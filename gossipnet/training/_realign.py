"""The all-reduce strategy's repairs: realign a peer that fell out of step, and
repair a replica whose digest the others outvoted.

Why downloads: in the sharded optimizer every peer steps the shard it owns and
broadcasts it, so a peer whose parameters are no longer the others' (it missed
steps while stalled, ran a step alone, or a resync left it stale) would push
its wrong values into everyone's replica the next time it owns a shard.
Averaging it back in would only spread the error; copying the state of a peer
that is right ends it.  The download (``collectives.statesync``: chunked,
checksummed, from a snapshot the donor publishes at its next step) brings the
parameters, this peer's optimizer state and the step count, so the peer's
next round has the others' round id again.

Downloads run on the training thread between steps, where the tensors are ours.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Protocol

import torch

from gossipnet.collectives.lossy.round_id import Alignment
from gossipnet.collectives.statesync.sync import Snapshot, TransferReport, pack_state, unpack_state
from gossipnet.errors import LayoutMismatchError
from gossipnet.reports import CollectiveReport
from gossipnet.training import _snapshot
from gossipnet.training.host import TrainingHost
from gossipnet.training.replicas import ReplicaCheck

__all__ = ("Realigner", "Replica")

log = logging.getLogger(__name__)


class Replica(Protocol):
    """What realignment reads and replaces: the all-reduce strategy's replica."""

    #: held while a step, resync or download changes parameters or optimizer state
    state_lock: threading.Lock

    @property
    def step_count(self) -> int: ...

    def param_buckets(self) -> list[torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def adopt_rounds(self, round_base: int) -> None: ...


class Realigner:
    """Serves our replica's state and replaces it with a right peer's when needed.

    Args:
        host: the peer.
        replica: the strategy whose state is served and replaced.
        sync_timeout_s: bound of one state download in seconds.
    """

    def __init__(self, host: TrainingHost, replica: Replica, sync_timeout_s: float) -> None:
        self.host = host
        self.replica = replica
        self.sync_timeout_s = sync_timeout_s
        #: the last state download (realignment or replica repair), its report
        self.last_sync: TransferReport | None = None
        #: the last replica-digest verdict acted on (see :meth:`after_step`)
        self.last_replica_check: ReplicaCheck | None = None
        self.digest_rid: int | None = None  # the resync our latest digest is of
        self._checked_rid: int | None = None  # the resync whose verdict we acted on
        self._serving = False

    # ------------------------------------------------------------------ serving
    def _pack(self) -> bytes:
        replica = self.replica
        return pack_state(
            {
                "params": [b.detach().cpu() for b in replica.param_buckets()],
                "optim": replica.state_dict(),
                "step": replica.step_count,
            }
        )

    def publish_state(self) -> None:
        """Serve our parameters, optimizer state and step count to a peer that asked."""
        _snapshot.publish(self.host, self._pack, self.replica.step_count)

    def serve_idle(self) -> None:
        """A peer asked for our state (loop thread): publish it now if the trainer is not
        inside a step, so a peer that must realign is served even when we are between
        steps or done training; else the trainer publishes after its step."""
        sync = self.host.statesync
        if sync is None or self._serving:
            return
        self._serving = True
        lock = self.replica.state_lock

        def build() -> Snapshot | None:  # a worker thread: hashing must not stall the loop
            if not lock.acquire(blocking=False):
                return None
            try:
                return _snapshot.snapshot(self._pack(), sync.chunk_bytes, self.replica.step_count)
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
    def download_state(self, donors: list[str], why: str) -> TransferReport | None:
        """Adopt the state of one of ``donors`` (published after we asked); None if none
        could serve it in time (then we train on with our own and say so).

        Raises:
            LayoutMismatchError: the donor's model has another layout than ours.
        """
        sync = self.host.statesync
        if sync is None or not donors:
            return None
        me, replica = self.host.peer_id, self.replica
        coro = sync.download(sources=donors, timeout_s=self.sync_timeout_s, max_age_s=0.0)
        data, rep = self.host.call(coro, self.sync_timeout_s + 30)
        self.last_sync = rep
        if data is None:
            log.warning("peer %s: %s, but no state came from %s in time", me, why, donors)
            return rep
        state = unpack_state(data)
        buckets = replica.param_buckets()
        theirs = state["params"]
        if [(t.dtype, t.numel()) for t in theirs] != [(b.dtype, b.numel()) for b in buckets]:
            raise LayoutMismatchError(
                f"peer {me}: the state {rep.source} sent has another layout than our model;"
                " every peer must build the same model"
            )
        before = replica.step_count
        with replica.state_lock:
            with torch.no_grad():
                for b, t in zip(buckets, theirs, strict=True):
                    b.copy_(t)
            replica.load_state_dict(state["optim"])
            replica.adopt_rounds(int(state["optim"].get("round_base", 0)))
        log.warning(
            "peer %s: %s: adopted %s's state (step %d -> %d, %d bytes in %.2f s)",
            me, why, rep.source, before, replica.step_count, rep.nbytes, rep.elapsed_s,
        )  # fmt: skip
        return rep

    def after_step(self, report: CollectiveReport, align: Alignment | None) -> None:
        """Realign if this round showed us out of step, else act on the last resync's
        digest verdict; then serve our state if a peer asked for it."""
        if align is not None and (align.we_are_behind or align.we_are_ahead):
            donors = sorted(align.ahead if align.we_are_behind else align.behind)
            where = "behind" if align.we_are_behind else "ahead of"
            why = f"{where} the others ({len(donors)} heard only in other rounds)"
            rep = self.download_state(donors, why)
            report.extra["realigned"] = float(bool(rep and rep.ok))
        elif self.digest_rid is not None and self.digest_rid != self._checked_rid:
            self._check_replicas(report)
        sync = self.host.statesync
        if sync is not None and sync.wanted:
            self.publish_state()

    def _check_replicas(self, report: CollectiveReport) -> None:
        """Act on the digest verdict of our last resync once it is decided: say which
        replicas disagree, and download the majority's state if we are outvoted."""
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
            donors = sorted(p for p, d in check.digests.items() if d == check.majority)
            rep = self.download_state(donors, "our replica disagrees with the majority")
            report.extra["replica_repaired"] = float(bool(rep and rep.ok))


def _decided(check: ReplicaCheck, alive: int) -> bool:
    """Whether the verdict can no longer change: everyone reported, or the majority
    already holds more than half of the alive peers."""
    if check.round_id is None:
        return False
    if not check.missing:
        return True
    held = sum(1 for d in check.digests.values() if d == check.majority)
    return held * 2 > alive
