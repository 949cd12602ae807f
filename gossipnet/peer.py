""":class:`Peer`: the synchronous facade that :func:`gossipnet.join` returns.

The training thread calls plain methods; each one submits a coroutine to
the peer's event-loop thread (:mod:`gossipnet.runtime.loop`) and waits for it
with a deadline.  Tensors cross threads as CPU copies made by the caller's
thread; results are written back on the caller's thread, so the trainer
never races the network.

This module holds what users call and read on a peer: the collectives, the
optimizer and micro-batches (``join()`` itself is in ``_join.py``).  A ``Peer``
holds its machinery rather than inheriting it: a
:class:`~gossipnet.runtime.runtime.Runtime` (loop thread, node, blocking calls,
join wait, shutdown) and the engines built on it (``_core.py``).
``runtime/join.py`` turns arguments and environment into settings, and
``_collective.py`` stages tensors (flat buffers, CPU copies, write-back).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

import torch

from gossipnet._collective import moshpit_bound_s, moshpit_config, stage
from gossipnet._core import ENGINES, Engines, IslandHost
from gossipnet._step_resync import StepResync
from gossipnet._training_host import PeerTrainingHost
from gossipnet.clock import Clock
from gossipnet.collectives.compress import Compression, CompressSession
from gossipnet.collectives.compress import resolve as resolve_compress
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.collectives.lossy.robust import CenteredClip
from gossipnet.collectives.lossy.wirebytes import add_resync_bytes
from gossipnet.collectives.route.averager import RouteTime
from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.mobility.radio import RadioModel
from gossipnet.mobility.routes import Route
from gossipnet.mobility.schedule import ScheduleConfig
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.cputime import CPU_LOOP_KEY, loop_cpu, stamp_cpu
from gossipnet.runtime.flatbuffer import FlatBuffer
from gossipnet.runtime.join import advertise_host
from gossipnet.runtime.loop import LoopThread
from gossipnet.runtime.node import Node
from gossipnet.runtime.runtime import Runtime
from gossipnet.training._catch_up import step_all_reduced
from gossipnet.training.dropcompute import Normalise
from gossipnet.training.microbatch import MicrobatchLoop, MicrobatchReport, MicrobatchState, TauSpec
from gossipnet.training.optimizer import GossipOptimizer
from gossipnet.training.options import StrategyOptions, resolve
from gossipnet.training.replicas import ReplicaCheck
from gossipnet.training.route import route_average

if TYPE_CHECKING:
    from gossipnet.collectives.blink.topology import GpuTopology

__all__ = ("Peer",)

log = logging.getLogger(__name__)
T = TypeVar("T")


class Peer:
    """A running gossipnet peer; create it with :func:`join`.

    Thread-safe: any thread may call its methods, except the peer's own
    event-loop thread (that raises ``RuntimeError`` instead of deadlocking).
    """

    def __init__(
        self,
        *,
        config: Config,
        listen: str,
        peer_id: str,
        bootstrap: Sequence[str],
        secret: bytes | None,
        faults: Any = None,
        clock: Clock | None = None,
        network: Any = None,
        expected_peers: int | None = None,
    ) -> None:
        self.config = config
        node = Node(
            config=config,
            listen=listen,
            peer_id=peer_id,
            secret=secret,
            bootstrap=bootstrap,
            clock=clock,
            faults=faults,
            network=network,
            advertise_host=advertise_host(bootstrap),
        )
        self._runtime = Runtime(node)
        self._runtime.start(ENGINES, expected_peers=expected_peers)
        engines = Engines.of(self._runtime)
        # the names the training strategies read (through gossipnet/_training_host.py)
        self._node = node
        self._allreduce = engines.allreduce
        self._optim_engine = engines.optimizer
        self._replicas = engines.replicas
        self._moshpit = engines.moshpit
        self._statesync = engines.statesync
        self._route = engines.route
        self._island = engines.island
        # net.all_reduce(compress=...)'s error feedback, per (compressor, layout)
        self._compress_sessions: dict[tuple[Any, ...], CompressSession] = {}
        self._microbatch = MicrobatchState()
        # all_reduce(step=opt)'s parameter resyncs
        self._step_resync = StepResync(config.resync_every_steps)

    # ------------------------------------------------------------------ runtime
    @property
    def runtime(self) -> Runtime:
        """The loop thread, node and engines under this peer (advanced use)."""
        return self._runtime

    @property
    def peer_id(self) -> str:
        return self._node.peer_id

    @property
    def address(self) -> str:
        return self._node.address

    @property
    def node(self) -> Node:
        """The async runtime (use only from the peer's loop thread)."""
        return self._node

    def alive_peers(self) -> list[str]:
        """Peers currently believed alive, sorted, this one included."""
        return self._runtime.alive_peers()

    def stats(self) -> dict[str, Any]:
        """Transport, fault, wire and engine counters (a snapshot): ``transport``,
        ``faults``, ``wire_rejects`` (packets refused before any protocol saw them, by
        reason), ``engine_drops`` (per collective engine, e.g. ``"lossy:ar"``: data
        refused as late, duplicate, for another layout, ...), ``heartbeat_errors``,
        ``loop_stalls`` (times our event loop did not run long enough to make a live peer
        look dead, and their seconds: the other peers are not declared dead for those),
        ``wire`` (every byte this peer sent since it joined: ``sent_bytes``, of which
        ``control_bytes`` (introductions, heartbeats, views, acks), ``collective_bytes``
        per engine (what the reports' ``bytes_sent`` add up to) and ``other_bytes``)."""
        return self._runtime.stats()

    def wait_for_peers(self, count: int, timeout_s: float | None = None) -> bool:
        """Block until ``count`` peers (self included) are alive; False at the deadline."""
        return self._runtime.wait_for_peers(count, timeout_s)

    def leave(self) -> None:
        """Announce departure to the alive peers (bounded wait), then close."""
        self._runtime.leave()

    def close(self, *, announce: bool = False) -> None:
        """Close sockets, cancel tasks, join the loop thread; idempotent."""
        self._runtime.close(announce=announce)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def __repr__(self) -> str:
        state = "closed" if self._runtime.closed else "open"
        return f"<gossipnet.Peer {self.peer_id} {self.address} {state}>"

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self._runtime.call(coro, timeout_s)

    @property
    def _loop(self) -> LoopThread:
        return self._runtime.loop_thread

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        timeout: float | None = None,
        *,
        weight: float = 1.0,
        compress: Compression | None = None,
        step: torch.optim.Optimizer | None = None,
        robust: CenteredClip | None = None,
    ) -> CollectiveReport:
        """Average ``tensors`` across the alive peers, in place, tolerating loss.

        Each peer's contribution counts with ``weight`` (e.g. micro-batches it
        completed; 0 = contribute nothing).  Chunks whose average never arrived
        keep this peer's own values; the report counts them (``chunks_stale``).
        Non-finite local values are not sent: the call then contributes with
        weight 0 and the report's ``extra["nonfinite_local"]`` is 1.

        Args:
            tensors: CPU or CUDA tensors of any float dtype and shape; the same
                layout on every peer.
            timeout: bound of the whole round in seconds (default
                ``Config.collective_timeout_s``).
            weight: this peer's weight, >= 0.
            compress: ``"bf16"``, ``"fp16"``, :class:`gossipnet.Int8`,
                :class:`gossipnet.ArcTopK`, :class:`gossipnet.DCT` or
                :class:`gossipnet.Accordion` (every peer the same); the result is
                then the average of the compressed contributions, and the error
                feedback (per compressor and layout, kept by this peer) carries
                what was not sent into later calls.  The report's ``extra`` has
                ``bytes_dense`` (what a dense call of the same settings sends) and
                ``compression_ratio`` (``bytes_dense / bytes_sent``).
            step: the optimizer whose gradients ``tensors`` are, stepped here after
                the round.  With :class:`gossipnet.ArcTopK` or :class:`gossipnet.DCT`
                and Adam or AdamW it takes the catch-up step (each value as the
                rounds it stands for; ``report.extra["catch_up"]`` is 1), which
                plain ``opt.step()`` after the call cannot (see README, "Gradient
                compression"), inside the optimizer's own step bookkeeping (its step
                hooks run, and LR schedulers see the step); otherwise it is
                ``step.step()``.  The round is then a training step's, with the lossy
                optimizer's loss rule: XOR parity while loss is seen
                (``Config.parity_for(optimizer=True)``; compressed rounds send
                ``Config.compressed_copies`` instead).  Before the first such
                call's round and after every ``Config.resync_every_steps`` calls, a round
                averages ``step``'s parameters with repair, so the replicas that lost
                chunks let drift apart are identical again (``extra["resync"]`` is 1,
                ``extra["resync_moved"]`` this peer's largest drift).
            robust: :class:`gossipnet.CenteredClip` makes each chunk's owner aggregate
                with centered clipping instead of the weighted mean, so a faulty peer
                moves the result by at most ``tau`` per element (RMS); every peer the
                same, not with ``compress`` (see the guide, "Security model").

        Returns:
            The round's :class:`CollectiveReport`; packet loss never raises.
            ``extra["bytes_sent"]``: the frame bytes of every packet of the call this
            peer put on the wire (copies, parity, ENDs and a ``step=`` resync included,
            its share in ``resync_bytes``); ``net.stats()["wire"]`` has the whole run's.

        Raises:
            ConfigError: ``compress`` is not one of the above.
            ValueError: ``robust`` with ``compress``, or not a ``CenteredClip``.
        """
        if not tensors:
            raise ValueError("all_reduce needs at least one tensor")
        if robust is not None and (compress is not None or not isinstance(robust, CenteredClip)):
            raise ValueError(
                f"robust must be a gossipnet.CenteredClip and needs compress=None, got {robust!r}"
            )
        spec = resolve_compress(compress)
        cpu0 = time.thread_time()
        staged = stage(self._flat_for(tensors), tensors)
        if staged.nonfinite:
            log.warning(
                "peer %s: non-finite values in all_reduce input; contributing weight 0 this round",
                self.peer_id,
            )
            weight = 0.0
        t = self.config.collective_timeout_s if timeout is None else timeout
        session = self._compress_session(spec, staged.cpu) if spec is not None else None
        if session is not None:
            session.set_segments(staged.flat.segments())  # Accordion decides per tensor
            if step is not None:
                session.track_applied()
        resyncs = self._step_resync  # replicas made identical (gossipnet/_step_resync.py)
        resync = self._resync_step(step, t) if step is not None and resyncs.first() else None
        # a training step's gradients: the optimizer's loss rule (XOR parity while loss
        # is seen; a compressed round sends copies instead, Config.compressed_copies)
        parity = self.config.parity_for(optimizer=step is not None)
        work = functools.partial(self._all_reduce, staged.cpu, weight, t, session, robust, parity)
        report, loop_s = self._call(loop_cpu(work), t + 30)
        staged.write_back(tensors)
        if step is not None:
            caught = step_all_reduced(step, tensors, staged.flat, session)
            report.extra["catch_up"] = float(caught)
            if resyncs.due():
                resync = self._resync_step(step, t)
        if resync is not None:
            report.extra["resync"] = 1.0
            report.extra["resync_moved"] = resync.extra["resync_moved"]
            report.extra["resync_chunks_stale"] = float(resync.chunks_stale)
            add_resync_bytes(report, resync)
        # the resync's loop CPU counts too (its caller share is in this thread's time)
        resync_s = resync.extra.get(CPU_LOOP_KEY, 0.0) if resync is not None else 0.0
        stamp_cpu(report, loop_s + resync_s, time.thread_time() - cpu0)
        if staged.nonfinite:
            report.extra["nonfinite_local"] = 1.0
        return report

    def island_all_reduce(
        self, replicas: Sequence[Sequence[torch.Tensor]], timeout: float | None = None
    ) -> CollectiveReport:
        """Average per-GPU replicas: Blink trees over this machine's NVLink islands,
        then one lossy :meth:`all_reduce` weighted by the replica count, then back.

        ``replicas[i]`` is the list of tensors on the i-th local device (same layout
        everywhere), all updated in place. Without CUDA or NVLink the local step is a
        plain mean. See :mod:`gossipnet.collectives.island.hierarchical`.
        """
        from gossipnet.collectives.island.hierarchical import (
            island_all_reduce,  # lazy: GPU-only code
        )

        return island_all_reduce(self, replicas, timeout)

    def island_average(
        self,
        tensors: Sequence[torch.Tensor],
        timeout: float | None = None,
        *,
        topology: GpuTopology | None = None,
        device: int | None = None,
    ) -> CollectiveReport:
        """Like :meth:`all_reduce`, for one process per GPU (torchrun): the peers on
        this machine whose GPUs share an NVLink island average through Blink over
        shared memory, and only each island's leader (lowest peer id) speaks on the
        lossy network, weighted by its island's size.  Without CUDA or NVLink every
        peer is its own island: the plain lossy all-reduce.  Every peer must call it
        the same number of times (like any collective).

        Args:
            tensors: this process's float tensors (one device), updated in place.
            timeout: bound of the round in seconds (default
                ``Config.collective_timeout_s``); a member whose leader is dead or
                late returns after it plus ``Config.control_timeout_s`` with its own
                values (``report.extra["leader_lost"] == 1``).
            topology: the machine's :class:`~gossipnet.collectives.blink.topology.GpuTopology`
                (default: detected once for CUDA tensors; tests inject one).
            device: this process's GPU id in ``topology`` (default: the tensors' CUDA
                index; CPU tensors with a topology and a device use shared memory).

        Returns:
            The leader's all-reduce report (``method="island"``, ``participants`` =
            the leaders) or, for a member, its island's view (no packets sent).
            See :mod:`gossipnet.collectives.island.averager`.
        """
        host = IslandHost(self._runtime, self._allreduce)
        return self._island.average(host, tensors, timeout, topology=topology, device=device)

    async def _all_reduce(
        self,
        buckets: list[torch.Tensor],
        weight: float,
        timeout_s: float,
        session: CompressSession | None = None,
        robust: CenteredClip | None = None,
        parity_group: int | None = None,
    ) -> CollectiveReport:
        opts = RoundOptions(
            weight=weight,
            timeout_s=timeout_s,
            compress=session,
            robust=robust,
            parity_group=parity_group,
        )
        return await self._engine().run(buckets, opts)

    def resync(self, opt: torch.optim.Optimizer, timeout: float | None = None) -> CollectiveReport:
        """Average ``opt``'s parameters now, with repair: every replica leaves it the
        same model.

        For the DDP-style loop (``all_reduce(grads, step=opt)``), whose scheduled
        resyncs run every ``Config.resync_every_steps`` calls: under loss the
        replicas drift between them, so call this at the end of training (and
        before a checkpoint or an evaluation that should speak for every peer), as
        ``opt.resync()`` does for ``net.optimizer``.  Every peer must call it at the
        same point of its loop (after the same ``all_reduce`` calls).  The report's
        ``extra["resync_moved"]`` is this peer's largest drift from the average.

        Raises:
            TimeoutError: the round outlived its bound (two ``timeout``, default
                ``Config.collective_timeout_s``, plus a margin).
        """
        t = self.config.collective_timeout_s if timeout is None else timeout
        return self._resync_step(opt, t)

    def _resync_step(self, opt: torch.optim.Optimizer, timeout_s: float) -> CollectiveReport:
        return self._step_resync.run(opt, self._engine(), self._call, timeout_s, self._replicas)

    def _compress_session(
        self, spec: Compression, buckets: Sequence[torch.Tensor]
    ) -> CompressSession:
        """The error-feedback state of ``spec`` for this layout (kept across calls)."""
        key = (spec, tuple((b.numel(), b.dtype) for b in buckets))
        session = self._compress_sessions.get(key)
        if session is None:
            session = self._compress_sessions[key] = CompressSession(spec)
        return session

    def _engine(self) -> LossyAllReduce:
        return self._allreduce

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        method: str = "moshpit",
        rounds: int | None = None,
        *,
        weight: float = 1.0,
        timeout: float | None = None,
        group_size: int | None = None,
        start_round: int | None = None,
        compress: Compression | None = None,
    ) -> CollectiveReport:
        """Average ``tensors`` (e.g. parameters) with the other peers, in place.

        ``method="moshpit"`` (Ryabinin et al. 2021): ``rounds`` rounds of group
        all-reduces on a virtual grid of groups of at most ``group_size`` peers;
        the default runs the grid's d rounds, which give every peer the exact
        mean on a full grid, and contract the spread geometrically otherwise.
        ``method="allreduce"`` is :meth:`all_reduce`.  ``method="route"``
        (RoADTrain, reconstructed): ``rounds`` rounds (default 1) of gossip on the
        matchings that the peers' shared routes (:meth:`set_route`) predict will
        connect the fleet best, Metropolis-Hastings weights per matching; a link
        that fails is skipped at both ends (the mean is kept) and a peer with no
        feasible link keeps its values (``report.extra["isolated"] == 1``).  Lost
        packets, dead peers and peers whose views disagree never raise: the report
        says what happened.

        Args:
            tensors: any float dtypes and shapes, the same layout on every peer.
            rounds: Moshpit rounds in this call (None: the grid's d, one sweep).
            weight: this peer's weight in each group mean, >= 0.
            timeout: bound of each group all-reduce in seconds (default
                ``Config.collective_timeout_s``); matchmaking adds its own bound.
                For ``"route"``: how long a round waits for missing routes (default
                ``Config.control_timeout_s``); the round itself is bounded by its plan.
            group_size: largest group M (default 32); the grid follows the live count.
            start_round: Moshpit (or route) round number to start at (advanced): by
                default each call is the next sweep; the optimizer strategy passes
                ``step // average_every * SWEEP_STRIDE`` so that peers average the same
                sweep at the same step however long any of them stalled.
            compress: with ``method="allreduce"``, as :meth:`all_reduce`'s.

        Returns:
            The merged :class:`CollectiveReport` (``extra``: rounds, mean group size,
            rounds spent alone).
        """
        if method == "allreduce":
            return self.all_reduce(tensors, timeout, weight=weight, compress=compress)
        if compress is not None:
            raise ConfigError(f"compress= applies to method='allreduce' here, not {method!r}")
        if method == "route":
            return route_average(
                self._training_host,
                tensors,
                rounds=rounds,
                timeout=timeout,
                start_round=start_round,
            )
        if method != "moshpit":
            raise ConfigError(
                f"average method {method!r} unknown; use 'moshpit', 'allreduce' or 'route'"
            )
        if not tensors:
            raise ValueError("average needs at least one tensor")
        averager = self._moshpit
        cfg = moshpit_config(averager.config, group_size, timeout)
        cpu0 = time.thread_time()
        staged = stage(self._flat_for(tensors), tensors)
        if staged.nonfinite:
            log.warning("peer %s: non-finite values to average; weight 0 this call", self.peer_id)
            weight = 0.0
        n_rounds = rounds or averager.grid_for(len(self.alive_peers()), cfg).dims
        work = functools.partial(
            averager.average,
            staged.cpu,
            rounds=rounds,
            weight=weight,
            config=cfg,
            start_round=start_round,
        )
        bound_s = moshpit_bound_s(cfg, n_rounds, self.config.collective_timeout_s)
        report, loop_s = self._call(loop_cpu(work), bound_s)
        staged.write_back(tensors)
        return stamp_cpu(report, loop_s, time.thread_time() - cpu0)

    def set_route(
        self,
        route: Route | None = None,
        *,
        radio: RadioModel | None = None,
        schedule: ScheduleConfig | None = None,
        route_time: RouteTime | None = None,
    ) -> None:
        """Announce this peer's route and set up route-aware gossip (``method="route"``).

        The route (timed waypoints, ``gossipnet.Route``) is sent to the other peers,
        reliably, and again whenever one joins or asks; call again when plans change.
        Every peer must use the same ``radio``, ``schedule`` and ``route_time``, since
        each computes the round's plan from them on its own.

        Args:
            route: where this peer will be and when (None: keep the current one).
            radio: the radio model that predicts delivery and rate by distance.
            schedule: the per-round radio-time budget and thresholds.
            route_time: round number -> seconds on the routes' time axis where the
                round's plan starts (default ``round * schedule.budget_s``).

        Raises:
            ConfigError: the route has more waypoints than one packet carries (4096).
        """
        if route is not None and not isinstance(route, Route):
            raise ConfigError(f"route must be a gossipnet.Route, got {type(route).__name__}")
        if route is not None and len(route.times_s) > 4096:
            raise ConfigError("a shared route may have at most 4096 waypoints; share less ahead")
        self._call(self._route.configure(route, radio, schedule, route_time))

    # ------------------------------------------------------------------ replicas
    def replicas_agree(self, timeout: float | None = None) -> ReplicaCheck:
        """Whether every alive peer's replica is the same as ours at the last resync.

        Every resync (``net.optimizer``'s, and ``net.resync(opt)`` or a scheduled
        resync of ``all_reduce(..., step=opt)``) hashes the parameters and announces
        the digest in heartbeats; this compares the digests for our latest resync of
        the peers heard taking part in it, waiting up to ``timeout`` seconds
        (default: two heartbeat intervals and a half) for those not heard yet.  With
        ``net.optimizer`` a peer that the others outvote repairs itself at its next
        step (the report's ``extra["replica_repaired"]``).  For a check at the end of
        training, call ``opt.resync()`` (or ``net.resync(opt)``) first: between
        resyncs replicas differ by design where broadcasts were lost.

        Returns:
            A :class:`gossipnet.ReplicaCheck`, truthy when all agree; ``disagree``
            and ``missing`` name the peers that differ or did not report.

        Raises:
            ConfigError: no resync has run on this peer yet (nothing to compare).
        """
        hb = self.config.heartbeat_interval_s
        t = 2.5 * hb if timeout is None else timeout
        check = self._call(self._await_digests(t), t + 30)
        if check.round_id is None:
            raise ConfigError(
                "replicas_agree() compares the parameter digests announced after each"
                " resync, and none has run here yet: call opt.resync() (net.optimizer)"
                " or net.resync(opt) (all_reduce(..., step=opt)) first"
            )
        return check

    def replica_check(self) -> ReplicaCheck:
        """The current digest verdict, without waiting (see :meth:`replicas_agree`)."""
        return self._call(self._verdict())

    async def _verdict(self) -> ReplicaCheck:
        return self._replicas.verdict(self._node.alive_peers())

    async def _await_digests(self, timeout_s: float) -> ReplicaCheck:
        clock = self._node.clock
        deadline = clock.now() + timeout_s
        while True:
            check = await self._verdict()
            if not check.missing or check.round_id is None or clock.now() >= deadline:
                return check
            await clock.sleep(min(self.config.heartbeat_interval_s / 4, timeout_s))

    def _flat_for(self, tensors: Sequence[torch.Tensor]) -> FlatBuffer:
        """The cached flat buffer for ``tensors``' layout (also used by route averaging)."""
        return self._runtime.flats.get(tensors)

    def optimizer(
        self,
        base: torch.optim.Optimizer,
        strategy: str | StrategyOptions = "allreduce",
        **kwargs: Any,
    ) -> GossipOptimizer:
        """Wrap ``base`` for data-parallel training over this peer.

        Args:
            base: a constructed torch optimizer over the model's parameters.
            strategy: ``"allreduce"``, ``"moshpit"`` or ``"route"`` (then ``kwargs``
                are its options: :class:`gossipnet.AllReduceOptions`,
                :class:`gossipnet.MoshpitOptions`, :class:`gossipnet.RouteOptions`,
                by field or historical name, e.g. ``resync_every_steps``, ``timeout``,
                ``average_every``), or one of those options values.
                ``compress=gossipnet.SparQ(...)`` with ``"moshpit"`` or ``"route"``:
                SPARQ-SGD gossip (compressed, event-triggered differences; with the
                all-reduce it raises ``ConfigError``).

        One optimizer steps per peer: its rounds are numbered by its own step
        count.  Another may replace it (a new training stage, a checkpoint loaded
        into a fresh one): the new one's rounds follow those already run, as on the
        other peers that replace theirs at the same point.

        Raises:
            ConfigError: an unknown strategy or option (the message names the
                accepted ones), or a strategy that cannot run here.  Stepping two
                optimizers of one peer in turn raises ``ConfigError`` at the step.

        See :class:`gossipnet.GossipOptimizer`.
        """
        return GossipOptimizer(self._training_host, base, resolve(strategy, kwargs))

    @functools.cached_property
    def _training_host(self) -> PeerTrainingHost:
        """This peer as the training layer sees it; one per peer (an ``AutoTau``
        knows the host it serves by identity)."""
        return PeerTrainingHost(self)

    # ------------------------------------------------------------------ DropCompute
    def microbatches(
        self,
        iterable: Iterable[T],
        max_microbatches: int = 8,
        *,
        tau: TauSpec = None,
        normalise: Normalise = "completed",
        clock: Clock | None = None,
    ) -> MicrobatchLoop[T]:
        """One step's micro-batches: at most ``max_microbatches``, cut once compute passes tau.

        DropCompute (Giladi et al. 2023): synchronous steps wait for the slowest
        peer, so a peer stops accumulating at a compute-time threshold and
        contributes what it has.  Call ``loss.backward()`` on each micro-batch's
        *mean* loss (no division by K): the next ``opt.step()`` divides the
        summed gradient by the micro-batches completed and weights the
        all-reduce by that count, so the step applies the mean over every
        micro-batch done on every peer; a peer with none contributes weight 0.

        Args:
            iterable: micro-batches.  A persistent iterator (``it = iter(loader)``,
                made once) resumes where the last step stopped, so cut micro-batches
                are deferred, not lost; a DataLoader passed directly restarts each step.
            max_microbatches: K, the accumulation steps of a full step.
            tau: ``None`` (no cut-off), seconds, ``"auto"`` (the authors' rule:
                time warm-up steps on every peer, keep the threshold with the best
                effective speed-up, re-estimate periodically) or a policy object
                such as ``gossipnet.AutoTau(config)``.
            normalise: ``"completed"`` (sum / micro-batches done everywhere) or
                ``"full"`` (the authors' code: sum / (N * K); dropped ones count as 0).
            clock: time source of the cut (default: this peer's clock).

        Returns:
            An iterator; after it ends, ``last_microbatch_report`` holds tau, the
            count and the drop rate, and ``opt.step()`` copies them into its
            report's ``extra``.
        """
        now = (clock or self._node.clock).now
        host = self._training_host
        return self._microbatch.loop(host, iterable, max_microbatches, tau, normalise, now)

    @property
    def last_microbatch_report(self) -> MicrobatchReport | None:
        """The last finished ``microbatches`` loop: count, tau, drop rate, times."""
        return self._microbatch.last

    def _take_microbatch_report(self) -> MicrobatchReport | None:
        """Finish the open ``microbatches`` loop; its report once per loop, else None."""
        return self._microbatch.take()
