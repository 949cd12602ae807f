"""The :class:`Strategy` protocol: what a :class:`~gossipnet.GossipOptimizer` delegates to.

A strategy decides how peers train together: the sharded all-reduce
(:mod:`gossipnet.training.allreduce`), local steps with Moshpit averaging
(:mod:`gossipnet.training.moshpit`) or with route-aware gossip
(:mod:`gossipnet.training.route`).  Why objects behind one protocol: the
wrapper used to test ``if moshpit ... if route ...`` in each of its methods;
now each strategy keeps its own state and the wrapper only forwards, the way
torchft's ``LocalSGD`` hooks into an optimizer and uses nothing but the
manager's public methods (here: :class:`~gossipnet.training.host.TrainingHost`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from gossipnet.collectives.statesync.sync import TransferReport
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.flatbuffer import FlatBuffer
from gossipnet.training.replicas import ReplicaCheck

__all__ = ("Strategy", "adopt_groups")


class Strategy(Protocol):
    """One way of training data-parallel; built by ``net.optimizer`` from its options.

    Attributes:
        name: ``"allreduce"``, ``"moshpit"`` or ``"route"``.
        step_count: steps taken (the same on every peer at the same step: rounds
            are numbered by it).
        last_report: the last :meth:`step`'s report.
        last_resync: the last resync's report (all-reduce only; else None).
        last_sync: the last state download (a join, a catch-up, a realignment or a
            replica repair), its report; None if none ran.
        last_replica_check: the last replica-digest verdict acted on (all-reduce
            only; else None).
    """

    name: str

    @property
    def step_count(self) -> int: ...

    @property
    def last_report(self) -> CollectiveReport | None: ...

    @property
    def last_resync(self) -> CollectiveReport | None: ...

    @property
    def last_sync(self) -> TransferReport | None: ...

    @property
    def last_replica_check(self) -> ReplicaCheck | None: ...

    def step(self, closure: Callable[[], Any] | None, weight: float | None) -> CollectiveReport:
        """One training step (see ``GossipOptimizer.step``); never raises on loss."""
        ...

    def resync(self) -> CollectiveReport:
        """Average the parameters now (the all-reduce also repairs every lost chunk)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps; its format is pinned by the tests."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        ...


def adopt_groups(
    base: torch.optim.Optimizer,
) -> tuple[list[list[torch.Tensor]], list[FlatBuffer | None]]:
    """The parameters of each of ``base``'s groups that require grad, re-bound to views
    of one flat bucket per group (``FlatBuffer.adopt``).

    Why every strategy adopts: the all-reduce reads and writes parameters in place
    in their buckets, and the local-step strategies keep the same memory layout
    (they always had it), so a model behaves alike under every strategy.

    Returns:
        The groups' trainable parameters and each group's buffer (None: no such
        parameter in that group).

    Raises:
        ValueError: no parameter requires grad (nothing to train).
    """
    groups = [[p for p in g["params"] if p.requires_grad] for g in base.param_groups]
    if not any(groups):
        raise ValueError("the optimizer has no parameter that requires grad")
    return groups, [FlatBuffer.adopt(ps) if ps else None for ps in groups]
