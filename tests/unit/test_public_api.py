"""The public names are a contract: pinned here so a change is deliberate."""

from __future__ import annotations

import subprocess
import sys

import gossipnet


def test_all_is_pinned() -> None:
    assert gossipnet.__all__ == (
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
    for name in gossipnet.__all__:
        assert hasattr(gossipnet, name), name


def test_peer_carries_its_documented_methods() -> None:
    """Every public method of Peer is reachable on the class, documented in peer.py."""
    for name in (
        "peer_id",
        "address",
        "node",
        "alive_peers",
        "stats",
        "wait_for_peers",
        "all_reduce",
        "island_all_reduce",
        "island_average",
        "average",
        "set_route",
        "optimizer",
        "microbatches",
        "last_microbatch_report",
        "leave",
        "close",
        "__enter__",
        "__exit__",
    ):
        assert hasattr(gossipnet.Peer, name), name
    assert gossipnet.Peer.__module__ == "gossipnet.peer"  # what docs and pickles name
    for name in ("all_reduce", "average", "island_average", "set_route", "microbatches"):
        # the user-facing documentation is defined in gossipnet/peer.py itself
        assert name in vars(gossipnet.Peer), name
        assert "Args:" in (getattr(gossipnet.Peer, name).__doc__ or ""), name


def test_testing_kit_names_are_pinned() -> None:
    import gossipnet.testing

    assert gossipnet.testing.__all__ == (
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
    for name in gossipnet.testing.__all__:
        assert hasattr(gossipnet.testing, name), name
    for name in ("FakeClock", "FaultPlan", "Crash", "GilbertElliott", "Partition"):
        # one object, whichever public module a user imports it from
        assert getattr(gossipnet.testing, name) is getattr(gossipnet, name), name


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
