"""The public names are a contract: pinned here so a change is deliberate."""

from __future__ import annotations

import subprocess
import sys

import gossipnet


def test_all_is_pinned() -> None:
    assert gossipnet.__all__ == (
        "AllReduceOptions",
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
        "MoshpitOptions",
        "Partition",
        "Peer",
        "PeerUnreachable",
        "ProtocolError",
        "RadioModel",
        "ReplicaCheck",
        "Route",
        "RouteOptions",
        "TauPolicy",
        "__version__",
        "join",
    )
    for name in gossipnet.__all__:
        assert hasattr(gossipnet, name), name


def test_import_has_no_side_effects() -> None:
    """Importing starts no thread and no event loop (STYLE: no import side effects)."""
    code = (
        "import threading, gossipnet, gossipnet.testing, gossipnet.mobility; "
        "print(threading.active_count())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "1"


def test_config_rejects_bad_values_with_a_message() -> None:
    import pytest

    with pytest.raises(gossipnet.ConfigError, match="failure_timeout_s"):
        gossipnet.Config(heartbeat_interval_s=1.0, failure_timeout_s=0.5)
    with pytest.raises(gossipnet.ConfigError, match="unknown Config field"):
        gossipnet.Config().replace(no_such_knob=1)
