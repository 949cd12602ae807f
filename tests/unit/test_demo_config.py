"""DemoConfig's late-loss option: loss-free steps first, then the plan's loss."""

from __future__ import annotations

import pytest

from gossipnet._demo import DemoConfig, LateLoss


def test_late_loss_is_off_until_switched_on() -> None:
    cfg = DemoConfig(loss=0.1, loss_from=200, steps=300)
    late = LateLoss(cfg.loss)
    plan = cfg.fault_plan(late)
    assert plan is not None
    assert plan.link_loss is late
    assert plan.link_loss("a", "b", 0.0) == 0.0
    late.on = True
    assert plan.link_loss("a", "b", 0.0) == 0.1
    assert "from step 200" in cfg.label()
    # without the switch (or without loss_from) the plan is the plain Bernoulli one
    assert DemoConfig(loss=0.1).fault_plan() == DemoConfig(loss=0.1).fault_plan(None)
    assert DemoConfig(loss=0.0, loss_from=5).fault_plan(late) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": 0.1, "loss_from": 300, "steps": 300},
        {"loss": 0.1, "loss_from": -1},
        {"loss": 0.1, "loss_from": 10, "burst": 8.0},
    ],
    ids=["past-the-end", "negative", "bursty"],
)
def test_bad_late_loss_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="loss_from"):
        DemoConfig(**kwargs)  # type: ignore[arg-type]
