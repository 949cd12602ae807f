"""``net.optimizer(base, strategy="moshpit")``: local steps, then Moshpit averaging.

Moshpit SGD (Ryabinin et al. 2021, Algorithm 2): every peer steps its own
optimizer on its own batches, and every ``average_every`` steps the peers
average their parameters (and, with ``average_state``, the optimizer's
per-parameter statistics, as hivemind's ``average_opt_statistics``) in
Moshpit rounds.  Why not average gradients every step as the all-reduce
strategy does: on preemptible, lossy networks a failure should delay one
group for one round, not hold a global barrier every step.

Joining is part of the strategy, because a restarted peer is just a peer
constructed again:

- every peer publishes its state at once (and again whenever a joiner asks,
  from the training thread, between steps: the loop thread never reads
  tensors the trainer is writing);
- if the others are already training (their heartbeats announce a Moshpit
  round > 0), the new peer downloads the current parameters, optimizer state
  and step count from a live peer (:mod:`.averaging.statesync`) and carries
  on from there, its step count aligned with theirs so that everybody
  averages at the same steps;
- in a fresh cluster, everyone adopts the state of the peer first in id
  order, so all replicas start identical even without a shared seed;
- an optional local checkpoint, written atomically, is loaded when nobody
  else has state (the whole job restarted, e.g. ``torchrun`` restarting all
  workers of a node).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch

from gossipnet.collectives.moshpit.averager import SWEEP_STRIDE
from gossipnet.collectives.statesync.sync import (
    TransferReport,
    load_checkpoint,
    pack_state,
    save_atomic,
    unpack_state,
)
from gossipnet.errors import ConfigError
from gossipnet.reports import CollectiveReport
from gossipnet.training import _snapshot
from gossipnet.training._local_step import scale_for_microbatches, state_tensors
from gossipnet.training.host import TrainingHost
from gossipnet.training.options import MoshpitOptions
from gossipnet.training.replicas import ReplicaCheck
from gossipnet.training.sparq import SparqGossip
from gossipnet.training.strategy import adopt_groups

__all__ = ("MoshpitStrategy",)

log = logging.getLogger(__name__)


class MoshpitStrategy:
    """Local steps with ``base``, Moshpit averaging every ``average_every`` steps.

    Args:
        host: the joined peer.
        base: the user's optimizer; it steps on this peer's own gradients.
        options: the averaging period, groups, state download and checkpoint.

    Construction publishes this peer's state, then (``sync_state``) downloads the
    current state from a live peer if there is one to follow (see the module doc).

    Raises:
        ValueError: no parameter of ``base`` requires grad.
    """

    name = "moshpit"

    def __init__(
        self, host: TrainingHost, base: torch.optim.Optimizer, options: MoshpitOptions
    ) -> None:
        groups, _ = adopt_groups(base)
        self.host = host
        self.base = base
        self.options = options
        self.timeout_s = (
            host.config.collective_timeout_s if options.timeout_s is None else options.timeout_s
        )
        self.params = [p for group in groups for p in group]
        self.step_count = 0
        self.last_report: CollectiveReport | None = None
        self.last_resync: CollectiveReport | None = None  # Moshpit peers never resync
        self.last_replica_check: ReplicaCheck | None = None  # nor compare digests
        self.last_sync: TransferReport | None = None
        #: downloaded states refused, by reason (``_snapshot.check_state``)
        self.state_rejected: collections.Counter[str] = collections.Counter()
        # summed averaging weight of the local steps since the last average, and their count
        self._window_weight, self._window_steps = 0.0, 0
        if options.checkpoint_path is not None:
            data = load_checkpoint(options.checkpoint_path)
            if data is not None:
                self.load_bytes(data)
                log.info("peer %s: loaded checkpoint %s", host.peer_id, options.checkpoint_path)
        self.publish()
        if options.sync_state:
            self.sync()
        #: SPARQ-SGD in the groups instead of the dense all-reduce (``compress=SparQ``)
        self.sparq: SparqGossip | None = None
        if options.compress is not None:
            self.sparq = SparqGossip(
                host, self.params, base, options.compress, topology="moshpit",
                timeout_s=self.timeout_s, group_size=options.group_size,
            )  # fmt: skip

    # ------------------------------------------------------------------ training
    def step(self, closure: Callable[[], Any] | None, weight: float | None) -> CollectiveReport:
        """A local optimizer step; every ``average_every`` steps, Moshpit averaging.

        After a ``net.microbatches`` loop (and ``weight=None``) the summed gradient
        is scaled as the all-reduce strategy scales it (1 / micro-batches done, or
        1 / K with ``normalise="full"``), and the parameter average weights this
        peer by its all-reduce weight (micro-batches done, or 1) averaged over the
        local steps since the last averaging (so plain steps keep weight 1).
        Why: with ``average_every=1`` and plain SGD, the weighted mean of
        x - lr * sum_n / c_n is exactly x - lr * (sum of all gradients) /
        (micro-batches done everywhere), the all-reduce strategy's step; a peer
        that did nothing has weight 0 and still receives the average.  An
        explicit ``weight`` leaves gradients as they are and is the averaging
        weight.
        """
        opts = self.options
        mb, closure = scale_for_microbatches(self.host, self.params, closure, weight)
        self._window_weight += (mb.weight if mb is not None else 1.0) if weight is None else weight
        self._window_steps += 1
        self.base.step(closure)
        self.step_count += 1
        me = self.host.peer_id
        report = CollectiveReport(method="local", participants=(me,), contributors=(me,))
        if self.step_count % opts.average_every == 0:
            report = self._average_or_catch_up(self._window_weight / self._window_steps)
            self._window_weight, self._window_steps = 0.0, 0
        if mb is not None:
            report.extra.update(mb.as_extra())
        every = opts.checkpoint_every_steps
        if opts.checkpoint_path and every and self.step_count % every == 0:
            self.save_checkpoint()
        sync = self.host.statesync
        if sync is not None and sync.wanted:  # a joiner is waiting for fresh state
            self.publish()
        self.last_report = report
        return report

    def _average_or_catch_up(self, weight: float) -> CollectiveReport:
        """Average this step's sweep; or, far behind the others, copy their state.

        The sweep comes from the step count (the same on every peer at the same
        step), not from counting calls: a peer that stalled then rejoins the
        very sweep its partners are in, and peers never drift apart in round
        numbers.  A peer ``catch_up_sweeps`` behind the most advanced one (it
        stalled longer than a matchmaking window, so nobody waited) would only
        average alone: it downloads the current state instead, step count
        included, as a restarted peer does.
        """
        sweep = self.step_count // self.options.average_every
        averager = self.host.moshpit
        if (
            averager is not None
            and averager.max_seen >= (sweep + self.options.catch_up_sweeps) * SWEEP_STRIDE
        ):
            rep = self.sync(force=True)
            me = self.host.peer_id
            extra = {"caught_up": float(bool(rep and rep.ok))}
            return CollectiveReport(
                method="catch-up", participants=(me,), contributors=(me,), extra=extra
            )
        return self.average(weight, start_round=sweep * SWEEP_STRIDE)

    def resync(self) -> CollectiveReport:
        """Average now, outside the schedule (weight 1, the next sweep)."""
        return self.average()

    def average(self, weight: float = 1.0, start_round: int | None = None) -> CollectiveReport:
        """Average parameters (and optionally optimizer state) now; with SparQ, one
        SPARQ round (``weight`` does not apply: W is uniform in the group)."""
        if self.sparq is not None:
            at = self.step_count // self.options.average_every
            return self.sparq.average(at if start_round is None else start_round // SWEEP_STRIDE)
        tensors = [p.detach() for p in self.params]
        if self.options.average_state:
            tensors += state_tensors(self.base, self.params)
        return self.host.moshpit_average(
            tensors,
            rounds=self.options.rounds,
            weight=weight,
            timeout_s=self.timeout_s,
            group_size=self.options.group_size,
            start_round=start_round,
        )

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> bytes:
        """Parameters, optimizer state and step count, packed (what joiners download)."""
        return pack_state(
            {
                "params": [p.detach().cpu() for p in self.params],
                "optim": self.base.state_dict(),
                "step": self.step_count,
            }
        )

    def load_bytes(self, data: bytes) -> None:
        """Adopt a state made by :meth:`state_bytes` (same model and optimizer).

        Raises:
            ConfigError: the state's parameter shapes are not this model's.
        """
        state = unpack_state(data)
        params = state["params"]
        if len(params) != len(self.params) or any(
            a.shape != b.shape for a, b in zip(params, self.params, strict=True)
        ):
            raise ConfigError("downloaded state does not fit this model (shapes differ)")
        with torch.no_grad():
            for mine, theirs in zip(self.params, params, strict=True):
                mine.copy_(theirs)
        self.base.load_state_dict(state["optim"])
        self.step_count = int(state["step"])

    def publish(self) -> None:
        """Serve the current state to joiners (hashed here, not on the loop thread)."""
        _snapshot.publish(self.host, self.state_bytes, self.step_count)

    def save_checkpoint(self) -> None:
        """Write the state to ``checkpoint_path`` atomically.

        Raises:
            ConfigError: no checkpoint path was given.
        """
        if self.options.checkpoint_path is None:
            raise ConfigError("no checkpoint path was given")
        save_atomic(self.options.checkpoint_path, self.state_bytes())

    def sync(self, force: bool = False) -> TransferReport | None:
        """Download the state of a live peer if there is one to follow (see module doc);
        ``force``: from whoever is training (we fell behind)."""
        host = self.host
        sync, averager = host.statesync, host.moshpit
        if sync is None or averager is None:
            return None
        others, progress = host.call(_beacons(host))
        if not others:
            return None
        me = host.peer_id
        if progress > 0 or force:
            sources, max_age = None, 0.0  # training under way: state from after we asked
        elif min(others) < me:
            sources, max_age = [min(others)], None  # fresh cluster: the first peer's state
        else:
            return None
        timeout_s = self.options.sync_timeout_s
        bound = _snapshot.state_bound(self.params, self.base)
        coro = sync.download(
            sources=sources, timeout_s=timeout_s, max_age_s=max_age, max_bytes=bound
        )
        data, rep = host.call(coro, timeout_s + 30)
        self.last_sync = rep
        if data is None:
            log.warning("peer %s: no state downloaded (%s); starting from our own", me, rep)
            return rep
        checked, why = _snapshot.check_state(data, self.params, self.base)
        if checked is None:  # never raised out of step() for what a peer sent
            self.state_rejected[why] += 1
            log.warning(
                "peer %s: the state from %s does not fit this model (%s); keeping our own",
                me, rep.source, why,
            )  # fmt: skip
            return rep
        _snapshot.adopt_state(checked, self.params, self.base)  # never its hyperparameters
        self.step_count = int(checked["step"])
        self.publish()
        log.info(
            "peer %s: state from %s (%d bytes, step %d, %d chunks resumed) in %.2f s",
            me,
            rep.source,
            rep.nbytes,
            self.step_count,
            rep.chunks_resumed,
            rep.elapsed_s,
        )
        return rep

    def state_dict(self) -> dict[str, Any]:
        """Step count and the base optimizer's state (parameters are the model's)."""
        return {"step_count": self.step_count, "base": self.base.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.step_count = int(state["step_count"])
        self.base.load_state_dict(state["base"])


async def _beacons(host: TrainingHost) -> tuple[list[str], int]:
    """(alive others, highest Moshpit round they announced), after waiting up to two
    heartbeat intervals for every alive peer's beacon (on the node's clock)."""
    node, averager = host.node, host.moshpit
    assert averager is not None  # checked by the caller
    deadline = node.clock.now() + 2 * node.config.heartbeat_interval_s
    while True:
        others = [p for p in node.alive_peers() if p != node.peer_id]
        if all(p in averager.beacons for p in others) or node.clock.now() >= deadline:
            progress = max([averager.beacons.get(p, 0) for p in others] + [averager.max_seen])
            return others, progress
        await node.clock.sleep(node.config.heartbeat_interval_s / 4)
