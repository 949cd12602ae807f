"""The vehicle simulator (gossipnet.mobility.simulate): replays exactly, every strategy runs."""

from __future__ import annotations

import numpy as np
import pytest

from gossipnet.mobility._learning import Mlp, make_dataset
from gossipnet.mobility.routes import CityGrid
from gossipnet.mobility.simulate import STRATEGIES, Fleet, SimConfig, simulate

SMALL = {"vehicles": 8, "city": CityGrid(blocks_x=2, blocks_y=2), "rounds": 4, "model_bytes": 1e6}


def test_same_seed_same_trace_and_other_seed_differs() -> None:
    cfg = SimConfig(**SMALL, seed=3)
    for strategy in ("route", "sgp"):
        one, two = simulate(cfg, strategy), simulate(cfg, strategy, Fleet(cfg))
        for name in ("time_s", "accuracy", "loss", "consensus", "tried", "delivered"):
            np.testing.assert_array_equal(getattr(one, name), getattr(two, name))
    other = simulate(SimConfig(**SMALL, seed=4), "route")
    assert not np.array_equal(other.time_s, one.time_s)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_and_reports(strategy: str) -> None:
    trace = simulate(SimConfig(**SMALL), strategy)
    assert trace.strategy == strategy
    assert np.all(np.diff(trace.time_s) > 0)  # compute time at least, every round
    assert np.all(trace.delivered <= trace.tried)
    assert np.all((trace.accuracy >= 0) & (trace.accuracy <= 1))
    assert np.all(np.isfinite(trace.loss))
    assert np.all(trace.consensus >= 0)
    assert trace.rounds_to(2.0) == np.inf
    assert trace.seconds_to(0.0) == trace.time_s[0]


def test_unknown_strategy_and_bad_config() -> None:
    with pytest.raises(ValueError, match="strategy"):
        simulate(SimConfig(**SMALL), "flood")
    with pytest.raises(ValueError, match="vehicles"):
        SimConfig(vehicles=1)
    with pytest.raises(ValueError, match="model_bytes"):
        SimConfig(model_bytes=0.0)


def test_data_is_non_iid_and_the_model_gradient_is_right() -> None:
    data = make_dataset(4, classes_per_vehicle=2, per_vehicle=64, seed=0)
    assert [sorted(set(y.tolist())) for y in data.train_y] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    model = Mlp(data.dim, 8, data.classes)
    rng = np.random.default_rng(0)
    theta = np.stack([model.init(rng) for _ in range(2)])
    x, y = np.stack(data.train_x[:2])[:, :5], np.stack(data.train_y[:2])[:, :5]
    loss, grad = model.loss_grad(theta, x, y)
    for k in (0, 7, model.size - 1):
        bumped = theta.copy()
        bumped[:, k] += 1e-6
        np.testing.assert_allclose(
            (model.loss_grad(bumped, x, y)[0] - loss) / 1e-6, grad[:, k], atol=1e-5
        )


def test_averaging_only_mode_mixes_without_training() -> None:
    cfg = SimConfig(**{**SMALL, "rounds": 12})
    for strategy in ("route", "sgp"):
        trace = simulate(cfg, strategy, train=False)
        assert np.all(np.isnan(trace.accuracy))
        assert trace.consensus[-1] < trace.consensus[0]
        assert trace.rounds_to_consensus(trace.consensus[-1]) <= cfg.rounds
        assert trace.seconds_to_consensus(-1.0) == np.inf
