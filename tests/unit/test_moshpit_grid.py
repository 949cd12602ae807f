"""Moshpit's grid, shift-register keys and round plans (ALGORITHMS.md 2.1-2.3, 2.7.1).

Pure functions, no network: the plan every peer derives from its view, and
the simulator of 2.6 (NaN-mean along the averaged axis over alive nodes)
driven by these plans, so the tests check the maths independently of the
matchmaking protocol.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipnet.collectives.moshpit.grid import (
    Grid,
    GroupKey,
    choose_grid,
    group_id,
    group_permutation,
    initial_keys,
    plan_round,
)

SEED = "run-a"


def view(n: int) -> list[str]:
    return [f"p{i}" for i in range(n)]


# --------------------------------------------------------------------------- grid choice
@pytest.mark.parametrize(
    ("n", "max_group", "side", "dims"),
    [
        (1, 32, 1, 1),
        (16, 32, 16, 1),  # fits one group: a plain all-reduce, exact in one round
        (16, 4, 4, 2),
        (64, 8, 8, 2),
        (64, 4, 4, 3),
        (900, 64, 32, 2),  # ALGORITHMS.md 2.3: 88 % full
        (1024, 32, 32, 2),
        (100, 32, 10, 2),  # no power of two is >= 75 % full: any side
        (500, 32, 23, 2),  # one round fewer than 2.3's 8x8x8, 94.5 % full
    ],
)
def test_choose_grid(n: int, max_group: int, side: int, dims: int) -> None:
    g = choose_grid(n, max_group_size=max_group)
    assert (g.side, g.dims) == (side, dims)
    assert g.cells >= n
    assert g.side <= max_group


@given(st.integers(1, 5000), st.sampled_from([2, 4, 8, 16, 32, 64]))
def test_choose_grid_always_fits(n: int, max_group: int) -> None:
    g = choose_grid(n, max_group_size=max_group)
    assert g.cells >= n
    assert 1 <= g.side <= max(max_group, 1)
    assert g.side ** (g.dims - 1) < n or g.dims == 1  # no needless dimension


def test_choose_grid_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_grid(0)
    with pytest.raises(ValueError, match="max_group_size"):
        choose_grid(10, max_group_size=1)
    with pytest.raises(ValueError, match="min_fill"):
        choose_grid(10, min_fill=0)


# --------------------------------------------------------------------------- keys
def test_group_members_derive_the_same_permutation_and_distinct_new_bits() -> None:
    """2.7.1: same permutation on every member, distinct new indices, same key length."""
    side = 8
    members = [GroupKey((pos, 3, 5), side) for pos in range(side)]  # one full group
    gid = group_id(SEED, 7, members[0].key)
    assert all(group_id(SEED, 7, m.key) == gid for m in members)
    perms = {group_permutation(gid, side) for _ in members}
    assert len(perms) == 1
    assert sorted(next(iter(perms))) == list(range(side))
    new = [m.advance(gid) for m in members]
    assert all(len(k.slots) == 3 and len(k.bits()) == 2 * 3 for k in new)  # 2 slots x 3 bits
    assert len({k.slots[-1] for k in new}) == side  # distinct newest index
    assert len({k.bits() for k in new}) == side  # distinct keys next round
    assert all(k.slots[:2] == (3, 5) for k in new)  # the register shifted
    # another group or round draws another permutation (with overwhelming probability)
    assert group_permutation(group_id(SEED, 8, members[0].key), side) != perms.pop()


def test_bits_are_hivemind_style() -> None:
    assert GroupKey((1, 2, 3), 4).bits() == "1011"  # key (2, 3), 2 bits each
    assert GroupKey((5,), 8).bits() == ""  # d = 1: one global bucket
    assert GroupKey((0, 4), 10).bits() == "4"  # M not a power of two: decimal


@pytest.mark.parametrize(("side", "dims"), [(4, 2), (4, 3), (8, 2), (3, 3)])
def test_full_grid_cells_are_a_permutation(side: int, dims: int) -> None:
    grid = Grid(side, dims)
    keys = initial_keys(view(grid.cells), grid, SEED, sweep=0)
    assert len({k.slots for k in keys.values()}) == grid.cells


def test_consistent_hashing_moves_few_peers_when_one_is_missing() -> None:
    grid = Grid(8, 2)
    peers = view(48)  # 75 % full
    full = initial_keys(peers, grid, SEED, 0)
    less = initial_keys([p for p in peers if p != "p7"], grid, SEED, 0)
    moved = sum(full[p] != less[p] for p in less)
    assert moved <= 12, moved  # a reshuffle would move about all 47


# --------------------------------------------------------------------------- plans
@pytest.mark.parametrize(("side", "dims"), [(4, 2), (4, 3), (8, 2), (2, 5)])
def test_full_grid_groups_are_lines_of_m(side: int, dims: int) -> None:
    grid = Grid(side, dims)
    for t in range(2 * dims):
        plan = plan_round(view(grid.cells), t, seed=SEED, grid=grid)
        assert sorted(len(g) for g in plan.groups) == [side] * (grid.cells // side)
        assert sorted(itertools.chain(*plan.groups)) == sorted(view(grid.cells))
        for g, lead in zip(plan.groups, plan.leaders, strict=True):
            assert lead in g
            assert all(plan.leader_of(p) == lead and plan.group_of(p) == g for p in g)


def test_peers_that_met_meet_along_a_new_axis() -> None:
    grid = Grid(4, 3)
    peers = view(64)
    for t in range(5):
        now = plan_round(peers, t, seed=SEED, grid=grid)
        nxt = plan_round(peers, t + 1, seed=SEED, grid=grid)
        if (t + 1) % grid.dims == 0:
            continue  # a new sweep starts from fresh cells
        for g in now.groups:
            # members of one group are in distinct groups next round
            assert len({nxt.group_of(p) for p in g}) == len(g)


def simulate(
    n: int, grid: Grid, rounds: int, p_fail: float, seed: int, stop: float = 0.0
) -> list[float]:
    """2.6's simulator on our plans: per round each node fails with ``p_fail``
    (keeps its value); a group averages over its alive members.  Variances
    per round; ends early once below ``stop``."""
    rng = random.Random(seed)
    peers = view(n)
    x = dict(
        zip(
            peers,
            torch.randn(n, generator=torch.Generator().manual_seed(seed)).tolist(),
            strict=True,
        )
    )
    mean = sum(x.values()) / n
    out = [sum((v - mean) ** 2 for v in x.values()) / n]
    for t in range(rounds):
        plan = plan_round(peers, t, seed=SEED, grid=grid)
        for g in plan.groups:
            alive = [p for p in g if rng.random() >= p_fail]
            if alive:
                avg = sum(x[p] for p in alive) / len(alive)
                for p in alive:
                    x[p] = avg
        out.append(sum((v - mean) ** 2 for v in x.values()) / n)
        if out[-1] < stop:
            break
    return out


@pytest.mark.parametrize(("side", "dims"), [(4, 2), (8, 2), (4, 3), (32, 2)])
def test_exact_mean_after_d_rounds_on_a_full_grid(side: int, dims: int) -> None:
    grid = Grid(side, dims)
    var = simulate(grid.cells, grid, dims, 0.0, seed=1)
    assert var[-1] < 1e-24 * var[0] + 1e-28


@settings(deadline=None, max_examples=20)
@given(st.integers(2, 200), st.integers(0, 3))
def test_any_view_converges_geometrically(n: int, seed: int) -> None:
    """Partial grids are not exact, but the variance still shrinks every sweep."""
    grid = choose_grid(n, max_group_size=8)
    var = simulate(n, grid, 6 * grid.dims, 0.0, seed)
    assert var[-1] <= 1e-6 * var[0] + 1e-20


def test_simulated_rate_under_failures_is_near_one_over_m() -> None:
    """2.6/2.7.2: 1024 = 32^2, p = 0.005: variance falls about 1/M per round, and
    the moshpit-sgd table's 1e-9 target is reached in a few rounds (paper: 5-9)."""
    grid = Grid(32, 2)
    rates = []
    hit = []
    for seed in range(3):
        var = simulate(1024, grid, 8, 0.005, seed)
        rates.append(var[1] / var[0])
        hit.append(next(t for t, v in enumerate(var) if v <= 1e-9 * var[0]))
    assert max(rates) < 2.0 / 32
    assert max(hit) <= 6


@pytest.mark.parametrize(("n", "p_fail", "paper"), [(768, 0.01, 6.9), (900, 0.0, 5.0)])
def test_moshpit_sgd_table_reproduces_within_one_iteration(
    n: int, p_fail: float, paper: float
) -> None:
    """2.6's table (32x32 grid, scalars ~ N(0, 1)): mean iterations to variance 1e-9."""
    iters = [len(simulate(n, Grid(32, 2), 50, p_fail, seed, stop=1e-9)) - 1 for seed in range(4)]
    assert abs(sum(iters) / len(iters) - paper) <= 1.0, iters
