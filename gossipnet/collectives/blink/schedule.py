"""A packing turned into an ordered list of chunk steps (ALGORITHMS.md 5.1 steps 5-6).

The flat buffer is split across the trees in proportion to their rates (so all trees
finish together), each tree's segment into ``chunks`` chunks, and every chunk travels
up its tree (reduce: child adds into parent) and back down (broadcast: parent copies
to child).  Steps carry a pipeline *slot*, the time unit of one chunk over one hop:

* reduce:    a node at depth d sends chunk c to its parent in slot c + (H - d),
* final:     the root holds chunk c's total in slot c + H (a mean divides there),
* broadcast: a node at depth d sends chunk c to its children in slot c + H + 1 + d,

with H the tree's height.  A chunk moves one hop per slot and a link carries one
chunk per slot, so a tree's all-reduce takes C + 2H slots of (segment / C) / rate
seconds: about S / rate once C >> H, instead of 2H S / rate without pipelining.
Steps are over slices [start, stop) of the flat buffer, never per element; the order
(slot, tree, ...) is deterministic, and running the steps in that order on any
executor gives the same result bit for bit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from gossipnet.collectives.blink.packing import Packing, Tree

__all__ = ("Op", "Schedule", "Step", "build_schedule", "split_by_rate")


class Op(enum.IntEnum):
    """What a step does: ``REDUCE`` dst[s] += src[s]; ``FINAL`` the root's slice is
    complete (a mean divides it); ``COPY`` dst[s] = src[s]."""

    REDUCE = 0
    FINAL = 1
    COPY = 2


@dataclass(frozen=True, slots=True)
class Step:
    """One chunk over one hop; ``src == dst`` (the root) for ``FINAL``."""

    slot: int
    tree: int
    op: Op
    chunk: int
    src: int
    dst: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """Ordered steps of one collective on a ``numel``-element buffer over k GPUs.

    Attributes:
        kind: "allreduce", "reduce" (totals end at each tree's root) or "broadcast"
            (each tree's root's values reach everyone).
        segments: per tree, the [start, stop) range of the buffer it carries.
        slots: number of pipeline slots (the modelled time in chunk-hops).
    """

    kind: str
    k: int
    numel: int
    chunks: int
    trees: tuple[Tree, ...]
    segments: tuple[tuple[int, int], ...]
    steps: tuple[Step, ...]
    slots: int


def split_by_rate(numel: int, rates: list[float], align: int = 1) -> list[tuple[int, int]]:
    """Contiguous segments with sizes proportional to ``rates`` (largest remainder).

    ``align`` rounds segment sizes to multiples of it (the last tree takes the rest),
    which keeps device copies aligned; 1 gives the exact proportional split.
    """
    if not rates or numel < 0:
        raise ValueError("split_by_rate needs at least one rate and numel >= 0")
    r = np.asarray(rates, dtype=np.float64)
    if (r <= 0).any() or not np.isfinite(r).all():
        raise ValueError(f"rates must be finite and > 0, got {rates}")
    units = numel // align
    share = r / r.sum() * units
    size = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - size), kind="stable")
    size[order[: units - int(size.sum())]] += 1
    size *= align
    size[-1] += numel - int(size.sum())
    ends = np.cumsum(size)
    return [(int(e - s), int(e)) for s, e in zip(size, ends, strict=True)]


def _tree_steps(t: int, tree: Tree, lo: int, hi: int, chunks: int, kind: str) -> list[Step]:
    depth = np.array(tree.depths)
    height = int(depth.max())
    bounds = np.linspace(lo, hi, chunks + 1).round().astype(np.int64)
    nodes = np.array([v for v in range(tree.k) if v != tree.root], dtype=np.int64)
    parent = np.array(tree.parent)[nodes]
    steps: list[Step] = []
    for c in range(chunks):
        a, b = int(bounds[c]), int(bounds[c + 1])
        if a == b:
            continue
        if kind in ("allreduce", "reduce"):
            slots = c + height - depth[nodes]
            steps += [
                Step(int(s), t, Op.REDUCE, c, int(v), int(p), a, b)
                for s, v, p in zip(slots, nodes, parent, strict=True)
            ]
            steps.append(Step(c + height, t, Op.FINAL, c, tree.root, tree.root, a, b))
        if kind in ("allreduce", "broadcast"):
            base = c + height + 1 if kind == "allreduce" else c
            slots = base + depth[parent]
            steps += [
                Step(int(s), t, Op.COPY, c, int(p), int(v), a, b)
                for s, v, p in zip(slots, nodes, parent, strict=True)
            ]
    return steps


def build_schedule(
    packing: Packing, numel: int, chunks: int = 8, *, kind: str = "allreduce", align: int = 1
) -> Schedule:
    """The steps of ``kind`` over ``packing``'s trees for a ``numel``-element buffer.

    Args:
        packing: from :func:`.packing.pack_allreduce` (undirected trees, own roots) or
            :func:`.packing.pack_broadcast` (one root; a reduce runs its trees reversed).
        numel: elements in the flat buffer.
        chunks: chunks per tree (more = deeper pipelining, smaller copies).
        kind: "allreduce", "reduce" or "broadcast".
        align: segment sizes are multiples of this many elements (see
            :func:`split_by_rate`).

    Raises:
        ValueError: bad ``kind``/``chunks``, or a packing without trees for k > 1.
    """
    if kind not in ("allreduce", "reduce", "broadcast"):
        raise ValueError(f"kind must be 'allreduce', 'reduce' or 'broadcast', got {kind!r}")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if packing.k > 1 and not packing.trees:
        raise ValueError(
            f"the packing has no trees: the {packing.k} GPUs are not connected by the links"
            " given (use the PCIe capacities, or the fallback)"
        )
    trees = packing.trees
    segments = split_by_rate(numel, [t.rate for t in trees], align) if trees else []
    steps: list[Step] = []
    for t, (tree, (lo, hi)) in enumerate(zip(trees, segments, strict=True)):
        steps += _tree_steps(t, tree, lo, hi, chunks, kind)
    steps.sort(key=lambda s: (s.slot, s.tree, s.op, s.chunk, s.dst, s.src))
    slots = steps[-1].slot + 1 if steps else 0
    return Schedule(kind, packing.k, numel, chunks, trees, tuple(segments), tuple(steps), slots)
