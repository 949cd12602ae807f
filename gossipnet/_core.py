"""Facade glue: the engines a :class:`gossipnet.Peer` runs, built on its runtime.

The runtime (:class:`gossipnet.runtime.runtime.Runtime`) owns the loop thread, the
node and the join wait, and knows no collective; this module names the collectives:
:data:`ENGINES` tells the runtime what to build on the loop thread as the node starts,
and :class:`Engines` hands them back to ``Peer`` typed.  :class:`IslandHost` is the
facade's side of :class:`gossipnet.collectives.island.averager.IslandHost`: the island
path gets a call into the loop and the lossy engine, not the ``Peer``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from gossipnet.collectives.island.averager import IslandAverage
from gossipnet.collectives.lossy.engine import LossyAllReduce
from gossipnet.collectives.lossy.packets import OPTIMIZER_KINDS
from gossipnet.collectives.moshpit.averager import MoshpitAverager
from gossipnet.collectives.route.averager import RouteAverager
from gossipnet.collectives.statesync.sync import StateSync
from gossipnet.runtime.runtime import EngineFactory, Runtime
from gossipnet.training.replicas import ReplicaDigests

__all__ = ("ENGINES", "Engines", "IslandHost")

T = TypeVar("T")

#: What a peer's runtime builds as its node starts, in this order (key -> factory).
ENGINES: Mapping[str, EngineFactory] = {
    "allreduce": LossyAllReduce,
    # GossipOptimizer's rounds: their own kinds and counter, apart from all_reduce's
    "optimizer": functools.partial(LossyAllReduce, tag="opt", kinds=OPTIMIZER_KINDS),
    "replicas": ReplicaDigests,  # resync digests, ours and theirs
    "moshpit": MoshpitAverager,
    "statesync": StateSync,
    "route": RouteAverager,
    "island": IslandAverage,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Engines:
    """A started peer's engines, typed (each lives on the loop thread)."""

    allreduce: LossyAllReduce
    optimizer: LossyAllReduce
    replicas: ReplicaDigests
    moshpit: MoshpitAverager
    statesync: StateSync
    route: RouteAverager
    island: IslandAverage

    @classmethod
    def of(cls, runtime: Runtime) -> Engines:
        """The engines :data:`ENGINES` built on ``runtime`` (started)."""
        return cls(
            allreduce=runtime.engine("allreduce", LossyAllReduce),
            optimizer=runtime.engine("optimizer", LossyAllReduce),
            replicas=runtime.engine("replicas", ReplicaDigests),
            moshpit=runtime.engine("moshpit", MoshpitAverager),
            statesync=runtime.engine("statesync", StateSync),
            route=runtime.engine("route", RouteAverager),
            island=runtime.engine("island", IslandAverage),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class IslandHost:
    """The island path's view of a peer: its runtime's calls and its lossy engine."""

    runtime: Runtime
    lossy: LossyAllReduce

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """See :meth:`gossipnet.runtime.runtime.Runtime.call`."""
        return self.runtime.call(coro, timeout_s)
