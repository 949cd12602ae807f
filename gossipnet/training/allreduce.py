"""``strategy="allreduce"``: sharded steps and bounded-drift broadcasts.

On ``step()`` the gradients are reduce-scattered over the lossy transport;
each peer steps the base optimizer only for the shard it owns (its optimizer
state is sharded too: :mod:`gossipnet.training._shards`) and broadcasts that
shard's new parameters.  A peer that misses a broadcast packet keeps its own
parameters for that chunk: never zeros, so the drift between replicas stays
bounded (Weintraub et al. 2025).  By default (``Config.stale_step``) it also
moves them by an estimate of the step it missed
(:mod:`gossipnet.collectives.lossy.stale_step`), still overwritten by the next
broadcast that arrives.  While loss is seen its rounds send XOR parity packets
(``Config.parity_for``): one per group of 4 to 7 packets rebuilds one lost
packet of the group, so at 10% loss about 4-5% of chunks stay lost instead of
10%, for at most a quarter more traffic.  Every ``resync_every_steps`` steps a
resync round averages the parameters and repairs every lost chunk, so replicas
become identical again; step 0 is a resync, which makes peers that started
from different seeds consistent.

With ``compress=`` both phases are compressed: the contributions, and the
broadcast, which then carries each owner's parameter *update* (from the values
every replica holds, at the compressor's blocks, in its value codec) that every
replica adds; what it leaves out waits in the owner's residual
(:mod:`gossipnet.training._residual`).  A lost update is not estimated (no later
broadcast would overwrite the estimate): the replica keeps its values until the
next resync, the loss rule of ``all_reduce(..., step=opt)``.

Rounds are identified by the training step
(:mod:`gossipnet.collectives.lossy.round_id`): every peer at step s runs the
same round ids, however many calls it made before.  After every resync each
peer announces a digest of its parameters; a peer whose digest the others
outvote, or whose round showed it behind or ahead of the others (a stall past
the failure timeout, a restart, a call more or fewer), takes the step count and
parameters that a quorum of the peers it saw take part vouch for, never one
peer's word (:mod:`gossipnet.training._realign`).  The report's ``extra`` says
so: ``realigned``, ``replica_repaired``, ``replicas_disagree``, ``state_rejected``;
``net.replicas_agree()`` gives the verdict.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gossipnet.collectives.chunks import all_finite
from gossipnet.collectives.compress import CompressSession
from gossipnet.collectives.lossy.engine import LossyAllReduce, OwnedShard
from gossipnet.collectives.lossy.options import RoundOptions
from gossipnet.collectives.lossy.round_id import (
    EXPLICIT_RESYNC,
    GRADIENTS,
    SCHEDULED_RESYNC,
    Alignment,
    optimizer_round,
)
from gossipnet.collectives.lossy.stale_step import StaleStep
from gossipnet.collectives.statesync.sync import TransferReport
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.cputime import loop_cpu, stamp_cpu
from gossipnet.runtime.flatbuffer import FlatBuffer
from gossipnet.training._realign import Realigner
from gossipnet.training._residual import Residual
from gossipnet.training._shards import ShardedOptimizer
from gossipnet.training._stepping import as_optimizer_step
from gossipnet.training.host import TrainingHost
from gossipnet.training.options import AllReduceOptions
from gossipnet.training.replicas import ReplicaCheck, digest
from gossipnet.training.strategy import adopt_groups

__all__ = ("AllReduceStrategy",)

log = logging.getLogger(__name__)

MODE_GRADS = 0
MODE_RESYNC = 1


class AllReduceStrategy:
    """The sharded all-reduce: see the module doc.

    Args:
        host: the joined peer.
        base: the user's optimizer; its class, defaults and param groups are used;
            it never steps itself.
        options: resync period and round timeout.

    The parameters are re-bound to views of flat buckets (``FlatBuffer.adopt``):
    create it after moving the model to its device.

    Raises:
        ValueError: no parameter of ``base`` requires grad.
    """

    name = "allreduce"

    def __init__(
        self, host: TrainingHost, base: torch.optim.Optimizer, options: AllReduceOptions
    ) -> None:
        cfg = host.config
        self.host = host
        self.base = base
        self.options = options
        self.resync_every = (
            cfg.resync_every_steps
            if options.resync_every_steps is None
            else options.resync_every_steps
        )
        self.timeout_s = (
            cfg.collective_timeout_s if options.timeout_s is None else options.timeout_s
        )
        # lost parameter broadcasts take an estimated step (Config.stale_step)
        self._stale_step = StaleStep() if cfg.stale_step else None
        # the gradients' compressor and its error feedback (one layout: our buckets)
        self.compress = CompressSession(options.compress) if options.compress is not None else None
        self.groups, self.param_flats = adopt_groups(base)
        self.grad_flats = [
            FlatBuffer([torch.zeros_like(p) for p in ps]) if ps else None for ps in self.groups
        ]
        if self.compress is not None:  # Accordion decides per tensor of each bucket
            self.compress.set_segments(
                [st for flat in self.grad_flats if flat is not None for st in flat.segments()]
            )
        bucket_group: list[int] = []
        for g, flat in enumerate(self.param_flats):
            if flat is not None:
                bucket_group.extend([g] * len(flat.buckets))
        self.shards = ShardedOptimizer(base, bucket_group)
        self._staging: list[torch.Tensor] | None = None  # CPU copies of device buckets
        # compressed: each owner's parameter updates not yet in the replicas (._residual)
        self.residual = Residual() if self.compress is not None else None
        self.step_count = 0
        self.last_report: CollectiveReport | None = None
        self.last_resync: CollectiveReport | None = None
        self._last_align: Alignment | None = None
        # added to every round id: moved past the ids already run when a checkpoint is
        # loaded (load_state_dict) or, at its first step, when this optimizer replaces an
        # earlier one of the peer, so no step ever reuses a round id; peers that replace
        # theirs at the same point of the program have run the same rounds: they agree
        self._round_base = 0
        self._based = False  # the round base is settled (first step, resync or load)
        # held while a step or resync changes the parameters or the optimizer state, so
        # that a peer asking for our state between steps (or after the last) gets a
        # consistent snapshot without waiting for our next step (Realigner.serve_idle)
        self.state_lock = threading.Lock()
        self.realign = Realigner(host, self, sync_timeout_s=max(10.0, 3 * self.timeout_s))
        if host.statesync is not None:
            host.statesync.on_wanted = self.realign.serve_idle

    @property
    def last_sync(self) -> TransferReport | None:
        """The last state download (realignment or replica repair), its report."""
        return self.realign.last_sync

    @property
    def last_replica_check(self) -> ReplicaCheck | None:
        """The last replica-digest verdict acted on."""
        return self.realign.last_replica_check

    # ------------------------------------------------------------------ training thread
    def step(self, closure: Callable[[], Any] | None, weight: float | None) -> CollectiveReport:
        """Average gradients, step the owned shard, broadcast parameters.

        ``weight`` None: after a ``net.microbatches`` loop the summed gradient is
        divided by the micro-batches it completed and weighted by that count (or by
        K and 1 with ``normalise="full"``); without such a loop, weight 1.
        Non-finite gradients are sent as zeros with weight 0.
        """
        self._settle_base()
        # the base's step as its step hooks and LR schedulers see it (it never steps
        # itself): pre-hooks before the gradients are read, post-hooks once the new
        # parameters are in place, before any realignment replaces them
        report = as_optimizer_step(self.base, lambda: self._step(closure, weight))
        self.realign.after_step(report, self._last_align)
        self.last_report = report
        return report

    def _step(self, closure: Callable[[], Any] | None, weight: float | None) -> CollectiveReport:
        """The step itself: gradients out, this step's rounds, parameters back."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        cpu0 = time.thread_time()  # the caller's share: flatten, stage, write back
        grads = self._gradients()
        mb = self.host.take_microbatch_report()  # the last net.microbatches loop, once
        if weight is None:
            scale, weight = (mb.grad_scale, mb.weight) if mb is not None else (1.0, 1.0)
            for g in grads if scale != 1.0 else ():
                g.mul_(scale)
        if not all(all_finite(g) for g in grads):
            log.warning(
                "peer %s: non-finite gradients at step %d; contributing weight 0",
                self.host.peer_id,
                self.step_count,
            )
            for g in grads:
                torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
            weight = 0.0
        params = self.param_buckets()
        staged = self._stage(params)
        gstaged = [g.cpu() for g in grads]
        with self.state_lock:
            coro = loop_cpu(
                functools.partial(self._round, gstaged, staged, weight, self.step_count)
            )
            report, loop_s = self.host.call(coro, self.timeout_s * 3 + 30)
            _write_back(params, staged)
            self.step_count += 1
        stamp_cpu(report, loop_s, time.thread_time() - cpu0)
        if mb is not None:
            report.extra.update(mb.as_extra())
        return report

    def _gradients(self) -> list[torch.Tensor]:
        """The gradients in flat buckets (zeros for parameters without one)."""
        grads: list[torch.Tensor] = []
        for ps, flat in zip(self.groups, self.grad_flats, strict=True):
            if flat is not None:
                grads.extend(
                    flat.flatten(
                        [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
                    )
                )
        return grads

    def _settle_base(self) -> None:
        """At first use, start after the rounds this peer's engine already ran."""
        if not self._based:
            fresh = self._engine().next_round - optimizer_round(self.step_count, EXPLICIT_RESYNC)
            self._round_base = max(self._round_base, fresh)
            self._based = True

    def resync(self) -> CollectiveReport:
        """Average parameters now and repair every lost chunk (replicas become equal)."""
        self._settle_base()
        held = self.realign.resynced
        if held is not None and held[:2] == (self.step_count, self._engine().next_round):
            return held[2]  # we took the others' parameters after this step's resync
        rid = max(self._rid(self.step_count, EXPLICIT_RESYNC), self._engine().next_round)
        if rid >= self._rid(self.step_count, GRADIENTS) and self.last_resync is not None:
            return self.last_resync  # two resyncs already since the last step: nothing changed
        with self.state_lock:
            cpu0 = time.thread_time()
            params = self.param_buckets()
            staged = self._stage(params)
            coro = loop_cpu(functools.partial(self._resync, staged, rid))
            report, loop_s = self.host.call(coro, self.timeout_s * 2 + 30)
            _write_back(params, staged)
        return stamp_cpu(report, loop_s, time.thread_time() - cpu0)

    def _stage(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The CPU buckets a round runs on: a CPU bucket itself, a device bucket's
        copy in a CPU buffer kept across steps (refreshed here).

        Why kept: the shard optimizer steps views of these buffers
        (``._shards``), built once per shard map; a fresh copy per step would
        leave it stepping the first step's memory, blind to what a resync, a
        realignment or (compressed) the residual did to the parameters since.
        """
        if self._staging is None or len(self._staging) != len(params):
            self._staging = [b if b.device.type == "cpu" else b.cpu() for b in params]
            return self._staging
        for b, s in zip(params, self._staging, strict=True):
            if s is not b:
                s.copy_(b)
        return self._staging

    def param_buckets(self) -> list[torch.Tensor]:
        """The flat parameter buckets, every group's, in order."""
        out: list[torch.Tensor] = []
        for flat in self.param_flats:
            if flat is not None:
                out.extend(flat.buckets)
        return out

    # ------------------------------------------------------------------ loop side
    def _engine(self) -> LossyAllReduce:
        return self.host.optimizer_engine

    async def _resync(self, params: list[torch.Tensor], round_id: int) -> CollectiveReport:
        """Average the parameters with repair, then announce their digest.

        Compressed: the owners' masters stay where their optimizers put them, so
        what the averaging moved an owned shard by joins its residual (``._residual``).
        """
        before = self.residual.snapshot(params) if self.residual is not None else None
        report = await self._engine().run(
            [p.clone() for p in params],
            RoundOptions(
                dst=params,
                timeout_s=self.timeout_s,
                mode=MODE_RESYNC,
                repair=True,
                round_id=round_id,
            ),
        )
        report.method = "resync"
        if self.residual is not None and before is not None:
            self.residual.absorb(before, params)
        self.last_resync = report
        value = await asyncio.to_thread(digest, params)  # hashlib releases the GIL
        replicas = self.host.replicas
        if replicas is not None:  # only the peers heard in this resync vote on it
            replicas.publish(round_id, value, self._engine().alignment().in_sync)
        self.realign.digest_rid = round_id
        return report

    async def _round(
        self, grads: list[torch.Tensor], params: list[torch.Tensor], weight: float, step: int
    ) -> CollectiveReport:
        """Step ``step``: its scheduled resync (if due), then its gradient round.

        Both round ids come from ``step``, so peers pair by step.  A resync that
        shows us out of step skips the gradient round: its result would be wrong,
        and the realignment after it replaces our state anyway.
        """
        engine = self._engine()
        rid = self._rid(step, SCHEDULED_RESYNC)
        due = step == 0 or (self.resync_every and step % self.resync_every == 0)
        if due and rid >= engine.next_round:  # else an explicit resync just ran
            resync, loop_s = await loop_cpu(functools.partial(self._resync, params, rid))
            # an explicit resync() right after may return it; the caller's share is the step's
            stamp_cpu(resync, loop_s, 0.0)
            align = self.realign.judge(engine.alignment())  # verified participants only
            if align.we_are_behind or align.we_are_ahead:
                self._last_align = align
                resync.extra["skipped_gradients"] = 1.0
                return resync

        residual = self.residual

        def on_reduced(shards: list[OwnedShard]) -> list[torch.Tensor]:
            if residual is None:
                return self.shards.step(shards, params, self.compress)
            # compressed: step the masters (replica + residual); broadcast their update
            keys = [(s.bucket, s.start, s.average.numel()) for s in shards if s.average.numel()]
            residual.enter(keys, params)
            self.shards.step(shards, params, self.compress)
            masters = iter(residual.leave(keys, params))
            return [next(masters) if s.average.numel() else s.average for s in shards]

        report = await engine.run(
            grads,
            RoundOptions(
                dst=params,
                weight=weight,
                timeout_s=self.timeout_s,
                on_reduced=on_reduced,
                mode=MODE_GRADS,
                # an update lost stays lost until the resync (no later broadcast
                # overwrites an estimate): compressed rounds keep the replica's values
                stale_step=self._stale_step if residual is None else None,
                parity_group=self.host.config.parity_for(optimizer=True),
                round_id=self._rid(step, GRADIENTS),
                compress=self.compress,
            ),
        )
        self._last_align = self.realign.judge(engine.alignment())
        if residual is not None:
            residual.settle(params)
            report.extra["catch_up"] = float(self.shards.caught_up)
            report.extra["residual_norm"] = residual.norm()
        return report

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Step count, round base, base hyperparameters and this peer's sharded state.

        The state is stored as full-length per-bucket tensors (zeros outside the
        shard this peer owned), so it loads under any later shard map.
        """
        return {
            "step_count": self.step_count,
            "round_base": self._round_base,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.base.param_groups
            ],
            "sharded": self.shards.state(self.param_buckets()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the shards rebuild at the next step."""
        self.step_count = int(state["step_count"])
        for g, saved in zip(self.base.param_groups, state["param_groups"], strict=True):
            g.update(saved)
        self.shards.load(state["sharded"])
        if self.residual is not None:  # the parameters are the checkpoint's now
            self.residual.clear()
        # Round ids already run are never reused: peers that restore the same checkpoint
        # together (same rounds run, so the same next round) move to the same fresh ids;
        # one that restores alone is out of step and realigns (``_realign``).
        fresh = self._engine().next_round - optimizer_round(self.step_count, EXPLICIT_RESYNC)
        self._round_base = max(int(state.get("round_base", 0)), fresh)
        self._based = True

    def _rid(self, step: int, slot: int) -> int:
        """The round id of ``slot`` at ``step``: the same on every peer at that step."""
        return self._round_base + optimizer_round(step, slot)

    @property
    def round_base(self) -> int:
        """Added to every round id (see ``_round_base``); a realigning peer takes the donor's."""
        return self._round_base

    def adopt_rounds(self, round_base: int, next_round: int | None = None) -> None:
        """Take a donor's round numbering (realignment): our next rounds are the donor's,
        even where our engine already ran later ones alone (it forgets them).
        ``next_round``: the donor's next round id (default: our step's first); one
        ahead of our engine moves it there, keeping the packets held for it."""
        self._round_base = round_base
        self._based = True
        if self.residual is not None:  # our replica was replaced: no update of ours applies
            self.residual.clear()
        first = self._rid(self.step_count, EXPLICIT_RESYNC) if next_round is None else next_round
        engine = self._engine()
        if engine.next_round > first:
            self.host.call(engine.rewind(first))
        elif engine.next_round < first:
            self.host.call(_advance(engine, first))


async def _advance(engine: LossyAllReduce, round_id: int) -> None:
    """Make ``round_id`` the engine's next round (loop thread; rounds before it are
    skipped, packets held for it and later kept)."""
    engine.next_round = max(engine.next_round, round_id)


def _write_back(params: list[torch.Tensor], staged: list[torch.Tensor]) -> None:
    """Copy the CPU staging copies back into device buckets (CPU buckets were used as is)."""
    for b, s in zip(params, staged, strict=True):
        if b is not s:
            b.copy_(s)
