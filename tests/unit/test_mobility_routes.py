"""Routes, contact windows and the radio model (gossipnet.mobility.routes / radio)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gossipnet.mobility.radio import RadioModel, exchange_probability, link_table, static_positions
from gossipnet.mobility.routes import CityGrid, Itinerary, Route, TrafficConfig, contact_windows


def crossing_routes() -> tuple[Route, Route]:
    """A drives east along y = 0, B north along x = 0; both pass the origin at t = 20 s."""
    a = Route(np.array([0.0, 40.0]), np.array([[-200.0, 0.0], [200.0, 0.0]]))
    b = Route(np.array([0.0, 40.0]), np.array([[0.0, -200.0], [0.0, 200.0]]))
    return a, b


def test_contact_window_of_crossing_routes_matches_hand_computation() -> None:
    # |AB| = sqrt(2) * |10 t - 200| <= 100  <=>  |t - 20| <= 5 * sqrt(2)
    a, b = crossing_routes()
    windows = contact_windows(a, b, 100.0)
    half = 5.0 * math.sqrt(2.0)
    np.testing.assert_allclose(windows, [[20.0 - half, 20.0 + half]], atol=1e-9)


def test_contact_windows_piecewise_routes_and_merging() -> None:
    # B waits at (50, 0) from t=0..10, then drives away east at 10 m/s, turns north at x=150.
    a = Route(np.array([0.0, 100.0]), np.array([[0.0, 0.0], [0.0, 0.0001]]))  # parked at origin
    b = Route(
        np.array([0.0, 10.0, 20.0, 30.0]),
        np.array([[50.0, 0.0], [50.0, 0.0], [150.0, 0.0], [150.0, 100.0]]),
    )
    # in range (<= 100 m) while x_b <= 100: t in [0, 15]; touching pieces are one window
    np.testing.assert_allclose(contact_windows(a, b, 100.0), [[0.0, 15.0]], atol=1e-6)
    # never within 10 m
    assert contact_windows(a, b, 10.0).shape == (0, 2)


def test_contact_windows_two_separate_contacts() -> None:
    # B drives past A twice (out and back), so two windows
    a = Route(np.array([0.0, 1.0]), np.array([[0.0, 0.0], [0.0, 0.0]]))
    b = Route(
        np.array([0.0, 40.0, 80.0]),
        np.array([[-200.0, 30.0], [200.0, 30.0], [-200.0, 30.0]]),
    )
    w = contact_windows(a, b, 50.0)
    # |x| <= 40 while passing at 10 m/s: 8 s each way, centred at t = 20 and t = 60
    np.testing.assert_allclose(w, [[16.0, 24.0], [56.0, 64.0]], atol=1e-9)


def test_contact_windows_agree_with_sampled_distances() -> None:
    rng = np.random.default_rng(3)
    city = CityGrid(blocks_x=3, blocks_y=3)
    it = [Itinerary.random(city, TrafficConfig(), rng, duration_s=300.0) for _ in range(2)]
    a, b = it[0].actual, it[1].actual
    windows = contact_windows(a, b, 120.0, start_s=0.0, end_s=300.0)
    t = np.linspace(0.0, 300.0, 30001)
    inside = np.linalg.norm(a.position(t) - b.position(t), axis=1) <= 120.0
    in_window = np.zeros_like(inside)
    for s, e in windows:
        in_window |= (t >= s) & (t <= e)
    # disagreement only within one sample of a window edge
    assert np.mean(inside != in_window) < 1e-3


def test_route_validation() -> None:
    with pytest.raises(ValueError, match="increasing"):
        Route(np.array([0.0, 0.0]), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="points"):
        Route(np.array([0.0, 1.0]), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="block"):
        CityGrid(blocks_x=0)
    with pytest.raises(ValueError, match="min_speed_mps"):
        TrafficConfig(min_speed_mps=5.0, max_speed_mps=4.0)
    with pytest.raises(ValueError, match="range_m"):
        RadioModel(range_m=0.0)


def test_itineraries_are_deterministic_and_stay_on_streets() -> None:
    city = CityGrid(blocks_x=4, blocks_y=3, block_m=80.0)

    def make(seed: int) -> Itinerary:
        return Itinerary.random(
            city, TrafficConfig(), np.random.default_rng(seed), duration_s=500.0
        )

    one, two, other = make(5), make(5), make(6)
    np.testing.assert_array_equal(one.actual.times_s, two.actual.times_s)
    np.testing.assert_array_equal(one.points_m, two.points_m)
    assert not np.array_equal(one.points_m[:5], other.points_m[:5])
    step = np.abs(np.diff(one.points_m, axis=0)).sum(axis=1)
    assert set(np.round(step, 6)) <= {0.0, 80.0}  # one block or a stop
    assert one.points_m.min() >= 0
    assert one.points_m[:, 0].max() <= 320.0
    assert one.actual.times_s[-1] >= 500.0
    longer = one.extended(city, TrafficConfig(), np.random.default_rng(1), 200.0)
    np.testing.assert_array_equal(longer.points_m[: len(one.points_m)], one.points_m)
    assert longer.actual.times_s[-1] >= one.actual.times_s[-1] + 200.0


def test_shared_route_is_exact_without_traffic_noise_and_starts_at_true_position() -> None:
    city = CityGrid()
    exact = Itinerary.random(
        city, TrafficConfig(duration_noise=0.0), np.random.default_rng(1), duration_s=400.0
    )
    shared = exact.shared_route(123.4)
    t = np.linspace(123.4, 300.0, 500)
    np.testing.assert_allclose(shared.position(t), exact.actual.position(t), atol=1e-6)
    noisy = Itinerary.random(
        city, TrafficConfig(duration_noise=0.3), np.random.default_rng(1), duration_s=400.0
    )
    pred = noisy.shared_route(50.0, horizon_s=30.0)
    np.testing.assert_allclose(pred.position(50.0), noisy.actual.position(50.0), atol=1e-9)
    assert pred.times_s[-1] >= 80.0
    assert len(pred.times_s) < len(noisy.actual.times_s)


def test_radio_model_shape() -> None:
    radio = RadioModel()
    d = np.linspace(0.0, 200.0, 401)
    rate, p = radio.rate_bytes_per_s(d), radio.delivery(d)
    assert np.all(np.diff(rate) <= 1e-9)
    assert np.all(np.diff(p) <= 1e-12)
    assert rate[0] == pytest.approx(radio.peak_rate_bytes_per_s)
    assert np.all(rate[d > radio.range_m] == 0)
    assert np.all(p[d > radio.range_m] == 0)
    assert radio.delivery(radio.half_loss_m) == pytest.approx(0.5)
    assert np.all(radio.hazard_per_s(d) >= 0)


def test_exchange_needs_a_long_enough_contact() -> None:
    a, b = crossing_routes()  # in 150 m range for |t - 20| <= 10.6 s
    radio = RadioModel()
    dur_small, p_small = exchange_probability(a, b, radio, 1e6, 15.0)
    assert dur_small < 5.0
    assert 0.9 < p_small <= 1.0
    dur_big, p_big = exchange_probability(a, b, radio, 2e7, 15.0)  # cannot fit in the window
    assert dur_big == math.inf
    assert p_big == 0.0
    dur_late, p_late = exchange_probability(a, b, radio, 1e6, 29.0)  # contact ends at ~30.6 s
    assert dur_late == math.inf
    assert p_late == 0.0
    # bigger models take longer and fail more often
    d1, p1 = exchange_probability(a, b, radio, 1e6, 12.0)
    d2, p2 = exchange_probability(a, b, radio, 3e6, 12.0)
    assert d2 > d1
    assert p2 < p1


def test_link_table_matches_pairwise_and_static_positions() -> None:
    a, b = crossing_routes()
    radio = RadioModel()
    t = 10.0 + 0.05 * np.arange(401)
    pos = np.stack([a.position(t), b.position(t), np.zeros((401, 2))])
    table = link_table(pos, radio, 2e6, 0.05, starts=20)
    assert table.pairs.tolist() == [[0, 1], [0, 2], [1, 2]]
    dur, prob = exchange_probability(a, b, radio, 2e6, 10.0)
    assert table.duration_s[0, 0] == pytest.approx(dur)
    assert table.probability[0, 0] == pytest.approx(prob)
    assert np.all(np.isinf(table.duration_s) == (table.probability == 0))
    frozen = static_positions(pos)
    assert np.all(frozen[:, 1:] == frozen[:, :1])
    still = link_table(frozen, radio, 2e6, 0.05, starts=20)
    # with frozen positions every start is the same
    np.testing.assert_allclose(still.duration_s, still.duration_s[:, :1].repeat(20, axis=1))
