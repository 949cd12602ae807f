"""gossipnet: data-parallel PyTorch training over networks that lose packets,
lose peers and straggle.

A training loop calls :func:`gossipnet.join` and trains on; the library
decides how peers exchange gradients and parameters.  Importing this
package has no side effects: no thread, socket or event loop starts until
``join()``.
"""

from __future__ import annotations

from ._microbatch import MicrobatchReport
from ._replicas import ReplicaCheck
from .averaging.autotau import AutoTau, AutoTauConfig, FixedTau, TauPolicy
from .clock import Clock, FakeClock, MonotonicClock
from .config import Config
from .errors import (
    ClosedError,
    ConfigError,
    GossipError,
    JoinError,
    LayoutMismatchError,
    PeerUnreachable,
    ProtocolError,
)
from .mobility.radio import RadioModel
from .mobility.routes import Route
from .optim import GossipOptimizer
from .peer import Peer, join
from .rounds import CollectiveReport
from .transport.faults import Crash, FaultPlan, GilbertElliott, Partition

__version__ = "0.1.0"

__all__ = (
    "AutoTau",
    "AutoTauConfig",
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
    "JoinError",
    "LayoutMismatchError",
    "MicrobatchReport",
    "MonotonicClock",
    "Partition",
    "Peer",
    "PeerUnreachable",
    "ProtocolError",
    "RadioModel",
    "ReplicaCheck",
    "Route",
    "TauPolicy",
    "__version__",
    "join",
)
