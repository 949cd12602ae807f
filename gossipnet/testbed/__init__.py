"""A real lossy network on one Linux machine: hosts as network namespaces on a bridge.

gossipnet's own fault injection proves the algorithms; this shows them on a
kernel network, where TCP collectives stall on retransmits.  k hosts
(``h0..``, ``10.77.0.1..``) hang off one switch namespace; per host you set
kernel random loss (nftables ``numgen random`` on the switch's forwarding
path), bandwidth caps (``tc tbf``) and link cuts, run commands or Python calls
inside hosts, and everything is torn down however the run ends::

    from gossipnet.testbed import Testbed, measure_loss

    with Testbed(hosts=4) as tb:
        tb.set_loss(None, 0.10)                  # every host's outgoing frames
        print(measure_loss(tb, 0, 1))            # binomially checked
        task = tb.hosts[0].start(my_function, arg)
        print(task.result(timeout_s=60))

Needs root and ``ip``, ``tc``, ``nft`` (``scripts/install-testbed-deps.sh``);
:func:`unavailable_reason` says why not otherwise.
"""

from __future__ import annotations

from gossipnet.testbed._host import Host, Leftovers
from gossipnet.testbed._net import Testbed, TestbedConfig
from gossipnet.testbed._proc import HostProcess, PyTask, WorkerError
from gossipnet.testbed._registry import cleanup_stale
from gossipnet.testbed._shaping import LinkState
from gossipnet.testbed._sys import TestbedError, TestbedUnavailable, unavailable_reason
from gossipnet.testbed.measure import (
    FrameCheck,
    LossMeasurement,
    binomial_bounds,
    check_tcp_frames,
    measure_links,
    measure_loss,
    measure_throughput,
)

__all__ = (
    "FrameCheck",
    "Host",
    "HostProcess",
    "Leftovers",
    "LinkState",
    "LossMeasurement",
    "PyTask",
    "Testbed",
    "TestbedConfig",
    "TestbedError",
    "TestbedUnavailable",
    "WorkerError",
    "binomial_bounds",
    "check_tcp_frames",
    "cleanup_stale",
    "measure_links",
    "measure_loss",
    "measure_throughput",
    "unavailable_reason",
)
