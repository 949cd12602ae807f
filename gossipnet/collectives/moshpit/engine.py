"""Pieces of Moshpit averaging below the matchmaking: the group all-reduce engine,
report merging, small waits.  Internal to :mod:`gossipnet.collectives.moshpit.averager`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import msgpack
import torch

from gossipnet.collectives.lossy.engine import EngineKinds, LossyAllReduce, RoundOptions
from gossipnet.collectives.moshpit.kinds import MoshpitKind
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("GroupEngine", "members_of", "merge_reports", "wait_any")

#: The group all-reduce's packet kinds: Moshpit's range, apart from plain all-reduces.
MOSHPIT_KINDS = EngineKinds(
    MoshpitKind.RS_DATA,
    MoshpitKind.AG_DATA,
    MoshpitKind.RS_END,
    MoshpitKind.AG_END,
    MoshpitKind.REPAIR,
)


class GroupEngine(LossyAllReduce):
    """The lossy all-reduce on Moshpit's own kinds, run at a round number we choose.

    Why the round number: groups run the same Moshpit round at different times,
    and the engine's own catch-up (``max(next_round, max_seen)``) would let a
    packet from a faster group push us a round ahead of our own group.  Why the
    participant filter: a packet from a peer outside the group's list (a stale
    or confused view) must never enter the average; the leader's list is the
    single source of truth.
    """

    def __init__(self, node: Node, *, tag: str = "mp", kinds: EngineKinds = MOSHPIT_KINDS) -> None:
        super().__init__(node, tag=tag, kinds=kinds)

    async def run_at(
        self, r: int, buckets: list[torch.Tensor], options: RoundOptions | None = None
    ) -> CollectiveReport:
        """Run round ``r`` exactly (see the class); ``options`` as for ``run``."""
        # No await between these writes and run() reading them: the round is exactly r.
        self.next_round, self.max_seen = r, -1
        return await self.run(buckets, options)

    def _dispatch(self, rnd: Any, pkt: Packet) -> None:
        if pkt.src not in rnd.participants:
            self.dropped["not_participant"] += 1
            return
        super()._dispatch(rnd, pkt)


def members_of(payload: memoryview) -> list[str]:
    """The member list of a GROUP reply; [] if malformed."""
    try:
        members = msgpack.unpackb(bytes(payload), max_array_len=4096, max_str_len=1024)
    except Exception:
        return []
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        return []
    return sorted(set(members))


async def wait_any(clock: Any, aws: Sequence[Awaitable[object]], timeout_s: float) -> None:
    """Wait until one of ``aws`` finishes or ``timeout_s`` passes on the injected clock."""
    futs = [asyncio.ensure_future(a) for a in aws]
    sleeper = asyncio.ensure_future(clock.sleep(max(0.0, timeout_s)))
    try:
        await asyncio.wait({*futs, sleeper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        for f, a in zip(futs, aws, strict=True):
            if f is not a:  # a coroutine we wrapped: ours to cancel
                f.cancel()


def merge_reports(reports: Sequence[CollectiveReport]) -> CollectiveReport:
    """One report for a call of several rounds: sums, unions, and per-round extras."""
    if not reports:
        return CollectiveReport(method="moshpit")
    parts: set[str] = set()
    contrib: set[str] = set()
    missing: set[str] = set()
    for r in reports:
        parts.update(r.participants)
        contrib.update(r.contributors)
        missing.update(r.missing)
    received = sum(r.packets_received for r in reports)
    lost = sum(r.packets_lost for r in reports)
    sizes = [r.extra.get("group_size", 1.0) for r in reports]
    return CollectiveReport(
        round=reports[0].round,
        method="moshpit",
        participants=tuple(sorted(parts)),
        contributors=tuple(sorted(contrib)),
        missing=tuple(sorted(missing)),
        packets_sent=sum(r.packets_sent for r in reports),
        packets_received=received,
        packets_lost=lost,
        chunks_total=sum(r.chunks_total for r in reports),
        chunks_stale=sum(r.chunks_stale for r in reports),
        delivered_fraction=received / (received + lost) if received + lost else 1.0,
        elapsed_s=sum(r.elapsed_s for r in reports),
        timed_out=any(r.timed_out for r in reports),
        extra={
            "rounds": float(len(reports)),
            "last_round": float(reports[-1].round),
            "mean_group_size": sum(sizes) / len(sizes),
            "alone_rounds": float(sum(s < 2 for s in sizes)),
            "failovers": sum(r.extra.get("failovers", 0.0) for r in reports),
        },
    )
