"""Data-parallel optimizer wrapper: sharded steps and bounded-drift broadcasts.

``net.optimizer(base)`` keeps the user's loop plain PyTorch (``backward();
opt.step(); opt.zero_grad()``).  On ``step()`` the gradients are
reduce-scattered over the lossy transport; each peer steps the base
optimizer only for the shard it owns (its optimizer state is sharded too)
and broadcasts that shard's new parameters.  A peer that misses a
broadcast packet keeps its own parameters for that chunk: never zeros, so
the drift between replicas stays bounded (Weintraub et al. 2025).  By default
(``Config.stale_step``) it also moves them by an estimate of the step it
missed (``averaging/_stale_step.py``), still overwritten by the next broadcast
that arrives: the gradient it takes there next is what lost broadcasts cost.
While loss is seen its rounds send XOR parity packets (``Config.parity_for``):
one per group of 4 to 7 packets rebuilds one lost packet of the group, so at 10%
loss about 4-5% of chunks stay lost instead of 10%, for at most a quarter more
traffic.  Every ``resync_every_steps`` steps a resync round averages the
parameters and repairs every lost chunk, so replicas become identical again;
step 0 is a resync, which makes peers that started from different seeds
consistent.

Rounds are identified by the training step (``averaging._round_id``): every
peer at step s runs the same round ids, however many calls it made before.
After every resync each peer announces a digest of its parameters; a peer
whose digest the others outvote, or whose round showed it behind or ahead of
the others (a stall past the failure timeout, a restart, a call more or
fewer), downloads a right peer's state and step count (``_realign.py``).
The report's ``extra`` says so: ``realigned``, ``replica_repaired``,
``replicas_disagree``; ``net.replicas_agree()`` gives the verdict.

Why rebuild the base optimizer per shard: torch optimizers step whole
tensors; a shard is a view of the flat parameter bucket, so a new optimizer
of the same class over those views steps exactly the owned elements, and
LR schedulers keep working because hyperparameters are copied from the
user's ``base.param_groups`` before every step.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gossipnet.collectives.chunks import FlatBuffer, all_finite
from gossipnet.collectives.lossy.engine import LossyAllReduce, OwnedShard, RoundOptions
from gossipnet.collectives.lossy.round_id import (
    EXPLICIT_RESYNC,
    GRADIENTS,
    SCHEDULED_RESYNC,
    Alignment,
    optimizer_round,
)
from gossipnet.collectives.lossy.stale_step import StaleStep
from gossipnet.collectives.statesync.sync import TransferReport
from gossipnet.errors import ConfigError
from gossipnet.reports import CollectiveReport
from gossipnet.training import _realign
from gossipnet.training.moshpit import MoshpitStrategy
from gossipnet.training.replicas import ReplicaCheck, digest
from gossipnet.training.route import RouteStrategy

if TYPE_CHECKING:
    from gossipnet.peer import Peer

__all__ = ("GossipOptimizer",)

log = logging.getLogger(__name__)

MODE_GRADS = 0
MODE_RESYNC = 1
STRATEGIES = ("allreduce", "moshpit", "route")
LOCAL_STEP = ("moshpit", "route")  # strategies that step ``base`` locally, then average

ShardKey = tuple[tuple[int, int, int], ...]  # (bucket, start, length) per owned shard


class GossipOptimizer:
    """Wraps ``base`` so that ``step()`` trains data-parallel over gossipnet.

    Args:
        peer: the joined :class:`gossipnet.Peer`.
        base: a constructed torch optimizer (SGD, Adam, AdamW, ...); its class,
            defaults and param groups are used; it never steps itself.
        strategy: ``"allreduce"`` (loss-tolerant reduce-scatter + broadcast) or
            ``"moshpit"`` (local steps with ``base``, Moshpit averaging of the
            parameters every ``average_every`` steps; state download on join; see
            :class:`gossipnet.training.moshpit.MoshpitStrategy` for ``moshpit_options``:
            ``average_state``, ``sync_state``, ``group_size``, ``rounds``,
            ``checkpoint``, ``checkpoint_every``, ``sync_timeout``), or ``"route"``
            (local steps, route-aware gossip of the parameters every ``average_every``
            steps on the links the shared routes predict; options ``rounds``,
            ``average_state``: :class:`gossipnet.training.route.RouteStrategy`).
        resync_every_steps: resync period in steps (default from ``Config``; 0 = only
            the first step).
        timeout: bound of one step's collective in seconds.

    The parameters are re-bound to views of flat buckets (``FlatBuffer.adopt``):
    create the wrapper after moving the model to its device.
    """

    def __init__(
        self,
        peer: Peer,
        base: torch.optim.Optimizer,
        *,
        strategy: str = "allreduce",
        resync_every_steps: int | None = None,
        timeout: float | None = None,
        average_every: int = 1,
        **moshpit_options: Any,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ConfigError(f"strategy {strategy!r} is not available; choose one of {STRATEGIES}")
        if moshpit_options and strategy not in LOCAL_STEP:
            raise ConfigError(f"options {sorted(moshpit_options)} need strategy='moshpit'")
        if strategy == "route" and set(moshpit_options) - {"rounds", "average_state"}:
            bad = sorted(set(moshpit_options) - {"rounds", "average_state"})
            raise ConfigError(f"options {bad} do not apply to strategy='route'")
        self.peer = peer
        self.base = base
        self.strategy = strategy
        cfg = peer.config
        self.resync_every = (
            cfg.resync_every_steps if resync_every_steps is None else resync_every_steps
        )
        if self.resync_every < 0:
            raise ConfigError("resync_every_steps must be >= 0")
        self.timeout = cfg.collective_timeout_s if timeout is None else timeout
        # lost parameter broadcasts take an estimated step (Config.stale_step)
        self._stale_step = StaleStep() if cfg.stale_step else None
        self.groups = [[p for p in g["params"] if p.requires_grad] for g in base.param_groups]
        if not any(self.groups):
            raise ValueError("the optimizer has no parameter that requires grad")
        self.param_flats = [FlatBuffer.adopt(ps) if ps else None for ps in self.groups]
        self.grad_flats = [  # the moshpit strategy steps locally: no gradient buckets
            FlatBuffer([torch.zeros_like(p) for p in ps])
            if ps and strategy not in LOCAL_STEP
            else None
            for ps in self.groups
        ]
        self.bucket_group: list[int] = []
        for g, flat in enumerate(self.param_flats):
            if flat is not None:
                self.bucket_group.extend([g] * len(flat.buckets))
        self._shard_key: ShardKey = ()
        self._shard_opt: torch.optim.Optimizer | None = None
        self._shard_views: list[torch.Tensor] = []
        self._pending_state: dict[str, Any] | None = None
        self.step_count = 0
        self.last_report: CollectiveReport | None = None
        self.last_resync: CollectiveReport | None = None
        #: the last state download (realignment or replica repair), its report
        self.last_sync: TransferReport | None = None
        #: the last replica-digest verdict acted on (see ``_realign.after_step``)
        self.last_replica_check: ReplicaCheck | None = None
        self.sync_timeout_s = max(10.0, 3 * self.timeout)
        self._last_align: Alignment | None = None
        self._digest_rid: int | None = None  # the resync our latest digest is of
        self._checked_rid: int | None = None  # the resync whose verdict we acted on
        # added to every round id: moved past the ids already run when a checkpoint is
        # loaded (load_state_dict), so restored steps never reuse a round id
        self._round_base = 0
        # held while a step or resync changes the parameters or the optimizer state, so
        # that a peer asking for our state between steps (or after the last) gets a
        # consistent snapshot without waiting for our next step (_realign.serve_idle)
        self.state_lock = threading.Lock()
        self._serving = False
        if strategy == "allreduce" and peer._statesync is not None:
            peer._statesync.on_wanted = lambda: _realign.serve_idle(self)
        self._moshpit: MoshpitStrategy | None = None
        if strategy == "moshpit":
            self._moshpit = MoshpitStrategy(self, average_every=average_every, **moshpit_options)
        self._route: RouteStrategy | None = None
        if strategy == "route":
            self._route = RouteStrategy(self, average_every=average_every, **moshpit_options)

    # ------------------------------------------------------------------ public
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The user's param groups (edit ``lr`` here or with a scheduler)."""
        return self.base.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def step(
        self, closure: Callable[[], Any] | None = None, *, weight: float | None = None
    ) -> CollectiveReport:
        """Average gradients, step the owned shard, broadcast parameters.

        ``weight`` is this peer's all-reduce weight.  None (default): after a
        ``net.microbatches`` loop, the summed gradient is divided by the
        micro-batches it completed and weighted by that count (or by K and 1 with
        ``normalise="full"``), and the loop's tau and drop rate go into the
        report's ``extra``; without such a loop, weight 1.  A number: the
        gradients are sent as they are with that weight.

        Returns the gradient round's :class:`CollectiveReport` (also in
        ``last_report``; a resync's report is in ``last_resync``).  With
        ``strategy="moshpit"``: a local step, and every ``average_every`` steps the
        Moshpit averaging's report (else a ``method="local"`` one); the same with
        ``strategy="route"`` and its gossip round's report.
        """
        if self._moshpit is not None:
            return self._moshpit.step(closure, weight)
        if self._route is not None:
            return self._route.step(closure, weight)
        if closure is not None:
            with torch.enable_grad():
                closure()
        grads: list[torch.Tensor] = []
        for ps, flat in zip(self.groups, self.grad_flats, strict=True):
            if flat is None:
                continue
            grads.extend(
                flat.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in ps])
            )
        mb = self.peer._take_microbatch_report()  # the last net.microbatches loop, once
        if weight is None:
            scale, weight = (mb.grad_scale, mb.weight) if mb is not None else (1.0, 1.0)
            for g in grads if scale != 1.0 else ():
                g.mul_(scale)
        if not all(all_finite(g) for g in grads):
            log.warning(
                "peer %s: non-finite gradients at step %d; contributing weight 0",
                self.peer.peer_id,
                self.step_count,
            )
            for g in grads:
                torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
            weight = 0.0
        params = self._param_buckets()
        staged = [b if b.device.type == "cpu" else b.cpu() for b in params]
        gstaged = [g.cpu() for g in grads]
        with self.state_lock:
            step = self.step_count
            coro = self._round(gstaged, staged, weight, step)
            report = self.peer._call(coro, self.timeout * 3 + 30)
            for b, s in zip(params, staged, strict=True):
                if b is not s:
                    b.copy_(s)
            self.step_count += 1
        if mb is not None:
            report.extra.update(mb.as_extra())
        _realign.after_step(self, report, self._last_align)
        self.last_report = report
        return report

    def resync(self) -> CollectiveReport:
        """Average parameters now and repair every lost chunk (replicas become equal)."""
        if self._moshpit is not None:
            return self._moshpit.average()
        if self._route is not None:
            return self._route.average()
        rid = max(self._rid(self.step_count, EXPLICIT_RESYNC), self._engine().next_round)
        if rid >= self._rid(self.step_count, GRADIENTS) and self.last_resync is not None:
            return self.last_resync  # two resyncs already since the last step: nothing changed
        with self.state_lock:
            params = self._param_buckets()
            staged = [b if b.device.type == "cpu" else b.cpu() for b in params]
            report = self.peer._call(self._resync(staged, rid), self.timeout * 2 + 30)
            for b, s in zip(params, staged, strict=True):
                if b is not s:
                    b.copy_(s)
        return report

    # ------------------------------------------------------------------ loop side
    def _engine(self) -> LossyAllReduce:
        """The peer's optimizer engine: its own packet kinds, so plain ``all_reduce``
        calls between steps never take (or shift) the step-numbered rounds."""
        engine = self.peer._optim_engine
        assert engine is not None
        return engine

    async def _resync(self, params: list[torch.Tensor], round_id: int) -> CollectiveReport:
        """Average the parameters with repair, then announce their digest."""
        report = await self._engine().run(
            [p.clone() for p in params],
            RoundOptions(
                dst=params,
                timeout_s=self.timeout,
                mode=MODE_RESYNC,
                repair=True,
                round_id=round_id,
            ),
        )
        report.method = "resync"
        self.last_resync = report
        value = await asyncio.to_thread(digest, params)  # hashlib releases the GIL
        replicas = self.peer._replicas
        if replicas is not None:
            replicas.publish(round_id, value)
        self._digest_rid = round_id
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
            resync = await self._resync(params, rid)
            align = engine.alignment()
            if align.we_are_behind or align.we_are_ahead:
                self._last_align = align
                resync.extra["skipped_gradients"] = 1.0
                return resync

        def on_reduced(shards: list[OwnedShard]) -> list[torch.Tensor]:
            return self._step_shards(shards, params)

        report = await engine.run(
            grads,
            RoundOptions(
                dst=params,
                weight=weight,
                timeout_s=self.timeout,
                on_reduced=on_reduced,
                mode=MODE_GRADS,
                stale_step=self._stale_step,
                parity_group=self.peer.config.parity_for(optimizer=True),
                round_id=self._rid(step, GRADIENTS),
            ),
        )
        self._last_align = engine.alignment()
        return report

    def _step_shards(
        self, shards: list[OwnedShard], params: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Step the base optimizer on the owned shards; return their new values."""
        key: ShardKey = tuple((s.bucket, s.start, s.average.numel()) for s in shards)
        if key != self._shard_key or self._shard_opt is None:
            self._rebuild(key, params)
        if self._shard_opt is None:  # this peer owns no chunk in this round
            return [s.average for s in shards]
        for group, (b, _, _) in zip(self._shard_opt.param_groups, self._live(key), strict=True):
            for name, value in self.base.param_groups[self.bucket_group[b]].items():
                if name != "params":
                    group[name] = value
        views = self._shard_views
        for view, shard in zip(views, (s for s in shards if s.average.numel()), strict=True):
            view.grad = shard.average.to(view.dtype)
        self._shard_opt.step()
        for view in views:
            view.grad = None
        out = []
        live = iter(views)
        for s in shards:
            out.append(next(live).detach() if s.average.numel() else s.average)
        return out

    @staticmethod
    def _live(key: ShardKey) -> list[tuple[int, int, int]]:
        return [k for k in key if k[2] > 0]

    def _rebuild(self, key: ShardKey, params: list[torch.Tensor]) -> None:
        """New shard map: rebuild the shard optimizer, carrying state for kept elements."""
        full = self._full_state(params) if self._pending_state is None else self._pending_state
        self._pending_state = None
        views = [params[b].narrow(0, start, n) for b, start, n in self._live(key)]
        groups = [
            {
                "params": [v],
                **{
                    k: val
                    for k, val in self.base.param_groups[self.bucket_group[b]].items()
                    if k != "params"
                },
            }
            for v, (b, _, _) in zip(views, self._live(key), strict=True)
        ]
        opt = type(self.base)(groups, **self._ctor_defaults()) if groups else None
        if opt is not None and full:
            for v, (b, start, n) in zip(views, self._live(key), strict=True):
                per_key = full["buckets"].get(b, {})
                if per_key:
                    st: dict[str, Any] = {
                        k: t.narrow(0, start, n).clone().to(v.dtype)
                        if t.dtype.is_floating_point
                        else t.clone()
                        for k, t in per_key.items()
                    }
                    for scalar, value in full.get("scalars", {}).items():
                        st[scalar] = value.clone() if torch.is_tensor(value) else value
                    opt.state[v] = st
        self._shard_key, self._shard_opt, self._shard_views = key, opt, views

    def _ctor_defaults(self) -> dict[str, Any]:
        """``base.defaults`` restricted to what the class's constructor accepts
        (AdamW keeps ``decoupled_weight_decay`` in defaults but takes no such argument)."""
        params = inspect.signature(type(self.base).__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(self.base.defaults)
        return {k: v for k, v in self.base.defaults.items() if k in params}

    def _full_state(self, params: list[torch.Tensor]) -> dict[str, Any]:
        """The sharded state spread over full-length per-bucket tensors (zeros elsewhere)."""
        out: dict[str, Any] = {"buckets": {}, "scalars": {}}
        if self._shard_opt is None:
            return out
        for v, (b, start, n) in zip(self._shard_views, self._live(self._shard_key), strict=True):
            for k, t in self._shard_opt.state.get(v, {}).items():
                if torch.is_tensor(t) and t.dim() >= 1 and t.numel() == n:
                    full = (
                        out["buckets"]
                        .setdefault(b, {})
                        .setdefault(k, torch.zeros(params[b].numel(), dtype=t.dtype))
                    )
                    full.narrow(0, start, n).copy_(t)
                else:
                    # clone: optimizers bump scalar state (Adam's step) in place
                    out["scalars"][k] = t.clone() if torch.is_tensor(t) else t
        return out

    def _param_buckets(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for flat in self.param_flats:
            if flat is not None:
                out.extend(flat.buckets)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Step count, base hyperparameters and this peer's sharded state.

        The state is stored as full-length per-bucket tensors (zeros outside the
        shard this peer owned), so it loads under any later shard map.
        """
        if self._moshpit is not None:
            return self._moshpit.state_dict()
        if self._route is not None:
            return self._route.state_dict()
        params = self._param_buckets()
        return {
            "step_count": self.step_count,
            "round_base": self._round_base,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.base.param_groups
            ],
            "sharded": self._full_state(params)
            if self._pending_state is None
            else self._pending_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._moshpit is not None:
            self._moshpit.load_state_dict(state)
            return
        if self._route is not None:
            self._route.load_state_dict(state)
            return
        self.step_count = int(state["step_count"])
        for g, saved in zip(self.base.param_groups, state["param_groups"], strict=True):
            g.update(saved)
        self._pending_state = state["sharded"]
        self._shard_key = ()  # rebuild with the loaded state at the next step
        self._shard_opt = None
        # Round ids already run are never reused: peers that restore the same checkpoint
        # together (same rounds run, so the same next round) move to the same fresh ids;
        # one that restores alone is out of step and realigns (``_realign``).
        fresh = self._engine().next_round - optimizer_round(self.step_count, EXPLICIT_RESYNC)
        self._round_base = max(int(state.get("round_base", 0)), fresh)

    def _rid(self, step: int, slot: int) -> int:
        """The round id of ``slot`` at ``step``: the same on every peer at that step."""
        return self._round_base + optimizer_round(step, slot)

    def adopt_rounds(self, round_base: int) -> None:
        """Take a donor's round numbering (realignment): our next rounds are the donor's,
        even where our engine already ran later ones alone (it forgets them)."""
        self._round_base = round_base
        first = self._rid(self.step_count, EXPLICIT_RESYNC)
        if self._engine().next_round > first:
            self.peer._call(self._engine().rewind(first))
