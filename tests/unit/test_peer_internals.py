"""The internals under ``Peer`` and ``Node``: pinned names, and join()'s resolution.

``Peer`` holds a runtime (``runtime/runtime.py``) and the engines ``_core.py`` names;
``Node`` holds three parts (``runtime/dispatch.py``, ``reliable.py``,
``membership_protocol.py``); these tests pin what each exports and that the public
classes still carry every method in one place.
``resolve_join`` is pure (no sockets), so torchrun's rules are checked here.
"""

from __future__ import annotations

import pytest
import torch

from gossipnet import _collective, _core, peer
from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.runtime import _join_check, dispatch, membership_protocol, reliable
from gossipnet.runtime import join as _join
from gossipnet.runtime import node as _node
from gossipnet.runtime.flatbuffer import FlatCache


def test_internal_names_are_pinned() -> None:
    assert _join.__all__ == (
        "JoinPlan",
        "advertise_host",
        "resolve_join",
        "torchrun_settings",
        "warn_if_exposed",
    )
    assert _join_check.__all__ == (
        "JoinSnapshot",
        "join_error",
        "shortfall_details",
        "unauthenticated",
    )
    assert _collective.__all__ == (
        "Staged",
        "moshpit_bound_s",
        "moshpit_config",
        "stage",
    )
    assert _core.__all__ == ("ENGINES", "Engines", "IslandHost")
    assert dispatch.__all__ == ("PacketCallback", "PacketIO", "RequestFilter")
    assert reliable.__all__ == ("Reliable", "wait_future")
    assert membership_protocol.__all__ == ("BEACON_LIMIT", "MembershipProtocol")
    assert peer.__all__ == ("Peer", "join")
    assert _node.__all__ == ("Node",)


def test_public_classes_keep_their_modules_and_methods() -> None:
    assert peer.Peer.__module__ == "gossipnet.peer"
    assert _node.Node.__module__ == "gossipnet.runtime.node"
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
        assert hasattr(peer.Peer, name), name
    for name in ("all_reduce", "average", "island_average", "set_route", "microbatches"):
        # the user-facing documentation is defined in gossipnet/peer.py itself
        assert name in vars(peer.Peer), name
        assert "Args:" in (getattr(peer.Peer, name).__doc__ or ""), name
    # the parts' methods are bound onto each node (no forwarding call per packet)
    node = _node.Node(config=Config(), listen="mem://n", peer_id="n")
    for name in ("send", "send_many", "send_frames", "send_reliable", "subscribe"):
        assert hasattr(node, name), name
    for name in ("on_heartbeat", "alive_peers", "on_membership", "wait_for_peers", "stats"):
        assert hasattr(node, name), name
    assert node.send == node.io.send
    assert node.send_reliable == node.reliable.send_reliable


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GOSSIPNET_SECRET"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_resolve_join_reads_torchrun_only_without_peers(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("MASTER_ADDR", "localhost")
    clean_env.setenv("MASTER_PORT", "1000")
    plan = _join.resolve_join(None, None, secret=None, config=None, wait_for=None, overrides={})
    assert plan.bootstrap == ["tcp://127.0.0.1:1001"]
    assert plan.listen == "tcp://0.0.0.0:0"
    assert plan.peer_id == "rank2"
    assert plan.expected_peers == 4
    explicit = _join.resolve_join(
        ["mem://a"], None, secret="s", config=None, wait_for=None, overrides={"peer_id": "me"}
    )
    assert (explicit.bootstrap, explicit.listen, explicit.peer_id) == (["mem://a"], "mem://", "me")
    assert explicit.secret == b"s"
    assert explicit.expected_peers is None


def test_resolve_join_secret_from_env_and_bad_torchrun(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("GOSSIPNET_SECRET", "k")
    plan = _join.resolve_join([], None, secret=None, config=Config(), wait_for=3, overrides={})
    assert (plan.secret, plan.listen, plan.expected_peers) == (b"k", "tcp://127.0.0.1:0", 3)
    clean_env.setenv("RANK", "x")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="not integers"):
        _join.resolve_join(None, None, secret=None, config=None, wait_for=None, overrides={})


def test_stage_zeroes_nonfinite_and_writes_back() -> None:
    tensors = [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([[float("inf")]], dtype=torch.float64),
    ]
    cache = FlatCache()
    flat = cache.get(tensors)
    assert cache.get(tensors) is flat
    staged = _collective.stage(flat, tensors)
    assert staged.nonfinite
    for c in staged.cpu:
        c.fill_(3.0)
    staged.write_back(tensors)
    assert tensors[0].tolist() == [3.0, 3.0]
    assert tensors[1].tolist() == [[3.0]]
