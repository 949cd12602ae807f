"""The all-reduce optimizer's repairs: realign a peer that fell out of step, and
repair a replica whose digest the others outvoted.

Why downloads: in the sharded optimizer every peer steps the shard it owns and
broadcasts it, so a peer whose parameters are no longer the others' (it missed
steps while stalled, ran a step alone, or a resync left it stale) would push
its wrong values into everyone's replica the next time it owns a shard.
Averaging it back in would only spread the error; copying the state of a peer
that is right ends it.  The download (``averaging.statesync``: chunked,
checksummed, from a snapshot the donor publishes at its next step) brings the
parameters, this peer's optimizer state and the step count, so the peer's
next round has the others' round id again.

Both run on the training thread between steps, where the tensors are ours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from gossipnet.collectives.lossy.round_id import Alignment
from gossipnet.collectives.statesync.sync import Snapshot, TransferReport, pack_state, unpack_state
from gossipnet.errors import LayoutMismatchError
from gossipnet.reports import CollectiveReport
from gossipnet.training.replicas import ReplicaCheck

if TYPE_CHECKING:
    from gossipnet.training.optimizer import GossipOptimizer

__all__ = ("after_step", "download_state", "publish_state", "serve_idle")

log = logging.getLogger(__name__)


def publish_state(opt: GossipOptimizer) -> None:
    """Serve our parameters, optimizer state and step count to a peer that asked.

    Hashed here on the training thread, installed on the loop thread (the loop
    never reads tensors the trainer writes).
    """
    sync = opt.peer._statesync
    if sync is None:
        return
    snap = _snapshot(opt, sync.chunk_bytes)

    async def install() -> None:
        sync.install(dataclasses.replace(snap, created=sync.node.clock.now()))

    opt.peer._call(install())


def _snapshot(opt: GossipOptimizer, chunk_bytes: int) -> Snapshot:
    data = pack_state(
        {
            "params": [b.detach().cpu() for b in opt._param_buckets()],
            "optim": opt.state_dict(),
            "step": opt.step_count,
        }
    )
    return Snapshot.of(data, chunk_bytes, {"step": opt.step_count}, 0.0)


def serve_idle(opt: GossipOptimizer) -> None:
    """A peer asked for our state (loop thread): publish it now if the trainer is not
    inside a step, so a peer that must realign is served even when we are between
    steps or done training; else the trainer publishes after its step."""
    sync = opt.peer._statesync
    if sync is None or opt._serving:
        return
    opt._serving = True

    def build() -> Snapshot | None:  # a worker thread: hashing must not stall the loop
        if not opt.state_lock.acquire(blocking=False):
            return None
        try:
            return _snapshot(opt, sync.chunk_bytes)
        finally:
            opt.state_lock.release()

    async def publish() -> None:
        try:
            snap = await asyncio.to_thread(build)
            if snap is not None:
                sync.install(dataclasses.replace(snap, created=sync.node.clock.now()))
        finally:
            opt._serving = False

    sync.node.spawn(publish(), "state-publish")


def download_state(opt: GossipOptimizer, donors: list[str], why: str) -> TransferReport | None:
    """Adopt the state of one of ``donors`` (published after we asked); None if none
    could serve it in time (then we train on with our own and say so)."""
    sync = opt.peer._statesync
    if sync is None or not donors:
        return None
    me = opt.peer.peer_id
    coro = sync.download(sources=donors, timeout_s=opt.sync_timeout_s, max_age_s=0.0)
    data, rep = opt.peer._call(coro, opt.sync_timeout_s + 30)
    opt.last_sync = rep
    if data is None:
        log.warning("peer %s: %s, but no state came from %s in time", me, why, donors)
        return rep
    state = unpack_state(data)
    buckets = opt._param_buckets()
    theirs = state["params"]
    if [(t.dtype, t.numel()) for t in theirs] != [(b.dtype, b.numel()) for b in buckets]:
        raise LayoutMismatchError(
            f"peer {me}: the state {rep.source} sent has another layout than our model;"
            " every peer must build the same model"
        )
    before = opt.step_count
    with opt.state_lock:
        with torch.no_grad():
            for b, t in zip(buckets, theirs, strict=True):
                b.copy_(t)
        opt.load_state_dict(state["optim"])
        opt.adopt_rounds(int(state["optim"].get("round_base", 0)))
    log.warning(
        "peer %s: %s: adopted %s's state (step %d -> %d, %d bytes in %.2f s)",
        me, why, rep.source, before, opt.step_count, rep.nbytes, rep.elapsed_s,
    )  # fmt: skip
    return rep


def _decided(check: ReplicaCheck, alive: int) -> bool:
    """Whether the verdict can no longer change: everyone reported, or the majority
    already holds more than half of the alive peers."""
    if check.round_id is None:
        return False
    if not check.missing:
        return True
    held = sum(1 for d in check.digests.values() if d == check.majority)
    return held * 2 > alive


def after_step(opt: GossipOptimizer, report: CollectiveReport, align: Alignment | None) -> None:
    """Realign if this round showed us out of step, else act on the last resync's
    digest verdict; then serve our state if a peer asked for it."""
    peer = opt.peer
    me = peer.peer_id
    if align is not None and (align.we_are_behind or align.we_are_ahead):
        donors = sorted(align.ahead if align.we_are_behind else align.behind)
        where = "behind" if align.we_are_behind else "ahead of"
        why = f"{where} the others ({len(donors)} heard only in other rounds)"
        rep = download_state(opt, donors, why)
        report.extra["realigned"] = float(bool(rep and rep.ok))
    elif opt._digest_rid is not None and opt._digest_rid != opt._checked_rid:
        check = peer.replica_check()
        if _decided(check, len(check.digests) + len(check.missing)):
            opt._checked_rid = check.round_id
            opt.last_replica_check = check
            if check.disagree:
                report.extra["replicas_disagree"] = float(len(check.disagree))
                log.warning(
                    "peer %s: replicas disagree after resync round %s: %s differ from the"
                    " majority", me, check.round_id, list(check.disagree),
                )  # fmt: skip
            if check.outvoted(me):
                donors = sorted(p for p, d in check.digests.items() if d == check.majority)
                rep = download_state(opt, donors, "our replica disagrees with the majority")
                report.extra["replica_repaired"] = float(bool(rep and rep.ok))
    sync = peer._statesync
    if sync is not None and sync.wanted:
        publish_state(opt)
