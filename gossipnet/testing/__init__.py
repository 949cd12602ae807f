"""The public test kit: virtual time, in-process clusters, faults and a transport suite.

- :mod:`~gossipnet.testing.virtual_time`: :func:`run` a test on an event loop that
  knows when every task waits, so a :class:`FakeClock` moves exactly then
  (:func:`settle`, :func:`wait_until`, :func:`drive`, :func:`autojump`).
- :mod:`~gossipnet.testing.cluster`: nodes on a :class:`MemoryNetwork`
  (:func:`start_node`, :func:`cluster`), joined peers in threads (:func:`run_peers`)
  and loopback addresses for real sockets.
- :mod:`~gossipnet.testing.conformance`: :func:`check_transport`, the checks every
  :class:`~gossipnet.transport.Transport` backend must pass, yours included.
- :func:`introduce`: bind hand-built wire codecs to each other's keys.
- Faults: :class:`FaultPlan` and friends inject seeded loss, crashes and
  partitions; :func:`radio_faults` derives each link's loss from a radio model;
  :mod:`~gossipnet.testing.noise` models stragglers.

Importing this package starts nothing and imports no socket backend.
"""

from __future__ import annotations

from gossipnet.clock import FakeClock
from gossipnet.collectives.route.averager import radio_faults
from gossipnet.testing.cluster import (
    TEST_SECRET,
    cluster,
    free_tcp_ports,
    loopback_addresses,
    run_peers,
    start_node,
    wait_until_sync,
)
from gossipnet.testing.conformance import (
    CHECKS,
    TransportFactory,
    TransportSpec,
    check_transport,
    run_check,
)
from gossipnet.testing.keys import introduce
from gossipnet.testing.noise import LogNormalDelay, NoisePlan, SlowPeer, Stall, simulate_fleet
from gossipnet.testing.virtual_time import (
    autojump,
    drive,
    new_event_loop,
    run,
    settle,
    wait_until,
)
from gossipnet.transport.faults import Crash, FaultPlan, FaultyTransport, GilbertElliott, Partition
from gossipnet.transport.memory import MemoryNetwork, MemoryTransport

__all__ = (
    "CHECKS",
    "TEST_SECRET",
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
    "TransportFactory",
    "TransportSpec",
    "autojump",
    "check_transport",
    "cluster",
    "drive",
    "free_tcp_ports",
    "introduce",
    "loopback_addresses",
    "new_event_loop",
    "radio_faults",
    "run",
    "run_check",
    "run_peers",
    "settle",
    "simulate_fleet",
    "start_node",
    "wait_until",
    "wait_until_sync",
)
