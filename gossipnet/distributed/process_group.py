"""``ProcessGroupGossipnet``: a ``torch.distributed`` process group over one gossipnet peer.

What each call does (the README's "torch.distributed backend" section says it for users):

* ``allreduce`` of float tensors with SUM or AVG above ``exact_max_bytes``: the lossy
  all-reduce (:class:`gossipnet.collectives.lossy.engine.LossyAllReduce`), as
  ``Peer.all_reduce``: the mean over the contributions that arrived, per chunk; a chunk
  whose mean never arrived keeps this rank's value and is counted (``chunks_stale``).
  SUM is that mean times the group's size, so DDP's pre-divided gradient buckets come
  out as the mean gradient of the ranks heard.  Every round's report is kept
  (:attr:`ProcessGroupGossipnet.reports`, :func:`gossipnet.distributed.last_report`).
* every other all-reduce (small ones, integers, MIN/MAX/PRODUCT/bitwise), ``broadcast``,
  ``allgather``, ``_allgather_base``, ``barrier``: exact, over the reliable control
  channel (:mod:`gossipnet.distributed.exchange`).
* ``reduce_scatter`` / ``_reduce_scatter_base``: an all-reduce of the whole input by the
  rules above, then this rank's slice.
* anything else: :class:`~gossipnet.distributed.tensors.UnsupportedError` naming the call.

Every call returns a :class:`~gossipnet.distributed.work.GossipWork` at once; the
collective runs on the peer's loop thread, one at a time in the order issued (an
``asyncio.Lock`` is FIFO), which is the order every rank issues them in.  The tensors
handed to a collective belong to it until its work completes (torch's contract), so
the loop thread writes the results into them.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.distributed.exchange import Exchange, rank_id
from gossipnet.distributed.options import GossipnetOptions
from gossipnet.distributed.tensors import (
    LOSSY_DTYPES,
    check_op,
    exact_reduce,
    from_bytes,
    op_name,
    stage,
    to_bytes,
)
from gossipnet.distributed.unsupported import UnsupportedCalls
from gossipnet.distributed.work import GossipWork
from gossipnet.errors import ClosedError
from gossipnet.peer import Peer
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.cputime import stamp_cpu

__all__ = ("ProcessGroupGossipnet",)

log = logging.getLogger(__name__)

#: Reports kept per group (the newest last).
REPORTS_KEPT = 256


class ProcessGroupGossipnet(UnsupportedCalls, dist.ProcessGroup):
    """A process group whose collectives run over ``peer``.

    Args:
        peer: this rank's started peer, connected to the group's other ranks.
        exchange: the peer's :class:`Exchange` (made before the rendezvous, see
            :func:`gossipnet.distributed.rendezvous.start_peer`).
        rank, size: this rank and the group's size (fixed: survivors keep it).
        options: the resolved :class:`GossipnetOptions`.
        timeout_s: the group's timeout (``init_process_group(timeout=...)``): the
            default of ``Work.wait`` and the deadline of the exact collectives.
    """

    def __init__(
        self,
        peer: Peer,
        exchange: Exchange,
        rank: int,
        size: int,
        options: GossipnetOptions,
        timeout_s: float,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs list one overload
        self.peer = peer
        self.options = options
        self.timeout_s = timeout_s
        runtime = peer.runtime
        self._engine = runtime.engine("allreduce", LossyAllReduce)
        self._exchange = exchange
        self._lock = runtime.call(_make_lock())
        self._seq = 0
        self._group_name = ""
        self._group_desc = ""
        self._inflight: set[concurrent.futures.Future[None]] = set()
        #: the newest lossy rounds' reports (``CollectiveReport``), oldest first
        self.reports: collections.deque[CollectiveReport] = collections.deque(maxlen=REPORTS_KEPT)
        #: counts since start: calls per collective, lossy rounds, packets and chunks lost
        self.totals: collections.Counter[str] = collections.Counter()
        # a script that never calls destroy_process_group still says goodbye at exit, so
        # the survivors drop it at once instead of after failure_timeout_s
        atexit.register(_leave_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "gossipnet"

    def name(self) -> str:
        return "gossipnet"

    # torch sets a group's name and description after the creator returns; a Python
    # group keeps them itself (DeviceMesh, FSDP and the c10d registry read them)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"<ProcessGroupGossipnet rank {self.rank()}/{self.size()} {self.peer.address}>"

    @property
    def last_report(self) -> CollectiveReport | None:
        """The newest lossy all-reduce's report, or None before the first."""
        return self.reports[-1] if self.reports else None

    def exchange_counters(self) -> dict[str, int]:
        """The exact collectives' part counters (:attr:`Exchange.counters`), a copy."""
        return dict(self._exchange.counters)

    # ------------------------------------------------------------------ running
    def _launch(self, op: str, body: Callable[[], Awaitable[Any]]) -> GossipWork:
        """Run ``body()`` on the loop thread after the collectives issued before it."""
        self.totals[f"calls_{op}"] += 1
        log.debug("rank %d: %s issued (exact collectives so far: %d)", self.rank(), op, self._seq)
        work = GossipWork(op, self.timeout_s)
        lock = self._lock

        async def run() -> None:
            async with lock:
                try:
                    value = await body()
                except Exception as err:  # the work carries it to wait() and the future
                    work.fail(err)
                    return
            work.complete(value)

        fut = self.peer.runtime.submit(run())
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return work

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _exchange_all(
        self, seq: int, data: bytes, *, excuse_dead: bool, to: Sequence[int] | None = None
    ) -> dict[int, bytes]:
        """Send ``data`` to ranks ``to`` (default all others), hear from every other rank
        a message of ``len(data)`` bytes (every rank passes the same shapes)."""
        me, world = self.rank(), self.size()
        others = [r for r in range(world) if r != me]
        targets = others if to is None else [r for r in to if r != me]
        got = await self._exchange.run(
            seq,
            {rank_id(r): data for r in targets},
            [rank_id(r) for r in others],
            self.timeout_s,
            expect=len(data),
            excuse_dead=excuse_dead,
        )
        return {int(peer.removeprefix("rank")): msg for peer, msg in got.items()}

    # ------------------------------------------------------------------ all-reduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GossipWork:  # type: ignore[override]
        """Lossy for large float SUM/AVG, exact otherwise (see the module)."""
        name = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._launch("allreduce", self._allreduce_body(list(tensors), name))

    def _allreduce_body(
        self, tensors: list[torch.Tensor], name: str
    ) -> Callable[[], Awaitable[list[torch.Tensor]]]:
        for t in tensors:
            check_op(name, t.dtype)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        lossy = (
            name in ("SUM", "AVG")
            and bool(tensors)
            and all(t.dtype in LOSSY_DTYPES for t in tensors)
            and nbytes > (self.options.exact_max_bytes or 0)
        )
        if lossy:
            return self._lossy(tensors, name)
        seq = self._next_seq()
        data = to_bytes(tensors)

        async def exact() -> list[torch.Tensor]:
            self.totals["allreduce_exact"] += 1
            got = await self._exchange_all(seq, data, excuse_dead=True)
            got[self.rank()] = data
            rows = [from_bytes(got[r], tensors) for r in sorted(got)]
            for i, t in enumerate(tensors):
                stacked = torch.stack([row[i] for row in rows])
                t.copy_(exact_reduce(name, stacked, self.size()))
            return tensors

        return exact

    def _lossy(
        self, tensors: list[torch.Tensor], name: str
    ) -> Callable[[], Awaitable[list[torch.Tensor]]]:
        cpu0 = time.thread_time()
        staged = stage(tensors)
        caller_s = time.thread_time() - cpu0
        timeout = self.peer.config.collective_timeout_s
        # gradients, like the optimizer's rounds: XOR parity while loss is seen, so most
        # lost packets are rebuilt at once instead of costing a repair round trip
        parity = self.peer.config.parity_for(optimizer=True)

        async def lossy() -> list[torch.Tensor]:
            loop0 = time.thread_time()
            report = await self._engine.run(
                staged.buckets,
                RoundOptions(
                    weight=staged.weight,
                    timeout_s=timeout,
                    repair=bool(self.options.repair),
                    parity_group=parity,
                ),
            )
            if name == "SUM":
                for b in staged.buckets:
                    b.mul_(self.size())
            staged.write_back()
            if staged.weight == 0.0:
                report.extra["nonfinite_local"] = 1.0
            self._record(stamp_cpu(report, time.thread_time() - loop0, caller_s))
            return tensors

        return lossy

    def _record(self, report: CollectiveReport) -> None:
        self.reports.append(report)
        t = self.totals
        t["lossy_rounds"] += 1
        t["packets_sent"] += report.packets_sent
        t["packets_lost"] += report.packets_lost
        t["chunks_total"] += report.chunks_total
        t["chunks_stale"] += report.chunks_stale
        t["rounds_missing_peers"] += bool(report.missing)
        t["rounds_timed_out"] += report.timed_out

    # ------------------------------------------------------------------ exact calls
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GossipWork:  # type: ignore[override]
        """Exact: the root's tensors, byte for byte, on every rank.

        Every other rank answers the root with an empty message, and the root completes
        once it heard them all (a dead one excused), as gloo's root waits for its
        receivers.  Why: a root that completed on delivery alone could run any number
        of broadcasts ahead of a slow rank, and a receiver could then bound neither the
        collectives nor the bytes it must hold for it.
        """
        root = opts.rootRank if opts is not None else 0
        if not 0 <= root < self.size():
            raise ValueError(f"gossipnet backend: broadcast root {root} outside the group")
        seq = self._next_seq()
        tensors = list(tensors)
        me = self.rank()
        data = to_bytes(tensors) if me == root else b""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)

        async def body() -> list[torch.Tensor]:
            if me == root:
                others = [rank_id(r) for r in range(self.size()) if r != me]
                await self._exchange.run(
                    seq,
                    dict.fromkeys(others, data),
                    others,
                    self.timeout_s,
                    expect=0,
                    excuse_dead=True,
                )
                return tensors
            got = await self._exchange.run(
                seq,
                {rank_id(root): b""},
                [rank_id(root)],
                self.timeout_s,
                expect=nbytes,
                excuse_dead=False,
            )
            for t, v in zip(tensors, from_bytes(got[rank_id(root)], tensors), strict=True):
                t.copy_(v)
            return tensors

        return self._launch("broadcast", body)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> GossipWork:
        """Exact: ``outputs[i][r]`` is rank ``r``'s ``inputs[i]``."""
        world = self.size()
        if len(outputs) != len(inputs) or any(len(o) != world for o in outputs):
            raise ValueError(
                "gossipnet backend: allgather needs one list of size() outputs per input"
            )
        seq = self._next_seq()
        data = to_bytes(inputs)

        async def body() -> list[list[torch.Tensor]]:
            got = await self._exchange_all(seq, data, excuse_dead=False)
            got[self.rank()] = data
            for r in range(world):
                like = [o[r] for o in outputs]
                for dst, src in zip(like, from_bytes(got[r], like), strict=True):
                    dst.copy_(src)
            return outputs

        return self._launch("allgather", body)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GossipWork:
        """Exact: ``output`` is every rank's ``input`` concatenated in rank order."""
        if output.numel() != input.numel() * self.size():
            raise ValueError("gossipnet backend: _allgather_base output must be size() x input")
        slots = list(output.view(-1).chunk(self.size()))
        work = self.allgather([slots], [input.reshape(-1)], opts)
        work.op = "_allgather_base"
        return work

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GossipWork:
        """``dist.all_gather_single`` (FSDP2's all-gather): as :meth:`_allgather_base`."""
        work = self._allgather_base(output, input, opts)
        work.op = "all_gather_single"
        return work

    def barrier(self, opts: Any = None) -> GossipWork:
        """Exact: returns once every rank alive has entered it (a dead rank is excused)."""
        seq = self._next_seq()

        async def body() -> list[torch.Tensor]:
            await self._exchange_all(seq, b"", excuse_dead=True)
            return []

        return self._launch("barrier", body)

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> GossipWork:
        """``outputs[i]`` = the reduction over ranks of ``inputs[i][rank]``."""
        name = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        flat = [torch.cat([t.reshape(-1) for t in row]) for row in inputs]
        run = self._allreduce_body(flat, name)
        me = self.rank()

        async def body() -> list[torch.Tensor]:
            await run()
            for out, row, whole in zip(outputs, inputs, flat, strict=True):
                start = sum(t.numel() for t in row[:me])
                out.copy_(whole[start : start + out.numel()].view(out.shape))
            return outputs

        return self._launch("reduce_scatter", body)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GossipWork:
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                "gossipnet backend: _reduce_scatter_base input must be size() x output"
            )
        rows = [list(input.reshape(-1).chunk(self.size()))]
        return self.reduce_scatter([output.view(-1)], rows, opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GossipWork:
        """``dist.reduce_scatter_single`` (FSDP2's gradient reduce-scatter)."""
        return self._reduce_scatter_base(output, input, opts)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Announce our departure and close the peer (``destroy_process_group``)."""
        with contextlib.suppress(ClosedError):
            self.peer.leave()

    def abort(self) -> None:
        """Close the peer at once, without announcing."""
        self.peer.close(announce=False)


def _leave_at_exit(ref: weakref.ref[ProcessGroupGossipnet]) -> None:
    pg = ref()
    if pg is not None and not pg.peer.runtime.closed:
        with contextlib.suppress(Exception):  # exiting: a failed goodbye changes nothing
            pg.shutdown()


async def _make_lock() -> asyncio.Lock:
    """The FIFO lock, made on the loop thread that uses it."""
    return asyncio.Lock()
