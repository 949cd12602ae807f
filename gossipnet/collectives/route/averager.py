"""Route-aware gossip over the network: ``net.average(..., method="route")``.

RoADTrain, reconstructed (ALGORITHMS.md section 4; the paper was not available).  The
planning and the per-pair exchange live in :mod:`gossipnet.mobility` (which never
touches the transport); this module is the networked part a peer adds:

1. **Route sharing.**  Each peer announces its route (timed waypoints, a few KB) in a
   reliable ``ROUTE_SHARE`` message: to every alive peer when it changes, and on
   request.  A peer that learns a newer version of anyone's route relays it to the
   peers it hears (so vehicles that are never in range of each other still learn
   each other's routes, hop by hop), and catches up a peer that joins on every route
   it holds.  Heartbeats carry the route's version (``rv``), so a peer that missed an
   announcement asks the owner when it next hears it.
2. **A shared plan.**  Round ``r`` covers ``route_time(r)`` onwards on the routes' time
   axis (default ``r * budget_s``).  Every peer runs the same pure function
   (:func:`gossipnet.mobility.plan_round`) on the same routes, ordered by peer id, so
   they agree on the matchings without talking.  Who is planned: every peer whose
   route we hold and that has not left.  Not the alive view: under radio loss a peer
   out of range looks dead to some and alive to others, and views that differ would
   give different plans.
3. **The exchange.**  :class:`gossipnet.mobility.RouteGossip` runs the phases: a
   pairwise Metropolis-Hastings step per matching, chunk by chunk, averaged only where
   both ends got each other's chunk (receipts), so a failed link is skipped by both
   ends and the mean is kept.  A peer with no feasible link keeps its values; its
   report says ``extra["isolated"] == 1``.

Why the route store and not the alive view decides the plan, and what it costs: two
peers whose stores differ (a route still in flight) plan differently for a round;
their exchanges then time out and both keep their values (no harm to the mean), and
the next heartbeat repairs the store.  A peer that crashed stays planned until it is
replaced (restart: new epoch) or leaves; its partners wait out its phases.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossipnet.collectives.route.kinds import RouteKind
from gossipnet.errors import ConfigError
from gossipnet.mobility.gossip import RouteGossip, partner_of, plan_round
from gossipnet.mobility.radio import RadioModel
from gossipnet.mobility.routes import Route
from gossipnet.mobility.schedule import ScheduleConfig
from gossipnet.reports import CollectiveReport
from gossipnet.transport.faults import FaultPlan
from gossipnet.transport.wire import Packet

__all__ = ("RouteAverager", "RouteTime", "radio_faults")

log = logging.getLogger(__name__)

#: Round number -> seconds on the routes' time axis where the round's plan starts.
RouteTime = Callable[[int], float]
_MAX_WAYPOINTS = 4096  # a shared route is one packet: 24 bytes per waypoint


@dataclass(frozen=True, slots=True)
class _Held:
    """A peer's route as we last heard it: (epoch, version) orders announcements."""

    epoch: int
    version: int
    route: Route


def encode_route(route: Route) -> bytes:
    """``times | xs | ys`` as little-endian float64: raw payload, no msgpack."""
    return (
        np.concatenate([route.times_s, route.points_m[:, 0], route.points_m[:, 1]])
        .astype("<f8")
        .tobytes()
    )


def decode_route(payload: memoryview | bytes, m: int) -> Route | None:
    """The route in ``payload`` (``m`` waypoints), or None if it is malformed."""
    if not 0 < m <= _MAX_WAYPOINTS or len(payload) != 24 * m:
        return None
    data = np.frombuffer(payload, dtype="<f8").astype(np.float64)
    if not np.isfinite(data).all():
        return None
    try:
        return Route(data[:m].copy(), np.stack([data[m : 2 * m], data[2 * m :]], axis=1))
    except ValueError:
        return None


class RouteAverager:
    """One peer's route store and route-aware gossip rounds (loop thread only).

    Args:
        node: the started node (``gossipnet.runtime.node.Node``).
    """

    def __init__(self, node: Any) -> None:
        self.node = node
        cfg = node.config
        chunk = cfg.chunk_bytes or node.transport.default_chunk_bytes
        self.own: Route | None = None
        self.version = 0
        self.routes: dict[str, _Held] = {}
        self.radio = RadioModel()
        self.schedule = ScheduleConfig()
        self.route_time: RouteTime | None = None
        self.next_round = 0
        self.rejects: collections.Counter[str] = collections.Counter()
        self._asking: set[str] = set()
        self.gossip = RouteGossip(
            node,
            [node.peer_id],
            chunk_bytes=max(4, min(chunk, cfg.max_payload_bytes) // 4 * 4),
            receipt_timeout_s=cfg.control_timeout_s,
            kinds=(RouteKind.DATA, RouteKind.RECEIPT),
        )
        node.subscribe(RouteKind.SHARE, self._on_share)
        node.on_heartbeat(self._on_heartbeat)
        node.on_membership(self._on_membership)

    # ------------------------------------------------------------------ routes
    async def configure(
        self,
        route: Route | None,
        radio: RadioModel | None,
        schedule: ScheduleConfig | None,
        route_time: RouteTime | None,
    ) -> None:
        """Adopt settings given (None keeps the current one); announce a new route."""
        self.radio = radio or self.radio
        self.schedule = schedule or self.schedule
        self.route_time = route_time or self.route_time
        if route is None:
            return
        self.own = route
        self.version += 1
        self.node.beacon["rv"] = self.version
        for peer in self.node.alive_peers():
            if peer != self.node.peer_id:
                self._send_route(peer)

    def _held(self, owner: str) -> _Held | None:
        """The latest route of ``owner`` that we know (ours included)."""
        if owner != self.node.peer_id:
            return self.routes.get(owner)
        return None if self.own is None else _Held(self.node.codec.epoch, self.version, self.own)

    def _send_route(self, peer: str, owner: str | None = None, *, want: bool = False) -> None:
        """``owner``'s route (default ours) to ``peer``, reliably, until ``peer`` has the
        latest version; with ``want``, also ask ``peer`` for its own."""
        owner = owner or self.node.peer_id
        key = f"{peer}\0{owner}"
        if self.node.closed or key in self._asking:
            return
        if self._held(owner) is None and not want:
            return
        self._asking.add(key)

        async def send() -> None:
            try:
                ask = want
                while not self.node.closed:
                    held = self._held(owner)
                    fields: dict[str, Any] = {"o": owner, "oe": 0, "rv": 0, "m": 0, "w": int(ask)}
                    payload = b""
                    if held is not None:
                        fields.update(oe=held.epoch, rv=held.version, m=len(held.route.times_s))
                        payload = encode_route(held.route)
                    ok = await self.node.send_reliable(peer, RouteKind.SHARE, fields, payload)
                    now, ask = self._held(owner), False
                    if not ok or now is None or now == held:
                        return  # delivered the latest (or the link is down: heartbeats retry)
            finally:
                self._asking.discard(key)

        self.node.spawn(send(), f"route-share-{peer}-{owner}")

    def _on_share(self, pkt: Packet) -> None:
        f = pkt.fields
        owner, oe = f.get("o", pkt.src), f.get("oe", pkt.epoch)
        # a missing "rv" reads as -1, which the >= 0 check below rejects as it did None
        v, m, w = f.get("rv", -1), f.get("m"), f.get("w", 0)
        if not (isinstance(owner, str) and owner) or not all(
            isinstance(x, int) and x >= 0 for x in (oe, v, m, w)
        ):
            self.rejects["route_fields"] += 1
            return
        me = self.node.peer_id
        if m and owner != me:
            route = decode_route(pkt.payload, m)
            if route is None:
                self.rejects["route_payload"] += 1
                return
            held = self.routes.get(owner)
            if held is None or (oe, v) > (held.epoch, held.version):
                self.routes[owner] = _Held(oe, v, route)
                # relay: peers out of the owner's range learn its route through us
                for peer in self.node.alive_peers():
                    if peer not in (me, pkt.src, owner):
                        self._send_route(peer, owner)
        if w and self.own is not None:
            self._send_route(pkt.src)

    def _on_heartbeat(self, pkt: Packet) -> None:
        rv = pkt.fields.get("rv")
        if not isinstance(rv, int):
            return
        held = self.routes.get(pkt.src)
        if held is None or (pkt.epoch, rv) > (held.epoch, held.version):
            self._send_route(pkt.src, want=True)  # ours, and please yours

    def _on_membership(self, event: str, peer: str) -> None:
        if event == "left":
            self.routes.pop(peer, None)
        elif event == "joined":  # catch a newcomer (or a restart) up on every route
            for owner in [self.node.peer_id, *self.routes]:
                if owner != peer:
                    self._send_route(peer, owner)

    async def wait_for_routes(self, timeout_s: float) -> list[str]:
        """Wait (bounded) until we hold every alive peer's route; those still missing."""
        clock, deadline = self.node.clock, self.node.clock.now() + timeout_s
        me = self.node.peer_id
        while True:
            missing = [p for p in self.node.alive_peers() if p != me and p not in self.routes]
            remaining = deadline - clock.now()
            if not missing or remaining <= 0:
                return missing
            for peer in missing:
                self._send_route(peer, want=True)
            await clock.sleep(min(self.node.config.control_retry_s, remaining))

    # ------------------------------------------------------------------ rounds
    def round_time(self, rnd: int) -> float:
        """Seconds on the routes' time axis where round ``rnd``'s plan starts."""
        if self.route_time is not None:
            return float(self.route_time(rnd))
        return rnd * self.schedule.budget_s

    def bound_s(self, share_wait_s: float) -> float:
        """An upper bound of one :meth:`average` call (seconds): for callers' timeouts."""
        stretch = 1.0 + self.gossip.phase_slack
        others = max(len(self.routes), 1)
        receipts = others * self.gossip.receipt_timeout_s
        return share_wait_s + 2.0 * stretch * self.schedule.budget_s + receipts

    async def average(
        self, flat: torch.Tensor, *, rnd: int | None = None, share_wait_s: float = 0.0
    ) -> CollectiveReport:
        """One route-aware gossip round on ``flat`` (1-D float32 CPU), in place.

        Raises:
            ConfigError: this peer has no route (``set_route`` first).
        """
        if self.own is None:
            raise ConfigError(
                "method='route' needs this peer's route: join(..., route=...) or "
                "net.set_route(route)"
            )
        missing = await self.wait_for_routes(share_wait_s)
        rnd = self.next_round if rnd is None else rnd
        self.next_round = rnd + 1
        me = self.node.peer_id
        names = sorted({me, *self.routes})
        routes = [self.own if p == me else self.routes[p].route for p in names]
        t0 = self.round_time(rnd)
        sched = plan_round(routes, t0, 4.0 * flat.numel(), radio=self.radio, schedule=self.schedule)
        self.gossip.set_names(names)
        mine = sum(p is not None for p in partner_of(sched, self.gossip.me))
        deadline = self.gossip.round_bound_s(sched)
        rep = await self.gossip.run_round(rnd, flat, sched)
        rep.extra.update(
            {
                "route_time_s": t0,
                "planned_peers": float(len(names)),
                "phases": float(len(sched.phases)),
                "my_phases": float(mine),
                "isolated": float(mine == 0),
                "deadline_s": deadline,
                "routes_missing": float(len(missing)),
            }
        )
        if mine == 0:
            log.info("peer %s round %d: no feasible link; keeping own values", me, rnd)
        return rep


def radio_faults(
    routes: Mapping[str, Route] | Callable[[], Mapping[str, Route]],
    radio: RadioModel | None = None,
    *,
    route_time: Callable[[float], float] | None = None,
    seed: int = 0,
    **plan: Any,
) -> FaultPlan:
    """A :class:`~gossipnet.FaultPlan` whose loss on each link follows the radio model.

    The loss of a packet ``src -> dst`` sent at plan time ``t`` is
    ``1 - radio.delivery(distance)`` between the two routes' positions at
    ``route_time(t)`` (1 beyond range): what a vehicle's radio would lose at that
    distance.  For tests, simulations and emulation on one machine.

    Args:
        routes: link name (the peer's transport address, e.g. ``mem://p0``) -> route,
            or a callable returning that mapping (routes that change).  Endpoints not
            in it get ``plan.get("loss", 0)``.
        radio: the radio model (default :class:`RadioModel`).
        route_time: plan time (seconds since the transport started) -> seconds on the
            routes' axis; default the same.
        seed, plan: further :class:`FaultPlan` arguments (delays, crashes, ...).
    """
    radio = radio or RadioModel()
    when = route_time or (lambda t: t)
    fallback = float(plan.get("loss", 0.0))

    def link_loss(src: str, dst: str, t: float) -> float:
        table = routes() if callable(routes) else routes
        a, b = table.get(src), table.get(dst)
        if a is None or b is None:
            return fallback
        rt = when(t)
        d = float(np.linalg.norm(a.position(rt) - b.position(rt)))
        return 1.0 - float(radio.delivery(d))

    return FaultPlan(seed=seed, link_loss=link_loss, **plan)
