"""Public helpers for testing code that uses gossipnet.

``MemoryNetwork`` runs many peers in one process without sockets;
``FakeClock`` makes timeouts free; ``FaultPlan`` injects seeded faults;
``radio_faults`` derives each link's loss from a radio model and routes.
"""

from __future__ import annotations

from gossipnet.clock import FakeClock
from gossipnet.collectives.route.averager import radio_faults
from gossipnet.testing.noise import LogNormalDelay, NoisePlan, SlowPeer, Stall, simulate_fleet
from gossipnet.transport.faults import Crash, FaultPlan, FaultyTransport, GilbertElliott, Partition
from gossipnet.transport.memory import MemoryNetwork, MemoryTransport

__all__ = (
    "Crash",
    "FakeClock",
    "FaultPlan",
    "FaultyTransport",
    "GilbertElliott",
    "LogNormalDelay",
    "MemoryNetwork",
    "MemoryTransport",
    "NoisePlan",
    "Partition",
    "SlowPeer",
    "Stall",
    "radio_faults",
    "simulate_fleet",
)
