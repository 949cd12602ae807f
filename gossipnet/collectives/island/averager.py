"""Islands across processes: one process per GPU (torchrun), Blink inside, lossy across.

Why: under torchrun each GPU has its own process and its own gossipnet peer, so
:func:`.hierarchical.island_all_reduce` (one process, several GPUs) never applies, and
every GPU would speak on the lossy network although NVLink joins them.  Here the
processes of one machine whose GPUs form an NVLink island
(:func:`~gossipnet.collectives.blink.detect.detect`)
become one island; a round of :meth:`gossipnet.Peer.island_average` is

1. discovery (first call, and whenever the alive set changed): each peer tells the
   others (host id, device, NVLink island label); equal (host, label) = one island,
   its leader the lowest peer id.  Every peer computes the same partition from the
   same table (:func:`plan_islands`);
2. members copy their values into a buffer shared with the leader (``/dev/shm`` file
   or CUDA IPC, handed over once per layout) and send READY;
3. the leader runs the Blink reduce over every island buffer (CudaExecutor or
   CpuExecutor, the same schedule; :class:`.hierarchical.IslandAverager`), carries the
   island mean through the lossy all-reduce among the *leaders only* (weight = island
   members that made it), Blink-broadcasts the result back and sends DONE;
4. members copy the result out.  A member whose leader dies or misses the deadline
   keeps its own values and its report says so (``extra["leader_lost"]``).

Every call consumes exactly one round of the peer's all-reduce engine, leader or not
(members advance theirs without sending), so peers stay in step whatever role they
had, and a member promoted to leader after a death joins the right round.

Fallback: no CUDA, no topology, no NVLink, CPU tensors without a ``device``: the peer
is its own island and the call is the plain lossy all-reduce (among the leaders).

Known limits: buffers must be float (a mean); every process must see every GPU of
the machine (``CUDA_VISIBLE_DEVICES`` per process makes it fall back); a member that
gave up on a leader which is only slow, not dead, may have its next round's buffer
overwritten by that late leader.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from gossipnet.collectives.chunks import FlatBuffer, all_finite
from gossipnet.collectives.island.proto import DONE_EXCLUDED, DONE_OK, IslandControl, IslandInfo
from gossipnet.collectives.island.share import SharedBuckets, host_id, load_handles, open_handles
from gossipnet.collectives.lossy.engine import LossyAllReduce
from gossipnet.collectives.lossy.options import RoundOptions
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.node import Node

if TYPE_CHECKING:
    from gossipnet.collectives.blink.topology import GpuTopology
    from gossipnet.collectives.island.hierarchical import IslandAverager

__all__ = ("IslandAverage", "IslandHost", "island_label", "plan_islands")

log = logging.getLogger(__name__)
T = TypeVar("T")

READY_SHARE = 0.25  # of the timeout, for the leader to wait for its members' READY


class IslandHost(Protocol):
    """What the island path needs from the peer it runs for: a blocking call into
    the peer's loop thread and the peer's lossy all-reduce engine.

    Why a Protocol: this layer sits under the facade and must not import
    :class:`gossipnet.Peer`; the facade hands in an adapter over its runtime.
    """

    @property
    def lossy(self) -> LossyAllReduce:
        """The peer's all-reduce engine (its rounds are the island's rounds)."""
        ...

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the peer's loop thread and wait (see ``Runtime.call``)."""
        ...


def island_label(topology: GpuTopology | None, device: int | None, cuda: bool) -> int:
    """The smallest GPU id of ``device``'s NVLink component, or -1 (no island)."""
    if topology is None or device is None or device not in topology.gpus:
        return -1
    if cuda and torch.cuda.device_count() < len(topology.gpus):
        return -1  # this process sees only some GPUs: topology ids are not its indices
    comp = next(c for c in topology.islands() if device in c)
    return min(comp) if len(comp) > 1 else -1


def plan_islands(table: Mapping[str, IslandInfo]) -> list[tuple[str, ...]]:
    """Partition the peers into islands, each sorted (its leader first).

    Equal (host, cuda, label >= 0) share an island; of peers that claim one device
    the lowest id joins and the others stay alone.  Deterministic in ``table``.
    """
    groups: dict[tuple[str, bool, int], dict[int, str]] = {}
    alone: list[str] = []
    for peer in sorted(table):
        info = table[peer]
        if info.label < 0:
            alone.append(peer)
            continue
        devs = groups.setdefault((info.host, info.cuda, info.label), {})
        if info.device in devs:
            alone.append(peer)
        else:
            devs[info.device] = peer
    islands = [tuple(sorted(g.values())) for g in groups.values()]
    return sorted(islands + [(p,) for p in alone])


def _layout_key(tensors: Sequence[torch.Tensor]) -> str:
    text = repr([(tuple(t.shape), str(t.dtype), str(t.device)) for t in tensors])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class IslandAverage:
    """The island path of one peer.  ``control`` lives on the loop thread; the rest
    (buffers, averagers) on the caller's thread, one call at a time (a lock)."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self.control = IslandControl(node)
        self._lock = threading.Lock()
        self._calls = 0
        self._flats: dict[str, FlatBuffer] = {}
        self._shared: dict[str, SharedBuckets] = {}
        self._shared_with: set[tuple[str, str]] = set()
        self._remote: dict[tuple[str, str], tuple[bytes, list[torch.Tensor]]] = {}
        self._averagers: dict[tuple[tuple[int, ...], bool], IslandAverager] = {}

    def average(
        self,
        host: IslandHost,
        tensors: Sequence[torch.Tensor],
        timeout: float | None = None,
        *,
        topology: GpuTopology | None = None,
        device: int | None = None,
    ) -> CollectiveReport:
        """See :meth:`gossipnet.Peer.island_average`."""
        if not tensors:
            raise ValueError("island_average needs at least one tensor")
        with self._lock:
            return self._average(host, tensors, timeout, topology, device)

    def _average(
        self,
        host: IslandHost,
        tensors: Sequence[torch.Tensor],
        timeout: float | None,
        topology: GpuTopology | None,
        device: int | None,
    ) -> CollectiveReport:
        cfg, me = self._node.config, self._node.peer_id
        t_s = cfg.collective_timeout_s if timeout is None else timeout
        clock = self._node.clock
        t0 = clock.now()
        key = _layout_key(tensors)
        flat = self._flats.get(key)
        if flat is None:
            if len(self._flats) > 8:
                self._flats.clear()
            flat = self._flats[key] = FlatBuffer(tensors)
        buckets = list(flat.flatten(tensors))
        cuda = flat.device.type == "cuda"
        if cuda:
            if device is None:
                device = flat.device.index or 0
            if topology is None:
                from gossipnet.collectives.island.hierarchical import _detected

                topology = _detected()
        label = island_label(topology, device, cuda)
        info = IslandInfo(host_id(), cuda, -1 if device is None else device, label)
        r = self._calls
        self._calls += 1
        ctl = self.control
        table = host.call(ctl.discover(info, min(cfg.control_timeout_s, t_s / 4)))
        islands = plan_islands(table)
        leaders = tuple(sorted(isl[0] for isl in islands))
        mine = next(isl for isl in islands if me in isl)
        if mine[0] != me:
            return self._member(host, flat, tensors, buckets, key, mine, r, t0, t_s)
        members = mine[1:]
        got: dict[str, int] = {}
        if members:
            deadline = t0 + READY_SHARE * t_s
            got = host.call(ctl.collect(members, key, deadline), t_s + 30)
        remote, done = self._open(got, key, flat)
        devs = tuple([info.device] + [table[m].device for m in remote])
        averager = self._averager(devs, topology, cuda) if remote else None
        if averager is not None:
            for b, mine_b in enumerate(buckets):
                averager.local_mean([mine_b] + [remote[m][b] for m in remote])
            _sync(buckets)
        weight = float(1 + len(remote))
        left = max(0.1, t_s - (clock.now() - t0))
        report = self._global(host, buckets, weight, left, leaders)
        if averager is not None:
            for b, mine_b in enumerate(buckets):
                averager.spread([mine_b] + [remote[m][b] for m in remote])
            _sync(buckets)
        summary = {
            "st": DONE_OK, "gr": report.round, "gc": len(report.contributors),
            "gs": report.chunks_stale, "gt": report.chunks_total, "to": int(report.timed_out),
        }  # fmt: skip
        done.update({m: {"r": got[m], **summary} for m in remote})
        host.call(ctl.release_acked(done, cfg.control_timeout_s))
        flat.unflatten_into(tensors)
        report.method = "island"
        report.extra.update(island_size=float(len(mine)), island_leader=1.0, island_weight=weight)
        report.extra["island_blink"] = float(bool(averager is not None and averager.executors))
        report.extra["elapsed_island_s"] = clock.now() - t0
        return report

    # ------------------------------------------------------------------ leader
    def _open(
        self, got: Mapping[str, int], key: str, flat: FlatBuffer
    ) -> tuple[dict[str, list[torch.Tensor]], dict[str, dict[str, Any]]]:
        """The members' shared buckets (opened once per handle payload); DONE fields
        for those whose buffers cannot be used."""
        layout = [(b.numel(), b.dtype) for b in flat.buckets]
        remote: dict[str, list[torch.Tensor]] = {}
        done: dict[str, dict[str, Any]] = {}
        for m in sorted(got):
            payload = self.control.shares.get((m, key))
            cached = self._remote.get((m, key))
            try:
                if payload is None:
                    raise ValueError("no shared buffers received")
                if cached is None or cached[0] != payload:
                    cached = (payload, open_handles(load_handles(payload), layout))
                    self._remote[(m, key)] = cached
                remote[m] = cached[1]
            except (ValueError, RuntimeError) as err:
                log.warning("island member %s left out: %s", m, err)
                done[m] = {"r": got[m], "st": DONE_EXCLUDED}
        return remote, done

    def _averager(
        self, devs: tuple[int, ...], topology: GpuTopology | None, cuda: bool
    ) -> IslandAverager:
        from gossipnet.collectives.island.hierarchical import (
            IslandAverager,  # lazy: packing and executors
        )

        avg = self._averagers.get((devs, cuda))
        if avg is None:
            avg = IslandAverager(devs, topology, cuda=cuda)
            if len(self._averagers) > 16:
                self._averagers.clear()
            self._averagers[(devs, cuda)] = avg
        return avg

    def _global(
        self,
        host: IslandHost,
        buckets: list[torch.Tensor],
        weight: float,
        timeout_s: float,
        leaders: tuple[str, ...],
    ) -> CollectiveReport:
        """The lossy all-reduce among the island leaders (CPU copies of CUDA buckets)."""
        nonfinite = not all(all_finite(b) for b in buckets)
        if nonfinite:
            log.warning("peer %s: non-finite island mean; weight 0 this round", self._node.peer_id)
            for b in buckets:
                torch.nan_to_num_(b, nan=0.0, posinf=0.0, neginf=0.0)
            weight = 0.0
        cpu = [b if b.device.type == "cpu" else b.cpu() for b in buckets]
        opts = RoundOptions(weight=weight, timeout_s=timeout_s, participants=leaders)
        coro = host.lossy.run(cpu, opts)
        report = host.call(coro, timeout_s + 30)
        for b, c in zip(buckets, cpu, strict=True):
            if b is not c:
                b.copy_(c)
        if nonfinite:
            report.extra["nonfinite_local"] = 1.0
        return report

    # ------------------------------------------------------------------ member
    def _member(
        self,
        host: IslandHost,
        flat: FlatBuffer,
        tensors: Sequence[torch.Tensor],
        buckets: list[torch.Tensor],
        key: str,
        island: tuple[str, ...],
        r: int,
        t0: float,
        t_s: float,
    ) -> CollectiveReport:
        cfg, clock, leader = self._node.config, self._node.clock, island[0]
        me = self._node.peer_id
        host.call(_advance(host.lossy))
        shared = self._shared.get(key)
        if shared is None:
            layout = [(b.numel(), b.dtype) for b in flat.buckets]
            shared = self._shared[key] = SharedBuckets(layout, flat.device)
        fields: dict[str, Any] | None = None
        if (leader, key) not in self._shared_with:
            share = self.control.share(leader, key, shared.handles(), cfg.control_timeout_s)
            if host.call(share):
                self._shared_with.add((leader, key))
        if (leader, key) in self._shared_with:
            for s, b in zip(shared.buckets, buckets, strict=True):
                s.copy_(b)
            _sync(shared.buckets)
            deadline = t0 + t_s + cfg.control_timeout_s
            wait = self.control.member_round(leader, key, r, deadline)
            fields = host.call(wait, t_s + cfg.control_timeout_s + 30)
        ok = fields is not None and fields.get("st") == DONE_OK
        if ok:
            for s, b in zip(shared.buckets, buckets, strict=True):
                b.copy_(s)
            flat.unflatten_into(tensors)
            assert fields is not None
            host.call(_advance(host.lossy, int(fields.get("gr", -1)) + 1))
        else:  # our own values stay; the next call re-discovers the island
            self._shared_with.discard((leader, key))
        got = fields or {}
        return CollectiveReport(
            round=int(got.get("gr", -1)),
            method="island",
            participants=island,
            contributors=(leader, me) if ok else (me,),
            missing=() if ok else (leader,),
            chunks_total=int(got.get("gt", 0)),
            chunks_stale=int(got.get("gs", 0)),
            elapsed_s=clock.now() - t0,
            timed_out=not ok or bool(got.get("to", 0)),
            extra={
                "island_size": float(len(island)),
                "island_leader": 0.0,
                "leader_lost": 0.0 if fields is not None else 1.0,
                "excluded": 1.0 if fields is not None and not ok else 0.0,
                "global_contributors": float(got.get("gc", 0)),
            },
        )


async def _advance(engine: LossyAllReduce, at_least: int = -1) -> None:
    """Consume one round of the all-reduce engine without sending (a member's call),
    or move it to ``at_least`` (the round after its leader's).

    Why neither reads nor writes the beacon: a beacon says "the round I am in or will
    join next", and a member that skipped round r is not in it; announcing r + 1 (or
    reading another member's r + 1) would push a leader that has not started round r
    past it.  A member catches up from its leader's DONE instead.
    """
    if at_least < 0:
        engine.next_round += 1
    else:
        engine.next_round = max(engine.next_round, at_least)


def _sync(buckets: Sequence[torch.Tensor]) -> None:
    for b in buckets:
        if b.device.type == "cuda":
            torch.cuda.current_stream(b.device).synchronize()
