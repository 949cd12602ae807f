"""The facade's side of :class:`gossipnet.training.host.TrainingHost`.

Why an adapter: the training layer sits below ``Peer`` and may not import it,
and a protocol of public names is what it asks for; ``Peer`` keeps its engines
and loop as private members.  This class is the one place that reads them on
the training layer's behalf, so a change to ``Peer``'s internals touches only
this file.  ``Peer`` builds one per peer, lazily: an ``AutoTau`` remembers the
host it serves by identity.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import torch

from gossipnet.collectives.lossy.engine import LossyAllReduce
from gossipnet.collectives.moshpit.averager import MoshpitAverager
from gossipnet.collectives.route.averager import RouteAverager
from gossipnet.collectives.statesync.sync import StateSync
from gossipnet.config import Config
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.flatbuffer import FlatBuffer
from gossipnet.runtime.node import Node
from gossipnet.training.dropcompute import MicrobatchReport
from gossipnet.training.replicas import ReplicaCheck, ReplicaDigests

__all__ = ("PeerInternals", "PeerTrainingHost")

T = TypeVar("T")


class PeerInternals(Protocol):
    """What the adapter reads of a :class:`~gossipnet.Peer`, private members included.

    Why a protocol rather than ``Peer``: ``peer.py`` builds the adapter, so naming
    the class here would be an import circle; this also lists, in one place, the
    members of ``Peer`` that the training layer depends on.
    """

    @property
    def peer_id(self) -> str: ...

    @property
    def config(self) -> Config: ...

    @property
    def _node(self) -> Node: ...

    @property
    def _optim_engine(self) -> LossyAllReduce | None: ...

    @property
    def _statesync(self) -> StateSync | None: ...

    @property
    def _moshpit(self) -> MoshpitAverager | None: ...

    @property
    def _route(self) -> RouteAverager | None: ...

    @property
    def _replicas(self) -> ReplicaDigests | None: ...

    def _engine(self) -> LossyAllReduce: ...

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T: ...

    def _flat_for(self, tensors: Sequence[torch.Tensor]) -> FlatBuffer: ...

    def _take_microbatch_report(self) -> MicrobatchReport | None: ...

    def alive_peers(self) -> list[str]: ...

    def replica_check(self) -> ReplicaCheck: ...

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        method: str = ...,
        rounds: int | None = ...,
        *,
        weight: float = ...,
        timeout: float | None = ...,
        group_size: int | None = ...,
        start_round: int | None = ...,
    ) -> CollectiveReport: ...


class PeerTrainingHost:
    """A :class:`~gossipnet.Peer` seen as a ``TrainingHost`` (see the module doc).

    Args:
        peer: the running peer; the adapter holds no state of its own.
    """

    __slots__ = ("_peer", "last_stepper")

    def __init__(self, peer: PeerInternals) -> None:
        self._peer = peer
        self.last_stepper: int | None = None

    @property
    def peer_id(self) -> str:
        return self._peer.peer_id

    @property
    def config(self) -> Config:
        return self._peer.config

    @property
    def node(self) -> Node:
        return self._peer._node

    @property
    def allreduce_engine(self) -> LossyAllReduce:
        return self._peer._engine()

    @property
    def optimizer_engine(self) -> LossyAllReduce:
        engine = self._peer._optim_engine
        assert engine is not None  # created when the peer started
        return engine

    @property
    def statesync(self) -> StateSync | None:
        return self._peer._statesync

    @property
    def moshpit(self) -> MoshpitAverager | None:
        return self._peer._moshpit

    @property
    def route(self) -> RouteAverager | None:
        return self._peer._route

    @property
    def replicas(self) -> ReplicaDigests | None:
        return self._peer._replicas

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self._peer._call(coro, timeout_s)

    def alive_peers(self) -> list[str]:
        return self._peer.alive_peers()

    def flat_for(self, tensors: Sequence[torch.Tensor]) -> FlatBuffer:
        return self._peer._flat_for(tensors)

    def replica_check(self) -> ReplicaCheck:
        return self._peer.replica_check()

    def moshpit_average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        rounds: int | None,
        weight: float,
        timeout_s: float | None,
        group_size: int | None,
        start_round: int | None,
    ) -> CollectiveReport:
        return self._peer.average(
            tensors,
            method="moshpit",
            rounds=rounds,
            weight=weight,
            timeout=timeout_s,
            group_size=group_size,
            start_round=start_round,
        )

    def take_microbatch_report(self) -> MicrobatchReport | None:
        return self._peer._take_microbatch_report()
