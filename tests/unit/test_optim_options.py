"""Optimizer strategies as objects: options values, keyword mapping, the host protocol.

``net.optimizer(base, strategy=..., **kwargs)`` maps today's keywords onto a
frozen options value; an options value may be passed instead.  The strategies
reach the peer only through ``TrainingHost``, so they run on a stub host too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import pytest
import torch

import gossipnet
from gossipnet.collectives.moshpit.averager import SWEEP_STRIDE
from gossipnet.reports import CollectiveReport
from gossipnet.testing import run_peers
from gossipnet.training.options import resolve
from gossipnet.training.route import RouteStrategy

from ..conftest import FAST

T = TypeVar("T")


def test_historical_keywords_map_onto_the_options_fields() -> None:
    assert resolve("allreduce", {}) == gossipnet.AllReduceOptions()
    assert resolve("allreduce", {"resync_every_steps": 5, "timeout": 2.0}) == (
        gossipnet.AllReduceOptions(resync_every_steps=5, timeout_s=2.0)
    )
    got = resolve(
        "moshpit",
        {
            "average_every": 4,
            "checkpoint": "/tmp/x.pt",
            "checkpoint_every": 10,
            "sync_timeout": 5.0,
            "timeout": 3.0,
            "group_size": 4,
        },
    )
    assert got == gossipnet.MoshpitOptions(
        average_every=4,
        checkpoint_path="/tmp/x.pt",
        checkpoint_every_steps=10,
        sync_timeout_s=5.0,
        timeout_s=3.0,
        group_size=4,
    )
    assert resolve("route", {"rounds": 2, "average_state": True}) == gossipnet.RouteOptions(
        rounds=2, average_state=True
    )
    # field names work as keywords too
    assert resolve("moshpit", {"checkpoint_every_steps": 3}).checkpoint_every_steps == 3  # type: ignore[union-attr]


def test_keywords_that_never_applied_are_still_accepted_and_ignored() -> None:
    """Before: GossipOptimizer took ``average_every`` and ``resync_every_steps`` for every
    strategy and ignored those that did not apply; code passing them keeps working."""
    assert resolve("allreduce", {"average_every": 3}) == gossipnet.AllReduceOptions()
    assert resolve("moshpit", {"resync_every_steps": 3}) == gossipnet.MoshpitOptions()
    assert resolve("route", {"timeout": 1.0}) == gossipnet.RouteOptions()


def test_an_unknown_keyword_names_the_accepted_ones() -> None:
    with pytest.raises(gossipnet.ConfigError, match="group_size") as err:
        resolve("route", {"group_size": 4})
    assert "average_every" in str(err.value)
    assert "rounds" in str(err.value)
    with pytest.raises(gossipnet.ConfigError, match=r"resync_every_steps.*timeout_s"):
        resolve("allreduce", {"resync_every": 4})
    with pytest.raises(gossipnet.ConfigError, match="'allreduce', 'moshpit', 'route'"):
        resolve("rout", {})
    with pytest.raises(gossipnet.ConfigError, match="given twice"):
        resolve("moshpit", {"timeout": 1.0, "timeout_s": 2.0})
    with pytest.raises(gossipnet.ConfigError, match="beside a MoshpitOptions"):
        resolve(gossipnet.MoshpitOptions(), {"rounds": 2})


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (gossipnet.AllReduceOptions, {"resync_every_steps": -1}, "resync_every_steps"),
        (gossipnet.AllReduceOptions, {"timeout_s": 0.0}, "timeout_s"),
        (gossipnet.MoshpitOptions, {"average_every": 0}, "average_every"),
        (gossipnet.MoshpitOptions, {"rounds": 0}, "rounds"),
        (gossipnet.MoshpitOptions, {"checkpoint_every_steps": -1}, "checkpoint_every"),
        (gossipnet.MoshpitOptions, {"group_size": 1}, "group_size"),
        (gossipnet.MoshpitOptions, {"sync_timeout_s": -1.0}, "sync_timeout_s"),
        (gossipnet.RouteOptions, {"rounds": 0}, "rounds"),
    ],
)
def test_options_reject_bad_values_when_built(cls: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):  # a ConfigError, which is a ValueError
        cls(**kwargs)


def test_options_are_frozen_keyword_only_values() -> None:
    opts = gossipnet.MoshpitOptions(average_every=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.average_every = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        gossipnet.RouteOptions(2)  # type: ignore[misc]
    assert dataclasses.replace(opts, rounds=2).rounds == 2


def test_an_options_value_selects_the_strategy() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> tuple[str, list[str], dict[str, Any]]:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.zeros(3))
        opts = gossipnet.MoshpitOptions(average_every=2, sync_state=False)
        opt = peer.optimizer(torch.optim.SGD([w], lr=0.1), strategy=opts)
        methods = []
        for _ in range(4):
            opt.zero_grad()
            (w * (rank + 1)).sum().backward()
            methods.append(opt.step().method)
        return opt.strategy.name, methods, opt.state_dict()

    for name, methods, state in run_peers(2, body, timeout_s=40, **FAST):
        assert name == "moshpit"
        assert methods == ["local", "moshpit", "local", "moshpit"]
        assert state["step_count"] == 4


class _StubHost:
    """A ``TrainingHost`` with no network: averaging records its calls."""

    def __init__(self) -> None:
        self.peer_id = "solo"
        self.config = gossipnet.Config(**FAST)
        self.statesync = self.moshpit = self.route = self.replicas = None
        self.last_stepper: int | None = None
        self.averaged: list[tuple[int | None, float]] = []

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        raise AssertionError("no loop call expected")

    def take_microbatch_report(self) -> None:
        return None

    def moshpit_average(
        self, tensors: Sequence[torch.Tensor], *, start_round: int | None, weight: float, **_: Any
    ) -> CollectiveReport:
        self.averaged.append((start_round, weight))
        return CollectiveReport(method="moshpit", participants=("solo",))


def test_the_moshpit_strategy_runs_on_any_training_host() -> None:
    """The training layer knows no Peer: a stub host is enough to train, average on
    schedule and checkpoint (no statesync: nothing to publish or download)."""
    host = _StubHost()
    w = torch.nn.Parameter(torch.ones(2))
    opts = gossipnet.MoshpitOptions(average_every=3)
    opt = gossipnet.GossipOptimizer(host, torch.optim.SGD([w], lr=0.5), opts)  # type: ignore[arg-type]
    methods = []
    for _ in range(6):
        opt.zero_grad()
        w.sum().backward()
        methods.append(opt.step().method)
    assert methods == ["local", "local", "moshpit"] * 2
    assert host.averaged == [(SWEEP_STRIDE, 1.0), (2 * SWEEP_STRIDE, 1.0)]  # sweeps 1, 2
    torch.testing.assert_close(w.detach(), torch.full((2,), 1.0 - 6 * 0.5))
    assert opt.step_count == 6
    assert opt.last_sync is None
    assert opt.last_resync is None


def test_the_route_strategy_needs_a_route_on_its_host() -> None:
    host = _StubHost()
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(gossipnet.ConfigError, match="set_route"):
        RouteStrategy(host, torch.optim.SGD([w], lr=0.1), gossipnet.RouteOptions())  # type: ignore[arg-type]


def test_the_training_layer_never_imports_the_facade() -> None:
    """training/ reaches a peer only through ``TrainingHost``: no import of the facade
    (``peer``, ``_core``, ``_collective``, the adapter), TYPE_CHECKING ones included."""
    import ast
    from pathlib import Path

    facade = {"gossipnet", "gossipnet.peer", "gossipnet._core", "gossipnet._collective"}
    facade.add("gossipnet._training_host")
    root = Path(gossipnet.__file__).parent / "training"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            assert not names & facade, (path.name, sorted(names & facade))
