"""``net.optimizer(base)``: a torch-optimizer-shaped wrapper over one :class:`Strategy`.

The user's loop stays plain PyTorch (``backward(); opt.step();
opt.zero_grad()``); what ``step()`` does is the strategy's:

- ``"allreduce"`` (:mod:`gossipnet.training.allreduce`): gradients
  reduce-scattered over the lossy transport, each peer steps the shard it owns
  and broadcasts it; periodic resyncs make replicas identical again.
- ``"moshpit"`` (:mod:`gossipnet.training.moshpit`): local steps, Moshpit
  averaging of the parameters every few steps, state download on join.
- ``"route"`` (:mod:`gossipnet.training.route`): local steps, route-aware
  gossip of the parameters every few steps on the links the routes predict.

Why a wrapper that only forwards: each strategy keeps its own state and
options (:mod:`gossipnet.training.options`), so adding one touches no other,
and this class carries no ``if strategy == ...`` at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from gossipnet.collectives.statesync.sync import TransferReport
from gossipnet.errors import ConfigError
from gossipnet.reports import CollectiveReport
from gossipnet.training.allreduce import AllReduceStrategy
from gossipnet.training.host import TrainingHost
from gossipnet.training.moshpit import MoshpitStrategy
from gossipnet.training.options import (
    AllReduceOptions,
    MoshpitOptions,
    RouteOptions,
    StrategyOptions,
)
from gossipnet.training.replicas import ReplicaCheck
from gossipnet.training.route import RouteStrategy
from gossipnet.training.strategy import Strategy

__all__ = ("GossipOptimizer", "build_strategy")


def build_strategy(
    host: TrainingHost, base: torch.optim.Optimizer, options: StrategyOptions
) -> Strategy:
    """The strategy that ``options`` configure, over ``host`` and ``base``.

    Raises:
        ValueError: no parameter of ``base`` requires grad.
        ConfigError: the strategy cannot run here (e.g. ``"route"`` without a route).
    """
    match options:
        case AllReduceOptions():
            return AllReduceStrategy(host, base, options)
        case MoshpitOptions():
            return MoshpitStrategy(host, base, options)
        case RouteOptions():
            return RouteStrategy(host, base, options)
    raise TypeError(f"not a strategy's options: {options!r}")


#: One token per optimizer (``id()`` may be reused once one is gone).
_TOKENS = itertools.count(1)


class GossipOptimizer:
    """Wraps ``base`` so that ``step()`` trains data-parallel over gossipnet.

    Build it with ``net.optimizer(base, strategy=...)``: a strategy name plus its
    keywords, or an options value (:class:`~gossipnet.AllReduceOptions`,
    :class:`~gossipnet.MoshpitOptions`, :class:`~gossipnet.RouteOptions`).

    Args:
        host: the peer, as the training layer sees it.
        base: a constructed torch optimizer (SGD, Adam, AdamW, ...); the all-reduce
            uses its class, defaults and param groups and never steps it itself;
            the local-step strategies step it.
        options: the strategy and its settings (default: the all-reduce's).

    The parameters are re-bound to views of flat buckets (``FlatBuffer.adopt``):
    create the wrapper after moving the model to its device.

    Raises:
        ValueError: no parameter of ``base`` requires grad.
        ConfigError: the strategy cannot run on this peer.
    """

    def __init__(
        self,
        host: TrainingHost,
        base: torch.optim.Optimizer,
        options: StrategyOptions | None = None,
    ) -> None:
        self.base = base
        self.options: StrategyOptions = AllReduceOptions() if options is None else options
        #: the strategy this wrapper delegates to
        self.strategy: Strategy = build_strategy(host, base, self.options)
        self._host = host
        self._token = next(_TOKENS)
        self._stepped = False

    def _take_turn(self) -> None:
        """Refuse to step after another optimizer of this peer stepped since our last step.

        Why: each optimizer numbers its rounds by its own steps on the peer's one
        engine, so two stepping in turn would claim rounds the other already ran
        (once a failure deep inside the engine: "round id 2 was already run").  A
        replacement that takes over for good steps on: its rounds follow.
        """
        last = self._host.last_stepper
        if self._stepped and last is not None and last != self._token:
            raise ConfigError(
                f"peer {self._host.peer_id}: another optimizer stepped since this one did;"
                " one optimizer steps per peer (its rounds are numbered by its steps). Put"
                " every parameter in one optimizer (param groups for different settings),"
                " or join a second peer (another listen port and run=) for a second model"
            )
        self._host.last_stepper = self._token
        self._stepped = True

    # ------------------------------------------------------------------ torch.optim shape
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The user's param groups (edit ``lr`` here or with a scheduler)."""
        return self.base.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, as ``base.zero_grad`` does."""
        self.base.zero_grad(set_to_none=set_to_none)

    def step(
        self, closure: Callable[[], Any] | None = None, *, weight: float | None = None
    ) -> CollectiveReport:
        """One training step of the strategy; network faults never raise.

        ``weight`` is this peer's weight.  None (default): after a
        ``net.microbatches`` loop, the summed gradient is divided by the
        micro-batches it completed and weighted by that count (or by K and 1 with
        ``normalise="full"``), and the loop's tau and drop rate go into the
        report's ``extra``; without such a loop, weight 1.  A number: the
        gradients are sent as they are with that weight (the all-reduce's weight,
        Moshpit's averaging weight; route gossip ignores it).

        Returns:
            All-reduce: the gradient round's :class:`CollectiveReport` (a resync's is
            in ``last_resync``).  Moshpit / route: a ``method="local"`` report, and
            every ``average_every`` steps the averaging's (or gossip round's) report.
        """
        self._take_turn()
        return self.strategy.step(closure, weight)

    def resync(self) -> CollectiveReport:
        """Average parameters now: the all-reduce also repairs every lost chunk, so
        replicas become equal; Moshpit and route run one averaging out of schedule."""
        self._take_turn()
        return self.strategy.resync()

    def state_dict(self) -> dict[str, Any]:
        """The strategy's checkpoint state: step count and optimizer state (the
        all-reduce's is sharded, stored full-length so it loads under any shard map)."""
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (same strategy, model and optimizer)."""
        self.strategy.load_state_dict(state)

    # ------------------------------------------------------------------ what happened
    @property
    def step_count(self) -> int:
        """Steps taken (the same on every peer at the same step)."""
        return self.strategy.step_count

    @property
    def last_report(self) -> CollectiveReport | None:
        """The last :meth:`step`'s report."""
        return self.strategy.last_report

    @property
    def last_resync(self) -> CollectiveReport | None:
        """The last resync's report (all-reduce only)."""
        return self.strategy.last_resync

    @property
    def last_sync(self) -> TransferReport | None:
        """The last state download (a join, catch-up, realignment or repair), if any."""
        return self.strategy.last_sync

    @property
    def last_replica_check(self) -> ReplicaCheck | None:
        """The last replica-digest verdict acted on (all-reduce only)."""
        return self.strategy.last_replica_check
