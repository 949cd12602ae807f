"""Gossip mixing under loss (gossipnet.mobility.mixing): means and masses are kept."""

from __future__ import annotations

import numpy as np
import pytest

from gossipnet.mobility.mixing import (
    consensus_error,
    matching_matrix,
    metropolis_weights,
    mix_matching,
    push_sum_step,
    sgp_hops,
    sgp_out_peers,
)
from gossipnet.mobility.topology import edge_colouring, fiedler_value, laplacian


def ring_with_chords(n: int) -> np.ndarray:
    edges = [(i, (i + 1) % n) for i in range(n)] + [(i, (i + n // 3) % n) for i in range(0, n, 4)]
    return np.unique(np.sort(np.array(edges), axis=1), axis=0)


def test_metropolis_weights_are_symmetric_doubly_stochastic_under_drops() -> None:
    rng = np.random.default_rng(0)
    edges = ring_with_chords(12)
    for _ in range(20):
        delivered = rng.random(len(edges)) < 0.6
        w = metropolis_weights(12, edges, delivered)
        np.testing.assert_allclose(w, w.T)
        np.testing.assert_allclose(w.sum(axis=0), 1.0)
        np.testing.assert_allclose(w.sum(axis=1), 1.0)
        assert np.all(w >= 0)
        failed = edges[~delivered]
        assert np.all(w[failed[:, 0], failed[:, 1]] == 0)


def test_symmetric_drops_conserve_the_sum() -> None:
    rng = np.random.default_rng(1)
    n, d = 30, 7
    x = rng.standard_normal((n, d))
    total = x.sum(axis=0)
    edges = ring_with_chords(n)
    matchings = edge_colouring(n, edges)
    for step in range(200):
        m = edges[matchings[step % len(matchings)]]
        delivered = rng.random(len(m)) < 0.5
        y = mix_matching(x, m, delivered)
        np.testing.assert_allclose(y, matching_matrix(n, m, delivered) @ x, atol=1e-12)
        x = y
        np.testing.assert_allclose(x.sum(axis=0), total, atol=1e-9)
    assert consensus_error(x) < 1e-3  # and it still converges


def test_one_sided_drops_break_symmetric_averaging_but_not_push_sum() -> None:
    rng = np.random.default_rng(2)
    n = 20
    x0 = rng.standard_normal((n, 3))
    # symmetric rule applied one-sidedly: i averages, j did not receive and keeps x_j
    x = x0.copy()
    for _ in range(50):
        perm = rng.permutation(n)
        pairs = perm.reshape(-1, 2)
        got_i = rng.random(len(pairs)) < 0.7  # j -> i arrived
        got_j = rng.random(len(pairs)) < 0.7  # i -> j arrived
        mean = 0.5 * (x[pairs[:, 0]] + x[pairs[:, 1]])
        xi = np.where(got_i[:, None], mean, x[pairs[:, 0]])
        xj = np.where(got_j[:, None], mean, x[pairs[:, 1]])
        x[pairs[:, 0]], x[pairs[:, 1]] = xi, xj
    assert not np.allclose(x.sum(axis=0), x0.sum(axis=0), atol=1e-3)
    # push-sum on the same pattern (both directions are one-sided links) keeps both sums
    x, w = x0.copy(), np.ones(n)
    for _ in range(200):
        pairs = rng.permutation(n).reshape(-1, 2)
        links = np.concatenate([pairs, pairs[:, ::-1]])
        x, w = push_sum_step(x, w, links, rng.random(len(links)) < 0.7)
        np.testing.assert_allclose(x.sum(axis=0), x0.sum(axis=0), atol=1e-9)
        assert w.sum() == pytest.approx(n)
    z = x / w[:, None]
    np.testing.assert_allclose(z, np.broadcast_to(x0.mean(axis=0), z.shape), atol=1e-6)


def test_undelivered_mass_stays_with_the_sender() -> None:
    x, w = np.array([[4.0], [0.0], [0.0]]), np.ones(3)
    x1, w1 = push_sum_step(x, w, np.array([[0, 1], [0, 2]]), np.array([True, False]))
    # 0 splits in three, one share reaches 1, the share for 2 is not discounted
    np.testing.assert_allclose(x1[:, 0], [8 / 3, 4 / 3, 0.0])
    np.testing.assert_allclose(w1, [2 / 3, 4 / 3, 1.0])


def test_sgp_conserves_mass_over_1000_rounds_with_loss() -> None:
    rng = np.random.default_rng(3)
    n = 64
    x, w = rng.standard_normal((n, 4)), np.ones(n)
    sx = x.sum(axis=0)
    for k in range(1000):
        links = sgp_out_peers(n, k)
        x, w = push_sum_step(x, w, links, rng.random(len(links)) < 0.8)
        # gradient-free check every round: both sums to 1e-6
        assert np.max(np.abs(x.sum(axis=0) - sx)) < 1e-6
        assert abs(w.sum() - n) < 1e-6
    np.testing.assert_allclose(x / w[:, None], np.broadcast_to(sx / n, (n, 4)), atol=1e-6)


def test_sgp_graph_is_the_authors_exponential_graph() -> None:
    assert sgp_hops(16) == [1, 2, 4, 8]
    assert sgp_hops(9, peers_per_itr=2) == [1, 2, 3, 6]
    links = sgp_out_peers(16, 2)
    np.testing.assert_array_equal(links[:, 1], (np.arange(16) + 4) % 16)
    assert sgp_out_peers(16, 5)[0].tolist() == [0, 2]  # rotates through 1, 2, 4, 8
    assert sgp_out_peers(9, 1, peers_per_itr=2)[:2].tolist() == [[0, 3], [0, 6]]
    with pytest.raises(ValueError, match="n >= 2"):
        sgp_hops(1)


@pytest.mark.parametrize(("n", "lo", "hi"), [(768, 12, 18), (900, 12, 18)])
def test_sgp_averaging_speed_matches_the_moshpit_table(n: int, lo: int, hi: int) -> None:
    """ALGORITHMS.md 2.6 / 4.4: SGP needs ~14-16 iterations to variance 1e-4 at 768-900
    nodes.  (At n = 512, a power of two, the exponential graph averages exactly in 9.)"""
    rng = np.random.default_rng(4)
    rounds = []
    for _ in range(3):
        x, w = rng.standard_normal((n, 1)), np.ones(n)
        for k in range(50):
            x, w = push_sum_step(x, w, sgp_out_peers(n, k))
            if np.var(x / w[:, None]) <= 1e-4:
                rounds.append(k + 1)
                break
    assert lo <= np.mean(rounds) <= hi


def test_static_graph_consensus_decays_as_fast_as_lambda2_predicts() -> None:
    """W = I - alpha L with alpha = 1 / (2 max weighted degree) has spectrum in [0, 1], so
    ||x_t - mean|| <= (1 - alpha lambda2)^t ||x_0 - mean||, at every t."""
    rng = np.random.default_rng(5)
    for n in (8, 20, 40):
        edges = ring_with_chords(n)
        weights = rng.uniform(0.2, 1.0, len(edges))  # link reliabilities
        lap = laplacian(n, edges, weights)
        alpha = 1.0 / (2.0 * np.max(np.diag(lap)))
        rate = 1.0 - alpha * fiedler_value(lap)
        mix = np.eye(n) - alpha * lap
        x = rng.standard_normal((n, 5))
        err0 = np.sqrt(consensus_error(x))
        for t in range(1, 200):
            x = mix @ x
            assert np.sqrt(consensus_error(x)) <= rate**t * err0 * (1 + 1e-9) + 1e-12
        np.testing.assert_allclose(x.sum(axis=0), (mix @ x).sum(axis=0), atol=1e-9)


def test_mix_matching_rejects_non_matchings() -> None:
    with pytest.raises(ValueError, match="matching"):
        mix_matching(np.zeros((3, 1)), np.array([[0, 1], [1, 2]]))
