"""What the training layer needs from a running peer: the :class:`TrainingHost` protocol.

Why a protocol: the optimizer strategies, the micro-batch loop and the state
repairs need a peer's loop, engines and identity, but the training layer sits
below the facade (``gossipnet.peer``) and never imports it.  The facade
implements this protocol with a small adapter (``gossipnet._training_host``);
tests may implement it with anything that has these names.  Every name here is
public on purpose: the training layer never reads a peer's private members.
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

__all__ = ("TrainingHost",)

T = TypeVar("T")


class TrainingHost(Protocol):
    """A running peer as the training layer sees it.

    Blocking methods (``call``, ``alive_peers``, ``replica_check``,
    ``moshpit_average``) are for the training thread; the engines and the node
    belong to the peer's loop thread and are touched only from coroutines run
    through :meth:`call` (or from callbacks the loop itself runs).
    """

    #: Token of the optimizer that stepped last on this peer (None: none yet); the
    #: optimizer reads and writes it to refuse two optimizers stepping in turn.
    last_stepper: int | None

    @property
    def peer_id(self) -> str:
        """This peer's id."""
        ...

    @property
    def config(self) -> Config:
        """The peer's configuration."""
        ...

    @property
    def node(self) -> Node:
        """The peer's node (loop thread only)."""
        ...

    @property
    def allreduce_engine(self) -> LossyAllReduce:
        """The engine of plain ``all_reduce`` calls (timing gathers use it)."""
        ...

    @property
    def optimizer_engine(self) -> LossyAllReduce:
        """The engine of the optimizer's step-numbered rounds: its own packet kinds,
        so plain ``all_reduce`` calls between steps never take or shift its rounds."""
        ...

    @property
    def statesync(self) -> StateSync | None:
        """State download and serving (None: not running on this peer)."""
        ...

    @property
    def moshpit(self) -> MoshpitAverager | None:
        """The Moshpit averager (None: not running on this peer)."""
        ...

    @property
    def route(self) -> RouteAverager | None:
        """The route-aware gossip averager (None: not running on this peer)."""
        ...

    @property
    def replicas(self) -> ReplicaDigests | None:
        """Resync digests, ours and the others' (None: not running on this peer)."""
        ...

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the peer's loop and wait for it (``timeout_s`` bound).

        Raises:
            ClosedError: the peer has left.
            RuntimeError: called from the loop thread itself.
        """
        ...

    def alive_peers(self) -> list[str]:
        """Peers believed alive, sorted, this one included (blocking)."""
        ...

    def flat_for(self, tensors: Sequence[torch.Tensor]) -> FlatBuffer:
        """The peer's cached flat buffer for ``tensors``' layout."""
        ...

    def replica_check(self) -> ReplicaCheck:
        """The current resync-digest verdict, without waiting (blocking call)."""
        ...

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
        """Moshpit-average ``tensors`` in place, as ``Peer.average(method="moshpit")``."""
        ...

    def take_microbatch_report(self) -> MicrobatchReport | None:
        """Finish the open ``microbatches`` loop; its report once per loop, else None."""
        ...
