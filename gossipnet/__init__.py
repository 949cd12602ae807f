"""gossipnet: data-parallel PyTorch training over networks that lose packets,
lose peers and straggle.

A training loop calls :func:`gossipnet.join` and trains on; the library
decides how peers exchange gradients and parameters.  Importing this
package has no side effects: no thread, socket or event loop starts until
``join()``.
"""

from __future__ import annotations

from gossipnet._join import join
from gossipnet.clock import Clock, FakeClock, MonotonicClock
from gossipnet.collectives.compress import DCT, Accordion, ArcTopK, Int8
from gossipnet.collectives.lossy.robust import CenteredClip
from gossipnet.collectives.sparq.config import SparQ
from gossipnet.config import Config
from gossipnet.distributed import register as _register_torch_backend
from gossipnet.errors import (
    ClosedError,
    ConfigError,
    GossipError,
    JoinError,
    LayoutMismatchError,
    PeerUnreachable,
    ProtocolError,
)
from gossipnet.mobility.radio import RadioModel
from gossipnet.mobility.routes import Route
from gossipnet.peer import Peer
from gossipnet.reports import CollectiveReport
from gossipnet.training.autotau import AutoTau, AutoTauConfig, FixedTau, TauPolicy
from gossipnet.training.microbatch import MicrobatchReport
from gossipnet.training.optimizer import GossipOptimizer
from gossipnet.training.options import AllReduceOptions, MoshpitOptions, RouteOptions
from gossipnet.training.replicas import ReplicaCheck
from gossipnet.transport.faults import Crash, FaultPlan, GilbertElliott, Partition

__version__ = "0.1.0"

_register_torch_backend()  # dist.init_process_group("gossipnet"); imports nothing more

__all__ = (
    "DCT",
    "Accordion",
    "AllReduceOptions",
    "ArcTopK",
    "AutoTau",
    "AutoTauConfig",
    "CenteredClip",
    "Clock",
    "ClosedError",
    "CollectiveReport",
    "Config",
    "ConfigError",
    "Crash",
    "FakeClock",
    "FaultPlan",
    "FixedTau",
    "GilbertElliott",
    "GossipError",
    "GossipOptimizer",
    "Int8",
    "JoinError",
    "LayoutMismatchError",
    "MicrobatchReport",
    "MonotonicClock",
    "MoshpitOptions",
    "Partition",
    "Peer",
    "PeerUnreachable",
    "ProtocolError",
    "RadioModel",
    "ReplicaCheck",
    "Route",
    "RouteOptions",
    "SparQ",
    "TauPolicy",
    "__version__",
    "join",
)
