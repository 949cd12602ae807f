"""Executors for Blink schedules: a CPU reference and a CUDA one (ALGORITHMS.md 5.1).

Both run the *same* :class:`~.schedule.Schedule`, so the CPU executor's result (checked
against ``torch.stack(...).mean(0)`` in the tests) vouches for the schedule the GPUs
run.  Buffers are flat 1-D tensors, one per GPU of the island, same numel and dtype;
:meth:`BlinkExecutor.all_reduce_replicas` handles lists of tensors per device via
:class:`~gossipnet.collectives.chunks.FlatBuffer`.

The CUDA executor issues every step on a stream of its own *link* (tree, child), so the
hops of a tree run concurrently, chunk c on one hop while chunk c + 1 is on the next;
one stream per tree would serialise them and lose the pipeline.  Ordering across
streams uses ``torch.cuda.Event``: a step waits for the events of the steps that
produced its input (the children's adds, the parent's copy).  Cross-device
``copy_(non_blocking=True)`` runs peer to peer (NVLink where present) and synchronises
with the current streams of both devices, which are the step's streams.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gossipnet.collectives.blink.packing import Packing
from gossipnet.collectives.blink.schedule import Op, Schedule, build_schedule
from gossipnet.collectives.chunks import FlatBuffer

__all__ = ("BlinkExecutor", "CpuExecutor", "CudaExecutor")

_OPS = ("mean", "sum")


class BlinkExecutor:
    """Common part: checks, schedule cache, the per-device replica helper.

    Args:
        packing: the trees ("allreduce" packing, or a broadcast packing used reversed
            then forward).
        chunks: chunks per tree (pipelining depth).
        align: segment sizes in elements are multiples of this.
    """

    def __init__(self, packing: Packing, chunks: int = 8, align: int = 1) -> None:
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.packing = packing
        self.chunks = chunks
        self.align = align
        self._schedules: dict[tuple[int, str], Schedule] = {}

    def schedule(self, numel: int, kind: str = "allreduce") -> Schedule:
        """The (cached) schedule for a ``numel``-element buffer."""
        key = (numel, kind)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(
                self.packing, numel, self.chunks, kind=kind, align=self.align
            )
        return self._schedules[key]

    def _check(self, tensors: Sequence[torch.Tensor], op: str) -> None:
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS}, got {op!r}")
        if len(tensors) != self.packing.k:
            raise ValueError(f"expected {self.packing.k} tensors (one per GPU), got {len(tensors)}")
        first = tensors[0]
        for i, t in enumerate(tensors):
            if t.dim() != 1 or t.numel() != first.numel() or t.dtype != first.dtype:
                raise ValueError(
                    f"tensor {i} is {tuple(t.shape)} {t.dtype}; all must be 1-D with"
                    f" {first.numel()} elements of {first.dtype}"
                )
            if not t.is_contiguous():
                raise ValueError(f"tensor {i} is not contiguous")
        if op == "mean" and not (first.is_floating_point() or first.is_complex()):
            raise ValueError(f"op='mean' needs a floating dtype, got {first.dtype}; use 'sum'")

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
        """Reduce ``tensors`` (one flat buffer per GPU) in place: every one ends with
        the sum or mean of all."""
        raise NotImplementedError

    def run(self, sched: Schedule, tensors: Sequence[torch.Tensor], op: str = "sum") -> None:
        """Execute ``sched`` on ``tensors`` (one flat tensor per GPU position)."""
        raise NotImplementedError

    def all_reduce_replicas(
        self, replicas: Sequence[Sequence[torch.Tensor]], op: str = "mean"
    ) -> None:
        """All-reduce lists of tensors, one list per GPU (same layout), in place."""
        flats = [FlatBuffer(r) for r in replicas]
        buckets = [f.flatten() for f in flats]
        for b in range(len(buckets[0])):
            self.all_reduce([bk[b] for bk in buckets], op)
        for f, r in zip(flats, replicas, strict=True):
            f.unflatten_into(r)


class CpuExecutor(BlinkExecutor):
    """Runs a schedule step by step on CPU (or any) tensors: the reference executor."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
        self._check(tensors, op)
        self.run(self.schedule(tensors[0].numel()), tensors, op)

    def run(self, sched: Schedule, tensors: Sequence[torch.Tensor], op: str = "sum") -> None:
        """Execute ``sched`` in order: REDUCE adds, FINAL divides for a mean, COPY."""
        k = sched.k
        for s in sched.steps:
            dst = tensors[s.dst][s.start : s.stop]
            if s.op is Op.REDUCE:
                dst.add_(tensors[s.src][s.start : s.stop])
            elif s.op is Op.COPY:
                dst.copy_(tensors[s.src][s.start : s.stop])
            elif op == "mean":
                dst.div_(k)


class CudaExecutor(BlinkExecutor):
    """Runs the same schedule on CUDA tensors with streams and events.

    Each (tree, child) link has one stream on the child's device (reduce: the child
    sends) and one on the parent's device (broadcast: the parent sends, and the
    parent's adds run there).  A reduce copies the child's chunk into a receive buffer
    on the parent's device, then adds it in; every step records an event that the
    steps consuming its output wait on.  The tensors may sit on distinct devices or
    (for testing the stream logic on one GPU) on the same one.

    Raises:
        RuntimeError: CUDA is not available (use :class:`CpuExecutor`).
    """

    def __init__(self, packing: Packing, chunks: int = 8, align: int = 64) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaExecutor needs CUDA; this torch build or machine has none."
                " Use CpuExecutor (the same schedule on CPU tensors)."
            )
        super().__init__(packing, chunks, align)
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    def _stream(self, tree: int, child: int, device: torch.device) -> torch.cuda.Stream:
        key = (tree, child, device.index if device.index is not None else 0)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=device)
        return self._streams[key]

    def all_reduce(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
        self._check(tensors, op)
        if any(t.device.type != "cuda" for t in tensors):
            raise ValueError("CudaExecutor needs CUDA tensors; use CpuExecutor for CPU ones")
        self.run(self.schedule(tensors[0].numel()), tensors, op)

    def run(self, sched: Schedule, tensors: Sequence[torch.Tensor], op: str = "sum") -> None:
        """Issue every step asynchronously; the callers' current streams wait for the end.

        Events: ``acc[(tree, chunk, node)]`` is the last add into a node's chunk (sibling
        adds chain on it, so two links never add into one slice at once); ``done[...]``
        the FINAL or COPY that completed a node's chunk.
        """
        k = sched.k
        acc: dict[tuple[int, int, int], torch.cuda.Event] = {}
        done: dict[tuple[int, int, int], torch.cuda.Event] = {}
        start = {t.device: torch.cuda.current_stream(t.device).record_event() for t in tensors}
        synced: set[int] = set()

        def stream(tree: int, link: int, device: torch.device) -> torch.cuda.Stream:
            st = self._stream(tree, link, device)
            if id(st) not in synced:  # first use in this call: after the caller's work
                st.wait_event(start[device])
                synced.add(id(st))
            return st

        for s in sched.steps:
            src_t, dst_t = tensors[s.src], tensors[s.dst]
            link = s.src if s.op is Op.REDUCE else s.dst  # the child end of the hop
            s_src = stream(s.tree, link, src_t.device)
            s_dst = s_src if dst_t.device == src_t.device else stream(s.tree, link, dst_t.device)
            before = acc.get((s.tree, s.chunk, s.src)) if s.op is not Op.COPY else None
            if s.op is Op.COPY:
                before = done.get((s.tree, s.chunk, s.src))
            if before is not None:  # the source chunk is complete
                s_src.wait_event(before)
            src = src_t[s.start : s.stop]
            dst = dst_t[s.start : s.stop]
            with torch.cuda.stream(s_src), torch.cuda.stream(s_dst):
                if s.op is Op.REDUCE:
                    recv = torch.empty_like(dst)
                    recv.copy_(src, non_blocking=True)
                    prev = acc.get((s.tree, s.chunk, s.dst))
                    if prev is not None:  # serialise sibling adds into the same slice
                        s_dst.wait_event(prev)
                    dst.add_(recv)
                elif s.op is Op.COPY:
                    dst.copy_(src, non_blocking=True)
                elif op == "mean":
                    dst.div_(k)
                ev = s_dst.record_event()
            if s.op is Op.REDUCE:
                acc[(s.tree, s.chunk, s.dst)] = ev
            else:
                done[(s.tree, s.chunk, s.dst)] = ev
        for t in tensors:
            cur = torch.cuda.current_stream(t.device)
            for ev in done.values():
                cur.wait_event(ev)
