"""``gossipnet.join()`` and :class:`Peer`: the synchronous facade.

The training thread calls plain methods; each one submits a coroutine to
the peer's event-loop thread (:mod:`gossipnet._loop`) and waits for it
with a deadline.  Tensors cross threads as CPU copies made by the caller's
thread; results are written back on the caller's thread, so the trainer
never races the network.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets as _secrets
import socket
from collections.abc import Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from . import _signals
from ._loop import LoopThread
from ._microbatch import MicrobatchLoop, MicrobatchReport, MicrobatchState, TauSpec
from ._node import Node
from ._route_optim import route_average
from .averaging.allreduce import LossyAllReduce
from .averaging.blink.island import IslandAverage
from .averaging.chunks import FlatBuffer, all_finite
from .averaging.dropcompute import Normalise
from .averaging.moshpit import MoshpitAverager
from .averaging.route import RouteAverager, RouteTime
from .averaging.statesync import StateSync
from .clock import Clock
from .config import Config
from .errors import ClosedError, ConfigError
from .mobility.radio import RadioModel
from .mobility.routes import Route
from .mobility.schedule import ScheduleConfig
from .optim import GossipOptimizer
from .rounds import CollectiveReport

if TYPE_CHECKING:
    from .averaging.blink.topology import GpuTopology

__all__ = ("Peer", "join")

log = logging.getLogger(__name__)
T = TypeVar("T")

_LOOPBACK = ("127.", "localhost", "::1")


def _torchrun_settings() -> tuple[list[str], str, str, int] | None:
    """(bootstrap, listen, peer_id, world_size) from torchrun's variables, if set.

    Rank 0 listens on ``MASTER_PORT + 1`` of ``MASTER_ADDR``; every rank
    bootstraps from it and listens on a free port of its own.  The peer id is
    ``rank<N>``, so a restarted rank (``--max-restarts``) comes back under the
    same name with a newer epoch.
    """
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"])
        port = int(env.get("MASTER_PORT", "29500")) + 1
    except ValueError as err:
        raise ConfigError(f"torchrun variables are not integers: {err}") from err
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if master in ("localhost",):
        master = "127.0.0.1"
    rank0 = f"tcp://{master}:{port}"
    listen = f"tcp://0.0.0.0:{port}" if rank == 0 else "tcp://0.0.0.0:0"
    return [rank0], listen, f"rank{rank}", world


def _advertise_host(bootstrap: Sequence[str]) -> str | None:
    """The host to advertise when listening on a wildcard address.

    Loopback peers get ``127.0.0.1``; otherwise the kernel's source address
    toward the first bootstrap peer (a connected UDP socket sends nothing).
    Why not ``gethostbyname(gethostname())``: inside containers and network
    namespaces it often resolves to 127.0.0.1, which peers cannot dial.
    """
    hosts = [b.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]") for b in bootstrap]
    if not hosts or all(h.startswith(_LOOPBACK) for h in hosts):
        return "127.0.0.1"
    for host in hosts:
        if host.startswith(_LOOPBACK):
            continue
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))
                return str(probe.getsockname()[0])
        except OSError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


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
        self._loop = LoopThread(f"gossipnet-{peer_id}", use_uvloop=config.use_uvloop)
        self._node = Node(
            config=config,
            listen=listen,
            peer_id=peer_id,
            secret=secret,
            bootstrap=bootstrap,
            clock=clock,
            faults=faults,
            network=network,
            advertise_host=_advertise_host(bootstrap),
        )
        self._closed = False
        self._allreduce: LossyAllReduce | None = None
        self._moshpit: MoshpitAverager | None = None
        self._statesync: StateSync | None = None
        self._route: RouteAverager | None = None
        self._island: IslandAverage | None = None
        self._flats: dict[tuple[Any, ...], FlatBuffer] = {}
        self._microbatch = MicrobatchState()
        try:
            self._loop.call(self._start(), timeout_s=config.control_timeout_s + 10)
            if expected_peers is None:
                # our own address was removed from the bootstrap list at start
                expected_peers = len(self._node.bootstrap) + 1
            if expected_peers > 1:
                ok = self._loop.call(
                    self._node.wait_for_peers(expected_peers, config.join_timeout_s),
                    timeout_s=config.join_timeout_s + 5,
                )
                if not ok:
                    log.warning(
                        "peer %s: %d of %d expected peers alive after %.1f s; going on",
                        peer_id,
                        len(self.alive_peers()),
                        expected_peers,
                        config.join_timeout_s,
                    )
        except BaseException:
            self.close(announce=False)
            raise

    # ------------------------------------------------------------------ identity
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
        return self._call(self._alive())

    async def _alive(self) -> list[str]:
        return self._node.alive_peers()

    def stats(self) -> dict[str, Any]:
        """Transport, fault and wire counters (a snapshot)."""
        return self._call(self._stats())

    async def _stats(self) -> dict[str, Any]:
        return self._node.stats()

    def wait_for_peers(self, count: int, timeout_s: float | None = None) -> bool:
        """Block until ``count`` peers (self included) are alive; False at the deadline."""
        t = self.config.join_timeout_s if timeout_s is None else timeout_s
        return self._call(self._node.wait_for_peers(count, t), t + 5)

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        timeout: float | None = None,
        *,
        weight: float = 1.0,
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

        Returns:
            The round's :class:`CollectiveReport`; packet loss never raises.
        """
        if not tensors:
            raise ValueError("all_reduce needs at least one tensor")
        flat = self._flat_for(tensors)
        buckets = flat.flatten(tensors)
        nonfinite = not all(all_finite(b) for b in buckets)
        if nonfinite:
            log.warning(
                "peer %s: non-finite values in all_reduce input; contributing weight 0 this round",
                self.peer_id,
            )
            for b in buckets:
                torch.nan_to_num_(b, nan=0.0, posinf=0.0, neginf=0.0)
            weight = 0.0
        cpu = [b if b.device.type == "cpu" else b.cpu() for b in buckets]
        t = self.config.collective_timeout_s if timeout is None else timeout
        report = self._call(self._all_reduce(cpu, weight, t), t + 30)
        for b, c in zip(buckets, cpu, strict=True):
            if b is not c:
                b.copy_(c)
        flat.unflatten_into(tensors)
        if nonfinite:
            report.extra["nonfinite_local"] = 1.0
        return report

    def island_all_reduce(
        self, replicas: Sequence[Sequence[torch.Tensor]], timeout: float | None = None
    ) -> CollectiveReport:
        """Average per-GPU replicas: Blink trees over this machine's NVLink islands,
        then one lossy :meth:`all_reduce` weighted by the replica count, then back.

        ``replicas[i]`` is the list of tensors on the i-th local device (same layout
        everywhere), all updated in place. Without CUDA or NVLink the local step is a
        plain mean. See :mod:`gossipnet.averaging.blink.hierarchical`.
        """
        from .averaging.blink.hierarchical import island_all_reduce  # lazy: GPU-only code

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
            topology: the machine's :class:`~gossipnet.averaging.blink.topology.GpuTopology`
                (default: detected once for CUDA tensors; tests inject one).
            device: this process's GPU id in ``topology`` (default: the tensors' CUDA
                index; CPU tensors with a topology and a device use shared memory).

        Returns:
            The leader's all-reduce report (``method="island"``, ``participants`` =
            the leaders) or, for a member, its island's view (no packets sent).
            See :mod:`gossipnet.averaging.blink.island`.
        """
        assert self._island is not None
        return self._island.average(self, tensors, timeout, topology=topology, device=device)

    async def _all_reduce(
        self, buckets: list[torch.Tensor], weight: float, timeout_s: float
    ) -> CollectiveReport:
        return await self._engine().run(buckets, weight=weight, timeout_s=timeout_s)

    def _engine(self) -> LossyAllReduce:
        assert self._allreduce is not None
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

        Returns:
            The merged :class:`CollectiveReport` (``extra``: rounds, mean group size,
            rounds spent alone).
        """
        if method == "allreduce":
            return self.all_reduce(tensors, timeout, weight=weight)
        if method == "route":
            return route_average(
                self, tensors, rounds=rounds, timeout=timeout, start_round=start_round
            )
        if method != "moshpit":
            raise ConfigError(
                f"average method {method!r} unknown; use 'moshpit', 'allreduce' or 'route'"
            )
        if not tensors:
            raise ValueError("average needs at least one tensor")
        averager = self._moshpit
        assert averager is not None
        cfg = averager.config
        if group_size is not None or timeout is not None:
            cfg = dataclasses.replace(
                cfg,
                max_group_size=cfg.max_group_size if group_size is None else group_size,
                round_timeout_s=cfg.round_timeout_s if timeout is None else timeout,
            )
        flat = self._flat_for(tensors)
        buckets = flat.flatten(tensors)
        if not all(all_finite(b) for b in buckets):
            log.warning("peer %s: non-finite values to average; weight 0 this call", self.peer_id)
            for b in buckets:
                torch.nan_to_num_(b, nan=0.0, posinf=0.0, neginf=0.0)
            weight = 0.0
        cpu = [b if b.device.type == "cpu" else b.cpu() for b in buckets]
        n_rounds = rounds or averager.grid_for(len(self.alive_peers()), cfg).dims
        per_round = cfg.matchmaking_timeout_s + 3 * cfg.reply_margin_s
        per_round += cfg.round_timeout_s or self.config.collective_timeout_s
        coro = averager.average(
            cpu, rounds=rounds, weight=weight, config=cfg, start_round=start_round
        )
        report = self._call(coro, (n_rounds + 1) * per_round + 30)
        for b, c in zip(buckets, cpu, strict=True):
            if b is not c:
                b.copy_(c)
        flat.unflatten_into(tensors)
        return report

    async def _start(self) -> None:
        """Start the node and its engines on the loop thread, before any packet can
        arrive for them (an engine created lazily would miss a fast peer's first round)."""
        await self._node.start()
        self._allreduce = LossyAllReduce(self._node)
        self._moshpit = MoshpitAverager(self._node)
        self._statesync = StateSync(self._node)
        self._route = RouteAverager(self._node)
        self._island = IslandAverage(self._node)

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
        assert self._route is not None
        self._call(self._route.configure(route, radio, schedule, route_time))

    def _flat_for(self, tensors: Sequence[torch.Tensor]) -> FlatBuffer:
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
        flat = self._flats.get(key)
        if flat is None:
            flat = FlatBuffer(tensors)
            if len(self._flats) > 8:
                self._flats.clear()
            self._flats[key] = flat
        return flat

    def optimizer(
        self, base: torch.optim.Optimizer, strategy: str = "allreduce", **kwargs: Any
    ) -> GossipOptimizer:
        """Wrap ``base`` for data-parallel training over this peer.

        See :class:`gossipnet.optim.GossipOptimizer`; ``kwargs`` go to it
        (``resync_every_steps``, ``timeout``).
        """
        return GossipOptimizer(self, base, strategy=strategy, **kwargs)

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
        return self._microbatch.loop(self, iterable, max_microbatches, tau, normalise, now)

    @property
    def last_microbatch_report(self) -> MicrobatchReport | None:
        """The last finished ``microbatches`` loop: count, tau, drop rate, times."""
        return self._microbatch.last

    def _take_microbatch_report(self) -> MicrobatchReport | None:
        """Finish the open ``microbatches`` loop; its report once per loop, else None."""
        return self._microbatch.take()

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if self._closed:
            coro.close()
            raise ClosedError("this peer has left; call gossipnet.join() again")
        return self._loop.call(
            coro, self.config.control_timeout_s + 30 if timeout_s is None else timeout_s
        )

    # ------------------------------------------------------------------ shutdown
    def leave(self) -> None:
        """Announce departure to the alive peers (bounded wait), then close."""
        self.close(announce=True)

    def close(self, *, announce: bool = False) -> None:
        """Close sockets, cancel tasks, join the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.call(
                self._node.close(announce=announce), timeout_s=self.config.control_timeout_s + 5
            )
        except (ClosedError, TimeoutError, RuntimeError):
            log.warning("peer %s: close did not finish cleanly", self._node.peer_id)
        finally:
            self._loop.stop()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<gossipnet.Peer {self.peer_id} {self.address} {state}>"


def join(
    peers: Sequence[str] | None = None,
    listen: str | None = None,
    *,
    secret: bytes | str | None = None,
    faults: Any = None,
    config: Config | None = None,
    clock: Clock | None = None,
    network: Any = None,
    wait_for: int | None = None,
    handle_sigterm: bool = True,
    route: Route | None = None,
    radio: RadioModel | None = None,
    **overrides: Any,
) -> Peer:
    """Start a peer and join the others.

    Args:
        peers: bootstrap addresses (``tcp://host:port``, ``udp://...``, ``mem://name``);
            may include our own.  ``None`` reads torchrun's environment
            (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
        listen: our address; port 0 binds a free port.  Its scheme picks the backend.
        secret: run secret keying the MAC of every packet (else ``GOSSIPNET_SECRET``;
            else a key derived from the run id only, which stops accidents, not attackers).
        faults: a :class:`gossipnet.FaultPlan` applied to everything this peer sends.
        config: base :class:`gossipnet.Config`; ``overrides`` replace its fields.
        clock: injected clock (tests); real monotonic time by default.
        network: the :class:`gossipnet.testing.MemoryNetwork` for ``mem://`` peers.
        wait_for: peers (self included) to wait for before returning, up to
            ``Config.join_timeout_s``; default: the distinct bootstrap addresses plus
            us, or ``WORLD_SIZE`` under torchrun.
        handle_sigterm: on SIGTERM, announce our departure and leave (within about a
            second), then exit as SIGTERM would; installed only from the main thread.
        route, radio: this peer's route and the radio model for route-aware gossip
            (``method="route"``, ``strategy="route"``); see :meth:`Peer.set_route`.

    Returns:
        A running :class:`Peer` (also a context manager that leaves on exit).
    """
    cfg = (config or Config()).replace(**overrides) if overrides else (config or Config())
    bootstrap = list(peers) if peers is not None else []
    peer_id = cfg.peer_id
    expected = wait_for
    if peers is None:
        tr = _torchrun_settings()
        if tr is not None:
            bootstrap, tr_listen, tr_id, world = tr
            listen = listen or tr_listen
            peer_id = peer_id or tr_id
            expected = expected if expected is not None else world
    if listen is None:
        scheme = bootstrap[0].split("://", 1)[0] if bootstrap else "tcp"
        listen = "mem://" if scheme == "mem" else f"{scheme}://127.0.0.1:0"
    if peer_id is None:
        peer_id = f"{socket.gethostname()[:16]}-{os.getpid()}-{_secrets.token_hex(3)}"
    if secret is None:
        env_secret = os.environ.get("GOSSIPNET_SECRET")
        secret = env_secret.encode() if env_secret else None
    key = secret.encode() if isinstance(secret, str) else secret
    peer = Peer(
        config=cfg,
        listen=listen,
        peer_id=peer_id,
        bootstrap=bootstrap,
        secret=key,
        faults=faults,
        clock=clock,
        network=network,
        expected_peers=expected,
    )
    if route is not None or radio is not None:
        try:
            peer.set_route(route, radio=radio)
        except BaseException:
            peer.close(announce=False)
            raise
    if handle_sigterm:
        _signals.install(peer)
    return peer
