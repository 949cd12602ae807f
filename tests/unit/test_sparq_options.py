"""``compress=gossipnet.SparQ(...)``: accepted by the gossip strategies, refused elsewhere
with a ConfigError that names what is accepted."""

from __future__ import annotations

import pytest

from gossipnet import ConfigError, MoshpitOptions, RouteOptions, SparQ
from gossipnet.training.options import resolve


def test_gossip_strategies_take_sparq() -> None:
    s = SparQ(density=0.1)
    assert resolve("moshpit", {"compress": s}) == MoshpitOptions(compress=s)
    assert resolve("route", {"compress": s, "average_every": 2}).compress is s  # type: ignore[union-attr]
    assert MoshpitOptions().compress is None
    assert RouteOptions().compress is None


def test_sparq_with_the_allreduce_names_the_gossip_strategies() -> None:
    with pytest.raises(
        ConfigError, match=r"SparQ works with the gossip strategies.*moshpit.*route"
    ):
        resolve("allreduce", {"compress": SparQ()})


@pytest.mark.parametrize("strategy", ["moshpit", "route"])
@pytest.mark.parametrize("bad", ["bf16", 0.01, object()])
def test_other_compressors_on_gossip_strategies_name_sparq(strategy: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"accepts compress=gossipnet.SparQ\(...\) or None"):
        resolve(strategy, {"compress": bad})


def test_sparq_refuses_optimizer_state_gossip() -> None:
    with pytest.raises(ConfigError, match="parameters only"):
        MoshpitOptions(compress=SparQ(), average_state=True)
    with pytest.raises(ConfigError, match="parameters only"):
        RouteOptions(compress=SparQ(), average_state=True)
