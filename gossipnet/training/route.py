"""``strategy="route"`` / ``method="route"``: local steps, then route-aware gossip.

Decentralised SGD as in RoADTrain (reconstructed, ALGORITHMS.md section 4): every peer
steps its own optimizer on its own batches, and every ``average_every`` steps it
gossips its parameters with the neighbours that the shared routes say it can reach
(:mod:`gossipnet.collectives.route.averager`).  Why not all-reduce: vehicles are rarely all in
range of each other; a gossip step needs only the links that exist this round.

The round number comes from the step count (``step // average_every``), the same on
every peer at the same step, so peers that stalled rejoin the right round and the
plan (a function of the round's route time) is the same everywhere.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gossipnet.collectives.chunks import all_finite
from gossipnet.collectives.statesync.sync import TransferReport
from gossipnet.errors import ConfigError
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.cputime import loop_cpu, stamp_cpu
from gossipnet.training._local_step import scale_for_microbatches, state_tensors
from gossipnet.training.host import TrainingHost
from gossipnet.training.options import RouteOptions
from gossipnet.training.replicas import ReplicaCheck
from gossipnet.training.sparq import SparqGossip
from gossipnet.training.strategy import adopt_groups

__all__ = ("RouteStrategy", "route_average")

log = logging.getLogger(__name__)


def route_average(
    host: TrainingHost,
    tensors: Sequence[torch.Tensor],
    *,
    rounds: int | None = None,
    timeout: float | None = None,
    start_round: int | None = None,
) -> CollectiveReport:
    """``peer.average(tensors, method="route")``: see :meth:`gossipnet.Peer.average`.

    The tensors travel as one float32 vector (route gossip's wire format) and are
    written back in their own dtypes.  Non-finite local values are not sent: this
    peer sits the round out (its partners' exchanges with it fail, so both keep
    their values) and the report's ``extra["nonfinite_local"]`` is 1.
    """
    averager = host.route
    if averager is None:
        raise ConfigError("route averaging is not running on this peer")
    if not tensors:
        raise ValueError("average needs at least one tensor")
    if rounds is not None and rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    cpu0 = time.thread_time()  # the caller's share: flatten, join, copy back
    flat = host.flat_for(tensors)
    buckets = flat.flatten(tensors)
    me = host.peer_id
    if not all(all_finite(b) for b in buckets):
        log.warning("peer %s: non-finite values to average; sitting this round out", me)
        skipped = 0 if start_round is None else start_round
        return CollectiveReport(
            round=skipped,
            method="route",
            participants=(me,),
            contributors=(me,),
            extra={"nonfinite_local": 1.0},
        )
    joined = torch.cat([b.detach().reshape(-1).to("cpu", torch.float32) for b in buckets])
    share_wait = host.config.control_timeout_s if timeout is None else timeout
    reports = []
    loop_s = 0.0
    for i in range(rounds or 1):
        rnd = None if start_round is None else start_round + i
        coro = loop_cpu(
            functools.partial(averager.average, joined, rnd=rnd, share_wait_s=share_wait)
        )
        report, cpu_s = host.call(coro, averager.bound_s(share_wait) + 30)
        reports.append(report)
        loop_s += cpu_s
    offset = 0
    for b in buckets:
        n = b.numel()
        b.copy_(joined[offset : offset + n].view_as(b))
        offset += n
    flat.unflatten_into(tensors)
    return stamp_cpu(_merge(reports), loop_s, time.thread_time() - cpu0)


def _merge(reports: list[CollectiveReport]) -> CollectiveReport:
    """One report for several rounds: counts summed, peers united, the last round's extras."""
    if len(reports) == 1:
        return reports[0]
    out = CollectiveReport(round=reports[0].round, method="route", extra=dict(reports[-1].extra))
    for r in reports:
        out.participants = tuple(sorted({*out.participants, *r.participants}))
        out.contributors = tuple(sorted({*out.contributors, *r.contributors}))
        out.packets_sent += r.packets_sent
        out.packets_received += r.packets_received
        out.packets_lost += r.packets_lost
        out.chunks_total += r.chunks_total
        out.chunks_stale += r.chunks_stale
        out.elapsed_s += r.elapsed_s
        out.timed_out |= r.timed_out
    out.missing = tuple(sorted(set(out.participants) - set(out.contributors)))
    expected = out.packets_received + out.packets_lost
    out.delivered_fraction = out.packets_received / expected if expected else 1.0
    out.extra["rounds"] = float(len(reports))
    return out


class RouteStrategy:
    """Local steps with ``base``, route-aware gossip every ``average_every`` steps.

    Args:
        host: the joined peer, its route already announced.
        base: the user's optimizer; it steps on this peer's own gradients.
        options: the gossip period, rounds per averaging, and whether the optimizer
            state is gossiped too.

    Start every peer from the same initial parameters (same seed) for the usual
    decentralised-SGD behaviour; different starts are pulled together by gossip, at
    the pace the links allow.

    Raises:
        ValueError: no parameter of ``base`` requires grad.
        ConfigError: this peer has no route yet (``join(..., route=...)`` or
            ``net.set_route``).
    """

    name = "route"

    def __init__(
        self, host: TrainingHost, base: torch.optim.Optimizer, options: RouteOptions
    ) -> None:
        groups, _ = adopt_groups(base)
        if host.route is None or host.route.own is None:
            raise ConfigError(
                "strategy='route' needs this peer's route: join(..., route=...) or "
                "net.set_route(route) before net.optimizer(...)"
            )
        self.host = host
        self.base = base
        self.options = options
        self.params = [p for group in groups for p in group]
        self.step_count = 0
        self.last_report: CollectiveReport | None = None
        self.last_resync: CollectiveReport | None = None  # route peers never resync
        self.last_sync: TransferReport | None = None  # nor download state
        self.last_replica_check: ReplicaCheck | None = None  # nor compare digests
        #: SPARQ-SGD on the plan's links instead of dense gossip (``compress=SparQ``)
        self.sparq: SparqGossip | None = None
        if options.compress is not None:
            timeout_s = host.config.collective_timeout_s
            self.sparq = SparqGossip(
                host, self.params, base, options.compress, topology="route", timeout_s=timeout_s
            )

    def step(self, closure: Callable[[], Any] | None, weight: float | None) -> CollectiveReport:
        """A local step; every ``average_every`` steps, a route-aware gossip round.

        After a ``net.microbatches`` loop (and ``weight=None``) the summed gradient
        is scaled as the all-reduce strategy scales it (1 / micro-batches done, or
        1 / K with ``normalise="full"``), so a step is a mean gradient step however
        many micro-batches the cut-off let through.  ``weight`` is otherwise
        ignored: Metropolis-Hastings weights come from the plan's degrees, the same
        at both ends of a link, which is what keeps the mean; weighting peers by
        work done would need push-sum instead.
        """
        mb, closure = scale_for_microbatches(self.host, self.params, closure, weight)
        self.base.step(closure)
        self.step_count += 1
        me = self.host.peer_id
        report = CollectiveReport(method="local", participants=(me,), contributors=(me,))
        every = self.options.average_every
        if self.step_count % every == 0:
            sweep = self.step_count // every - 1
            report = self.average(start_round=sweep * self.options.rounds)
        if mb is not None:
            report.extra.update(mb.as_extra())
        self.last_report = report
        return report

    def resync(self) -> CollectiveReport:
        """Gossip now, outside the schedule (the next round)."""
        return self.average()

    def average(self, start_round: int | None = None) -> CollectiveReport:
        """Gossip the parameters (and optionally the optimizer state) now; with SparQ,
        one SPARQ round."""
        if self.sparq is not None:
            at = self.step_count // self.options.average_every
            return self.sparq.average(at if start_round is None else start_round)
        tensors = [p.detach() for p in self.params]
        if self.options.average_state:
            tensors += state_tensors(self.base, self.params)
        rounds = self.options.rounds
        return route_average(self.host, tensors, rounds=rounds, start_round=start_round)

    def state_dict(self) -> dict[str, Any]:
        """Step count and the base optimizer's state (parameters are the model's)."""
        return {"step_count": self.step_count, "base": self.base.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.step_count = int(state["step_count"])
        self.base.load_state_dict(state["base"])
