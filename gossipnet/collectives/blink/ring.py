"""NCCL-style ring model and the tree-vs-ring throughput model (ALGORITHMS.md 5.2).

Why a model: Blink's claim (up to 8x over NCCL on partial DGX-1 allocations, from the
paper's abstract) is about which links each approach can use, which a capacity model
captures without GPUs.  NCCL builds rings: a ring needs a Hamiltonian cycle of
NVLinks; it runs several rings (channels) on disjoint link capacity; with no NVLink
Hamiltonian cycle among the allocated GPUs the whole ring falls back to PCIe.

Formulas (S = buffer bytes, k = GPUs):

* ring all-reduce (reduce-scatter + all-gather):  t_ring = 2 (k - 1) / k * S / B_ring,
  where B_ring = the sum of the rings' bottlenecks (GB/s per direction);
* tree all-reduce (reduce up + broadcast down the same trees, pipelined):
  t_tree = S / R * (C + 2 H) / C, R = the packed all-reduce rate
  (:func:`.packing.pack_allreduce`), C chunks per tree, H the tallest tree's height;
* speed-up = t_ring / t_tree.  Latencies (kernel launch, per-hop setup) are ignored,
  so the model is for large buffers.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

__all__ = (
    "RingModel",
    "best_ring",
    "ring_allreduce_time",
    "ring_model",
    "tree_allreduce_time",
)

_MAX_RING_K = 9  # (k-1)! cycles are enumerated: 40320 at k = 9
_MAX_RINGS = 16


@functools.cache
def _cycles(k: int) -> np.ndarray:
    """All Hamiltonian cycles through node 0 (each direction separately): (k-1)! x k."""
    perms = np.array(list(itertools.permutations(range(1, k))), dtype=np.int64)
    return np.concatenate([np.zeros((perms.shape[0], 1), dtype=np.int64), perms], axis=1)


def best_ring(cap: np.ndarray) -> tuple[tuple[int, ...], float]:
    """The directed Hamiltonian cycle with the largest bottleneck: (order, GB/s).

    Exhaustive over (k-1)! orders, vectorised.  Bottleneck 0 means no cycle exists on
    the links given.

    Raises:
        ValueError: more than 9 GPUs (enumeration would be too large).
    """
    k = cap.shape[0]
    if k > _MAX_RING_K:
        raise ValueError(f"ring search is exhaustive; at most {_MAX_RING_K} GPUs, got {k}")
    if k == 1:
        return (0,), float("inf")
    cyc = _cycles(k)
    nxt = np.roll(cyc, -1, axis=1)
    bott = cap[cyc, nxt].min(axis=1)
    i = int(np.argmax(bott))
    return tuple(int(x) for x in cyc[i]), float(bott[i])


@dataclass(frozen=True, slots=True)
class RingModel:
    """NCCL-style rings over one allocation.

    Attributes:
        rings: (order, GB/s) per ring (channel); empty on the PCIe fallback.
        bandwidth: B_ring, GB/s per direction summed over rings.
        transport: "nvlink", or "pcie" when no NVLink Hamiltonian cycle exists.
    """

    rings: tuple[tuple[tuple[int, ...], float], ...]
    bandwidth: float
    transport: str


def ring_model(nvlink_cap: np.ndarray, pcie_gbps: float, max_rings: int = _MAX_RINGS) -> RingModel:
    """Rings as NCCL would build them: greedy best rings on what is left.

    Each round takes the widest directed Hamiltonian cycle of the residual NVLink
    capacities and subtracts its bottleneck, until none is left (or ``max_rings``).
    With no NVLink cycle at all the ring runs over PCIe at ``pcie_gbps``.
    """
    res = np.array(nvlink_cap, dtype=np.float64)
    k = res.shape[0]
    if k == 1:
        return RingModel((), float("inf"), "nvlink")
    rings = []
    for _ in range(max_rings):
        order, b = best_ring(res)
        if b <= 1e-9:
            break
        o = np.array(order)
        res[o, np.roll(o, -1)] -= b
        rings.append((order, b))
    if not rings:
        return RingModel((), float(pcie_gbps), "pcie")
    return RingModel(tuple(rings), float(sum(b for _, b in rings)), "nvlink")


def ring_allreduce_time(size_gb: float, k: int, bandwidth: float) -> float:
    """Seconds of a ring all-reduce of ``size_gb`` GB: 2 (k-1)/k * S / B."""
    if k <= 1:
        return 0.0
    return 2.0 * (k - 1) / k * size_gb / bandwidth if bandwidth > 0 else float("inf")


def tree_allreduce_time(size_gb: float, rate: float, height: int, chunks: int) -> float:
    """Seconds of a pipelined tree all-reduce: S / R * (C + 2H) / C."""
    if rate <= 0:
        return float("inf")
    return size_gb / rate * (chunks + 2 * height) / chunks
