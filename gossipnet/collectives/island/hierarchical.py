"""Hierarchical all-reduce: Blink inside a machine's NVLink islands, lossy across peers.

Why: inside one machine NVLink is reliable and an order of magnitude faster than the
network, so GPUs driven by one process should not each speak on the lossy transport.
One process holds a replica of the tensors per GPU.  A round is

1. reduce: per NVLink island, Blink trees carry the sum up to the island's first GPU
   (the broadcast packing from it, reversed, ALGORITHMS.md 5.1.6) and divide by the
   island size; islands (and GPUs without NVLink) are then combined on the first GPU
   of the process by plain copies, weighted by size;
2. network: that GPU's average goes through :meth:`gossipnet.Peer.all_reduce` with
   ``weight`` = the number of local replicas, so the global mean weights every GPU
   equally (and loss re-weights whole machines, never a partial machine);
3. broadcast: the result is copied to each island's first GPU and Blink trees carry it
   down the island.

Fallback: without a topology (no CUDA, or detection failed) or for an island whose
NVLinks do not connect it, the local step is a plain mean by copies, which is exact,
only slower.  CUDA replicas use :class:`.executor.CudaExecutor`, any others the
:class:`.executor.CpuExecutor` running the same schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from gossipnet.collectives.blink.executor import BlinkExecutor, CpuExecutor, CudaExecutor
from gossipnet.collectives.blink.packing import pack_broadcast
from gossipnet.collectives.blink.topology import GpuTopology
from gossipnet.collectives.chunks import FlatBuffer

if TYPE_CHECKING:
    from gossipnet.reports import CollectiveReport

__all__ = ("AllReducer", "IslandAverager", "island_all_reduce", "islands_for")


class AllReducer(Protocol):
    """The cross-peer step: :meth:`gossipnet.Peer.all_reduce` satisfies it.

    Why a Protocol: this layer sits under the facade and must not import ``Peer``.
    """

    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        timeout: float | None = None,
        *,
        weight: float = 1.0,
    ) -> CollectiveReport:
        """Average ``tensors`` in place across the peers, each weighted by ``weight``."""
        ...


def islands_for(
    devices: Sequence[torch.device | int], topology: GpuTopology | None = None
) -> list[tuple[int, ...]]:
    """Positions in ``devices`` grouped by NVLink island (first GPU of each first).

    Args:
        devices: CUDA devices (or indices) of the local replicas, one per replica.
        topology: the machine's topology; default
            :func:`~gossipnet.collectives.blink.detect.detect` for CUDA devices.
            Without one every replica is its own island.
    """
    idx = [d if isinstance(d, int) else (d.index or 0) for d in devices]
    if topology is None and all(isinstance(d, int) or d.type == "cuda" for d in devices):
        topology = _detected()
    if topology is None or not set(idx) <= set(topology.gpus):
        return [(i,) for i in range(len(idx))]
    pos = {g: i for i, g in enumerate(idx)}
    groups = topology.islands(tuple(sorted(set(idx))))
    return sorted(tuple(sorted(pos[g] for g in isl)) for isl in groups)


@functools.cache
def _detected() -> GpuTopology | None:
    if not torch.cuda.is_available():
        return None
    from gossipnet.collectives.blink.detect import detect

    return detect()


class IslandAverager:
    """Averages per-device replicas locally with Blink, and across peers if asked.

    Args:
        gpus: topology GPU id of each replica position (CUDA indices when real).
        topology: link capacities; None = no NVLink known (plain-mean fallback).
        chunks: Blink chunks per tree.
        cuda: use :class:`CudaExecutor`; default: when CUDA is available and every id
            names a CUDA device.
    """

    def __init__(
        self,
        gpus: Sequence[int],
        topology: GpuTopology | None = None,
        *,
        chunks: int = 8,
        cuda: bool | None = None,
    ) -> None:
        self.gpus = tuple(int(g) for g in gpus)
        if not self.gpus:
            raise ValueError("IslandAverager needs at least one replica")
        if cuda is None:
            cuda = torch.cuda.is_available() and max(self.gpus) < torch.cuda.device_count()
        self.islands = (
            islands_for(self.gpus, topology) if topology else [(i,) for i in range(len(gpus))]
        )
        self.executors: dict[tuple[int, ...], BlinkExecutor] = {}
        for isl in self.islands:
            if len(isl) < 2 or topology is None:
                continue
            packing = pack_broadcast(topology.capacity_matrix([self.gpus[i] for i in isl]), 0)
            if packing.trees:
                cls = CudaExecutor if cuda else CpuExecutor
                self.executors[isl] = cls(packing, chunks)

    def __repr__(self) -> str:
        blink = [isl for isl in self.islands if isl in self.executors]
        return f"IslandAverager(gpus={self.gpus}, islands={self.islands}, blink={blink})"

    # ------------------------------------------------------------------ one bucket
    def _reduce_island(self, isl: tuple[int, ...], bufs: list[torch.Tensor]) -> None:
        """Island mean into its first replica (Blink reduce, or plain copies)."""
        if len(isl) == 1:
            return
        ex = self.executors.get(isl)
        members = [bufs[i] for i in isl]
        if ex is None:
            head = members[0]
            total = torch.stack([m.to(head.device) for m in members]).sum(0)
            head.copy_(total / len(isl) if head.is_floating_point() else total // len(isl))
            return
        ex.run(ex.schedule(members[0].numel(), "reduce"), members, "mean")

    def _broadcast_island(self, isl: tuple[int, ...], bufs: list[torch.Tensor]) -> None:
        if len(isl) == 1:
            return
        ex = self.executors.get(isl)
        members = [bufs[i] for i in isl]
        if ex is None:
            for m in members[1:]:
                m.copy_(members[0], non_blocking=True)
            return
        ex.run(ex.schedule(members[0].numel(), "broadcast"), members, "sum")

    def local_mean(self, bufs: list[torch.Tensor]) -> None:
        """Replica 0's bucket becomes the mean of all ``bufs`` (others: scratch)."""
        for isl in self.islands:
            self._reduce_island(isl, bufs)
        if len(self.islands) > 1:
            head = bufs[0]
            acc = torch.zeros_like(head, dtype=torch.float64)
            for isl in self.islands:
                acc += bufs[isl[0]].to(head.device, torch.float64) * len(isl)
            head.copy_(acc / len(self.gpus))

    def spread(self, bufs: list[torch.Tensor]) -> None:
        """Replica 0's bucket to every replica."""
        for isl in self.islands:
            if isl[0] != 0:
                bufs[isl[0]].copy_(bufs[0], non_blocking=True)
            self._broadcast_island(isl, bufs)

    # ------------------------------------------------------------------ public
    def average(
        self,
        replicas: Sequence[Sequence[torch.Tensor]],
        peer: AllReducer | None = None,
        timeout: float | None = None,
    ) -> CollectiveReport | None:
        """Average ``replicas`` in place: locally, then across peers when ``peer`` is
        given (weight = the number of replicas); returns the peer's report (None
        when local only).  Float tensors only (a mean).

        Raises:
            ValueError: wrong number of replicas, or layouts that differ.
        """
        if len(replicas) != len(self.gpus):
            raise ValueError(f"expected {len(self.gpus)} replicas, got {len(replicas)}")
        flats = [FlatBuffer(r) for r in replicas]
        buckets = [list(f.flatten()) for f in flats]
        for b in range(len(buckets[0])):
            self.local_mean([bk[b] for bk in buckets])
        self._sync(buckets)
        report = None
        if peer is not None:
            report = peer.all_reduce(buckets[0], timeout, weight=float(len(self.gpus)))
        for b in range(len(buckets[0])):
            self.spread([bk[b] for bk in buckets])
        self._sync(buckets)
        for f, r in zip(flats, replicas, strict=True):
            f.unflatten_into(r)
        return report

    @staticmethod
    def _sync(buckets: list[list[torch.Tensor]]) -> None:
        for bk in buckets:
            if bk and bk[0].device.type == "cuda":
                torch.cuda.current_stream(bk[0].device).synchronize()


@functools.cache
def _averager(gpus: tuple[int, ...]) -> IslandAverager:
    return IslandAverager(gpus, _detected())


def island_all_reduce(
    peer: AllReducer, replicas: Sequence[Sequence[torch.Tensor]], timeout: float | None = None
) -> CollectiveReport:
    """Average per-GPU replicas across this machine (Blink) and the peers (lossy).

    The machine's topology is detected once
    (:func:`~gossipnet.collectives.blink.detect.detect`); CPU replicas, or no CUDA,
    fall back to plain local means.  See :class:`IslandAverager`.
    """
    devs = [r[0].device for r in replicas if len(r)]
    if len(devs) != len(replicas):
        raise ValueError("every replica needs at least one tensor")
    if all(d.type == "cuda" for d in devs):
        averager = _averager(tuple(d.index or 0 for d in devs))
    else:
        averager = IslandAverager(range(len(replicas)), None, cuda=False)
    report = averager.average(replicas, peer, timeout)
    assert report is not None
    return report
