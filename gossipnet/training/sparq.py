"""SPARQ-SGD for the gossip strategies: ``compress=gossipnet.SparQ(...)``.

SPARQ-SGD (Singh et al., arXiv 1910.14280; ALGORITHMS.md section 6): after H local
steps (the strategy's ``average_every``) a peer sends quantised, sparsified
*differences* ``C(x_i - x_hat_i)`` only if its event trigger fires
(``||x_i - x_hat_i||^2 > c_t * lr^2``, ``c_t`` growing, :meth:`SparQ.threshold`), every
peer keeps estimates ``x_hat_j`` of its neighbours, and every peer moves
``x_i += gamma * sum_j w_ij (x_hat_j - x_hat_i)``.  The wire protocol, the estimate
versions and how copies resync under loss are in :mod:`gossipnet.collectives.sparq`.

How it fits each strategy (the neighbours and W of a round):

- ``"route"``: the round's plan (the same pure function of the shared routes as
  dense route gossip, so the same links) gives the neighbours; W is
  Metropolis-Hastings on the union of the plan's matchings (``w_ij = 1 / (1 +
  max(deg_i, deg_j))``), symmetric and doubly stochastic, so the neighbour-estimate
  form applies as the paper states it.
- ``"moshpit"``: the Moshpit grid's group of the round (the plan every peer
  derives from its view and the round number, without matchmaking: SparQ needs no
  all-reduce) is the neighbourhood, W uniform ``1/|G|`` inside the group; the round
  rotates the grid axis each sync.  Estimates are held per group member, keyed by
  peer id, one copy per peer ever met: a peer's DELTAs go to its current group
  only, so a copy held by a peer of another group falls behind and is repaired
  (replayed DELTAs, or an exact refresh beyond ``history``) from the END's versions
  when the two meet again.  Memory: one model copy per peer met.

Optimizer state is never gossiped under SparQ (``average_state`` is refused), and
Moshpit's ``rounds`` does not apply: one SPARQ round per averaging.  Building the
optimizer runs an introduction round (-1, weight 0) with every alive peer, so that
the first copies are exact refreshes of everyone's starting estimate.

What a SPARQ step reports (``CollectiveReport.method == "sparq"``), in ``extra``:
``bytes_sent`` (every SparQ frame this peer sent since the last report, repairs
included), ``bytes_dense`` (what dense gossip on the same neighbours sends: the
group all-reduce's ``2 (g-1)/g`` model copies, or one copy per route partner),
``compression_ratio`` (their ratio), ``triggered`` (1: this peer sent a difference),
``delta_packets``, ``neighbours``, ``mixed`` (copies used), ``stale_neighbours``
(used but behind their sender's END), and cumulative ``resync_*`` (gaps, NACKs sent,
re-sent and answered, blocks replayed and refreshed, ENDs re-sent) and ``drop_*``
(malformed packets by kind) counters.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from gossipnet.collectives.moshpit.averager import SWEEP_STRIDE
from gossipnet.collectives.moshpit.grid import plan_round as moshpit_plan
from gossipnet.collectives.sparq.codec import Layout
from gossipnet.collectives.sparq.config import SparQ
from gossipnet.collectives.sparq.exchange import RoundOutcome, SparqExchange
from gossipnet.errors import ConfigError
from gossipnet.mobility.gossip import plan_round as route_plan
from gossipnet.mobility.mixing import metropolis_weights
from gossipnet.reports import CollectiveReport
from gossipnet.training.host import TrainingHost

__all__ = ("SparqGossip",)

log = logging.getLogger(__name__)


class SparqGossip:
    """One peer's SPARQ rounds for a strategy's parameters.

    Args:
        host: the joined peer.
        params: the parameters gossiped (the model's, in the strategy's order).
        base: the user's optimizer (its first group's ``lr`` is the trigger's eta_t).
        settings: the :class:`SparQ` value.
        topology: ``"moshpit"`` or ``"route"``: where the neighbours come from.
        timeout_s: bound of one round's wait for the neighbours' ENDs (seconds).
        group_size: Moshpit's largest group (None: the averager's).
    """

    def __init__(
        self,
        host: TrainingHost,
        params: list[torch.Tensor],
        base: torch.optim.Optimizer,
        settings: SparQ,
        *,
        topology: str,
        timeout_s: float,
        group_size: int | None = None,
    ) -> None:
        if topology not in ("moshpit", "route"):
            raise ConfigError(f"SparQ runs with strategy 'moshpit' or 'route', not {topology!r}")
        self.host, self.params, self.base = host, params, base
        self.settings, self.topology = settings, topology
        self.timeout_s, self.group_size = timeout_s, group_size
        self.syncs = 0
        cfg = host.config
        transport = host.node.transport
        chunk = cfg.chunk_bytes or (transport.default_chunk_bytes if transport else 64 * 1024)
        x0 = self._flat()
        self.layout = Layout.for_payload(
            x0.numel(), settings.density, min(chunk, cfg.max_payload_bytes)
        )
        self._reported = 0  # bytes_sent already in a report

        async def make() -> SparqExchange:
            return SparqExchange(host.node, self.layout, settings, x0)

        self.exchange: SparqExchange = host.call(make())
        self._introduce(x0)

    def _introduce(self, x0: torch.Tensor) -> None:
        """Round -1 with every alive peer, weight 0: they get our estimate (an exact
        refresh of x0) and we get theirs before anyone moves.  Why before: a copy
        first made in round 0 could be refreshed from an estimate its sender already
        moved on, and so differ by timing; peers that build their optimizer later
        are refreshed on first contact instead."""
        ex, me = self.exchange, self.host.peer_id
        others = {p: 0.0 for p in self.host.alive_peers() if p != me}
        coro = ex.round(-1, x0, others, trigger=False, timeout_s=self.timeout_s)
        self.host.call(
            coro, self.timeout_s + self.settings.repair_wait_s + 60
        )  # bytes: in the first report

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    def _write(self, x: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(x[offset : offset + n].view_as(p))
                offset += n

    def average(self, rnd: int) -> CollectiveReport:
        """One SPARQ round numbered ``rnd`` (from the step count): trigger, send, mix."""
        t0 = time.monotonic()
        x = self._flat()
        lr = float(self.base.param_groups[0].get("lr", 0.0))
        threshold = self.settings.threshold(self.syncs, lr)
        self.syncs += 1
        host, ex = self.host, self.exchange

        async def go() -> tuple[dict[str, float], float, RoundOutcome]:
            weights, dense = await self._neighbours(rnd)
            moved = float((x - ex.own.vec).square().sum())
            out = await ex.round(
                rnd, x, weights, trigger=moved > threshold, timeout_s=self.timeout_s
            )
            return weights, dense, out

        weights, dense, out = host.call(go(), self.timeout_s + self.settings.repair_wait_s + 60)
        if out.mixed:
            x.add_(out.mix, alpha=self.settings.gamma)
            self._write(x)
        return self._report(rnd, weights, dense, out, time.monotonic() - t0)

    async def _neighbours(self, rnd: int) -> tuple[dict[str, float], float]:
        """This round's ``{peer: w_ij}`` (others only) and the bytes dense gossip of the
        same neighbourhood would send (loop thread)."""
        d = self.layout.numel
        if self.topology == "moshpit":
            return self._moshpit_neighbours(rnd, d)
        route = self.host.route
        if route is None or route.own is None:
            raise ConfigError("SparQ with strategy='route' needs this peer's route")
        await route.wait_for_routes(self.host.config.control_timeout_s)
        me = self.host.peer_id
        names = sorted({me, *route.routes})
        routes = [route.own if p == me else route.routes[p].route for p in names]
        sched = route_plan(
            routes, route.round_time(rnd), 4.0 * d, radio=route.radio, schedule=route.schedule
        )
        if not sched.phases:
            return {}, 0.0
        edges = np.concatenate([ph.edges for ph in sched.phases])
        row = metropolis_weights(len(names), edges)[names.index(me)]
        weights = {p: float(row[j]) for j, p in enumerate(names) if p != me and row[j] > 0}
        return weights, 4.0 * d * len(weights)  # the model to each partner

    def _moshpit_neighbours(self, rnd: int, d: int) -> tuple[dict[str, float], float]:
        averager = self.host.moshpit
        if averager is None:
            raise ConfigError("SparQ with strategy='moshpit' needs Moshpit averaging on this peer")
        cfg = averager.config
        if self.group_size is not None:
            cfg = dataclasses.replace(cfg, max_group_size=self.group_size)
        t0 = rnd * SWEEP_STRIDE
        view = averager.view(t0, cfg)
        grid = averager.grid_for(len(view), cfg)
        t = t0 + rnd % grid.dims  # a new axis each sync
        me = self.host.peer_id
        group = moshpit_plan(view, t, seed=self.host.config.run, grid=grid, start=t0).group_of(me)
        g = len(group)
        weights = {p: 1.0 / g for p in group if p != me}
        # dense Moshpit: the group all-reduce's reduce-scatter plus all-gather
        return weights, 2.0 * (g - 1) / g * 4.0 * d if g > 1 else 0.0

    def _report(
        self, rnd: int, weights: dict[str, float], dense: float, out: RoundOutcome, secs: float
    ) -> CollectiveReport:
        me = self.host.peer_id
        sent = self.exchange.bytes_sent - self._reported  # repairs between rounds too
        self._reported = self.exchange.bytes_sent
        peers = sorted(weights)
        extra = {
            "bytes_sent": float(sent),
            "bytes_dense": float(dense),
            "compression_ratio": dense / max(sent, 1) if dense else 1.0,
            "triggered": float(out.triggered),
            "delta_packets": float(out.delta_packets),
            "neighbours": float(len(peers)),
            "mixed": float(len(out.mixed)),
            "stale_neighbours": float(len(out.stale)),
            **out.counters,
        }
        return CollectiveReport(
            round=rnd,
            method="sparq",
            participants=(me, *peers),
            contributors=tuple(sorted({me, *out.heard})),
            missing=tuple(p for p in peers if p not in out.heard),
            elapsed_s=secs,
            timed_out=out.timed_out,
            extra=extra,
        )
