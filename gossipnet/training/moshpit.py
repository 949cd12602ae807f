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

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gossipnet.collectives.moshpit.averager import BEHIND_SWEEPS, SWEEP_STRIDE
from gossipnet.collectives.statesync.sync import (
    Snapshot,
    TransferReport,
    load_checkpoint,
    pack_state,
    save_atomic,
    unpack_state,
)
from gossipnet.errors import ConfigError
from gossipnet.reports import CollectiveReport
from gossipnet.training._local_step import scale_for_microbatches, state_tensors

if TYPE_CHECKING:
    from gossipnet.training.optimizer import GossipOptimizer

__all__ = ("MoshpitStrategy",)

log = logging.getLogger(__name__)


class MoshpitStrategy:
    """The moshpit strategy of one :class:`~gossipnet.training.optimizer.GossipOptimizer`.

    Args:
        opt: the wrapper (its peer, base optimizer, parameter groups, timeout).
        average_every: local steps between averagings (k).
        average_state: also average floating optimizer state shaped like the
            parameters (Adam's moments, momentum buffers).
        sync_state: download the current state from live peers on construction.
        group_size: largest Moshpit group (default: the averager's, 32).
        rounds: Moshpit rounds per averaging (None: the grid's d).
        checkpoint: path of an optional local checkpoint (loaded when no live peer
            has state, written atomically every ``checkpoint_every`` steps).
        checkpoint_every: steps between checkpoints (0: only on request).
        sync_timeout: bound of the initial state download in seconds.
        catch_up_sweeps: download the others' state instead of averaging when this
            many sweeps behind the most advanced peer (the others no longer plan us in).
    """

    def __init__(
        self,
        opt: GossipOptimizer,
        *,
        average_every: int = 1,
        average_state: bool = False,
        sync_state: bool = True,
        group_size: int | None = None,
        rounds: int | None = None,
        checkpoint: str | None = None,
        checkpoint_every: int = 0,
        sync_timeout: float = 30.0,
        catch_up_sweeps: int = BEHIND_SWEEPS,
    ) -> None:
        if average_every < 1 or checkpoint_every < 0 or (rounds is not None and rounds < 1):
            raise ConfigError("average_every >= 1, rounds >= 1 and checkpoint_every >= 0 required")
        self.opt = opt
        self.peer = opt.peer
        self.base = opt.base
        self.average_every = average_every
        self.average_state = average_state
        self.group_size = group_size
        self.rounds = rounds
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self.sync_timeout = sync_timeout
        self.catch_up_sweeps = catch_up_sweeps
        self.params = [p for group in opt.groups for p in group]
        self.last_sync: TransferReport | None = None
        # summed averaging weight of the local steps since the last average, and their count
        self._window_weight, self._window_steps = 0.0, 0
        if checkpoint is not None:
            data = load_checkpoint(checkpoint)
            if data is not None:
                self.load_bytes(data)
                log.info("peer %s: loaded checkpoint %s", self.peer.peer_id, checkpoint)
        self.publish()
        if sync_state:
            self.sync()

    # ------------------------------------------------------------------ training
    def step(
        self, closure: Callable[[], Any] | None = None, weight: float | None = None
    ) -> CollectiveReport:
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
        mb, closure = scale_for_microbatches(self.peer, self.params, closure, weight)
        self._window_weight += (mb.weight if mb is not None else 1.0) if weight is None else weight
        self._window_steps += 1
        self.base.step(closure)
        self.opt.step_count += 1
        me = self.peer.peer_id
        report = CollectiveReport(method="local", participants=(me,), contributors=(me,))
        if self.opt.step_count % self.average_every == 0:
            report = self._average_or_catch_up(self._window_weight / self._window_steps)
            self._window_weight, self._window_steps = 0.0, 0
        if mb is not None:
            report.extra.update(mb.as_extra())
        every = self.checkpoint_every
        if self.checkpoint and every and self.opt.step_count % every == 0:
            self.save_checkpoint()
        sync = self.peer._statesync
        if sync is not None and sync.wanted:  # a joiner is waiting for fresh state
            self.publish()
        self.opt.last_report = report
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
        sweep = self.opt.step_count // self.average_every
        averager = self.peer._moshpit
        if (
            averager is not None
            and averager.max_seen >= (sweep + self.catch_up_sweeps) * SWEEP_STRIDE
        ):
            rep = self.sync(force=True)
            me = self.peer.peer_id
            extra = {"caught_up": float(bool(rep and rep.ok))}
            return CollectiveReport(
                method="catch-up", participants=(me,), contributors=(me,), extra=extra
            )
        return self.average(weight, start_round=sweep * SWEEP_STRIDE)

    def average(self, weight: float = 1.0, start_round: int | None = None) -> CollectiveReport:
        """Average parameters (and optionally optimizer state) now."""
        tensors = [p.detach() for p in self.params]
        if self.average_state:
            tensors += state_tensors(self.base, self.params)
        return self.peer.average(
            tensors,
            method="moshpit",
            rounds=self.rounds,
            weight=weight,
            timeout=self.opt.timeout,
            group_size=self.group_size,
            start_round=start_round,
        )

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> bytes:
        return pack_state(
            {
                "params": [p.detach().cpu() for p in self.params],
                "optim": self.base.state_dict(),
                "step": self.opt.step_count,
            }
        )

    def load_bytes(self, data: bytes) -> None:
        """Adopt a state made by :meth:`state_bytes` (same model and optimizer)."""
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
        self.opt.step_count = int(state["step"])

    def publish(self) -> None:
        """Serve the current state to joiners (hashed here, not on the loop thread)."""
        sync = self.peer._statesync
        if sync is None:
            return
        snap = Snapshot.of(self.state_bytes(), sync.chunk_bytes, {"step": self.opt.step_count}, 0.0)

        async def install() -> None:
            sync.install(_stamped(snap, sync.node.clock.now()))

        self.peer._call(install())

    def save_checkpoint(self) -> None:
        if self.checkpoint is None:
            raise ConfigError("no checkpoint path was given")
        save_atomic(self.checkpoint, self.state_bytes())

    def sync(self, force: bool = False) -> TransferReport | None:
        """Download the state of a live peer if there is one to follow (see module doc);
        ``force``: from whoever is training (we fell behind)."""
        sync, averager = self.peer._statesync, self.peer._moshpit
        if sync is None or averager is None:
            return None
        others, progress = self.peer._call(_beacons(self.peer))
        if not others:
            return None
        me = self.peer.peer_id
        if progress > 0 or force:
            sources, max_age = None, 0.0  # training under way: state from after we asked
        elif min(others) < me:
            sources, max_age = [min(others)], None  # fresh cluster: the first peer's state
        else:
            return None
        coro = sync.download(sources=sources, timeout_s=self.sync_timeout, max_age_s=max_age)
        data, rep = self.peer._call(coro, self.sync_timeout + 30)
        self.last_sync = rep
        if data is None:
            log.warning("peer %s: no state downloaded (%s); starting from our own", me, rep)
            return rep
        self.load_bytes(data)
        self.publish()
        log.info(
            "peer %s: state from %s (%d bytes, step %d, %d chunks resumed) in %.2f s",
            me,
            rep.source,
            rep.nbytes,
            self.opt.step_count,
            rep.chunks_resumed,
            rep.elapsed_s,
        )
        return rep

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.opt.step_count, "base": self.base.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.step_count = int(state["step_count"])
        self.base.load_state_dict(state["base"])


def _stamped(snap: Snapshot, now: float) -> Snapshot:
    return dataclasses.replace(snap, created=now)


async def _beacons(peer: Any) -> tuple[list[str], int]:
    """(alive others, highest Moshpit round they announced), after waiting up to two
    heartbeat intervals for every alive peer's beacon (on the node's clock)."""
    node, averager = peer._node, peer._moshpit
    deadline = node.clock.now() + 2 * node.config.heartbeat_interval_s
    while True:
        others = [p for p in node.alive_peers() if p != node.peer_id]
        if all(p in averager.beacons for p in others) or node.clock.now() >= deadline:
            progress = max([averager.beacons.get(p, 0) for p in others] + [averager.max_seen])
            return others, progress
        await node.clock.sleep(node.config.heartbeat_interval_s / 4)
