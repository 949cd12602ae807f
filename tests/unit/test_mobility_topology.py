"""Fiedler values, matchings (mobility.topology) and the connectivity choice (.schedule)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gossipnet.mobility.radio import LinkTable, RadioModel, link_table
from gossipnet.mobility.routes import CityGrid
from gossipnet.mobility.schedule import Schedule, ScheduleConfig, plan_schedule
from gossipnet.mobility.simulate import Fleet, SimConfig
from gossipnet.mobility.topology import components, edge_colouring, fiedler_value, laplacian


def path(n: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(n - 1)]


@pytest.mark.parametrize("n", [2, 3, 5, 10, 17])
def test_fiedler_known_graphs(n: int) -> None:
    cycle = [*path(n), (n - 1, 0)] if n > 2 else path(n)
    complete = list(itertools.combinations(range(n), 2))
    assert fiedler_value(laplacian(n, path(n))) == pytest.approx(2 * (1 - np.cos(np.pi / n)))
    if n > 2:
        assert fiedler_value(laplacian(n, cycle)) == pytest.approx(2 * (1 - np.cos(2 * np.pi / n)))
    assert fiedler_value(laplacian(n, complete)) == pytest.approx(n)
    # weights scale it; two disjoint paths are disconnected: exactly 0
    assert fiedler_value(laplacian(n, path(n), np.full(n - 1, 0.5))) == pytest.approx(
        1 - np.cos(np.pi / n)
    )
    two = [*path(n), *[(a + n, b + n) for a, b in path(n)]]
    assert fiedler_value(laplacian(2 * n, two)) == pytest.approx(0.0, abs=1e-12)
    assert fiedler_value(laplacian(1, [])) == 0.0


def test_fiedler_is_batched() -> None:
    stack = np.stack([laplacian(4, path(4)), laplacian(4, [(0, 1)]), laplacian(4, [])])
    np.testing.assert_allclose(
        fiedler_value(stack), [2 * (1 - np.cos(np.pi / 4)), 0.0, 0.0], atol=1e-12
    )


def random_graph(rng: np.random.Generator) -> tuple[int, np.ndarray]:
    n = int(rng.integers(2, 40))
    iu, ju = np.triu_indices(n, k=1)
    keep = rng.random(iu.size) < rng.uniform(0.05, 0.9)
    edges = np.stack([iu[keep], ju[keep]], axis=1)[rng.permutation(int(keep.sum()))]
    flip = rng.random(len(edges)) < 0.5
    edges[flip] = edges[flip][:, ::-1]
    return n, edges


def test_edge_colouring_is_a_valid_cover_with_at_most_delta_plus_one_matchings() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, edges = random_graph(rng)
        matchings = edge_colouring(n, edges)
        used = np.sort(np.concatenate(matchings)) if matchings else np.empty(0, int)
        np.testing.assert_array_equal(used, np.arange(len(edges)))  # each edge exactly once
        for m in matchings:
            ends = edges[m].ravel()
            assert len(np.unique(ends)) == len(ends)  # no vertex twice
        if len(edges):
            assert len(matchings) <= np.bincount(edges.ravel()).max() + 1


def test_edge_colouring_edge_cases() -> None:
    assert edge_colouring(3, np.empty((0, 2), int)) == []
    # a star needs exactly Delta colours, a triangle Delta + 1
    assert len(edge_colouring(6, [(0, i) for i in range(1, 6)])) == 5
    assert len(edge_colouring(3, [(0, 1), (1, 2), (0, 2)])) == 3
    with pytest.raises(ValueError, match="simple"):
        edge_colouring(3, [(0, 1), (1, 0)])
    with pytest.raises(ValueError, match="simple"):
        edge_colouring(3, [(1, 1)])


def test_components() -> None:
    labels = components(6, [(0, 1), (1, 2), (4, 5)])
    assert labels[0] == labels[1] == labels[2] != labels[3]
    assert labels[4] == labels[5]
    assert len(set(labels.tolist())) == 3


def city_table(
    seed: int, *, model_bytes: float, blocks: int, vehicles: int = 20
) -> tuple[LinkTable, ScheduleConfig]:
    """The link table a route-aware scheduler sees at t = 100 s in a seeded city."""
    cfg = SimConfig(
        vehicles=vehicles,
        city=CityGrid(blocks_x=blocks, blocks_y=blocks),
        model_bytes=model_bytes,
        seed=seed,
    )
    fleet = Fleet(cfg)
    grid = 100.0 + cfg.dt_s * np.arange(int(cfg.schedule.budget_s / cfg.dt_s) + 1)
    pos = fleet.predicted_positions(100.0, grid)
    return link_table(pos, cfg.radio, 2 * model_bytes, cfg.dt_s), cfg.schedule


def check_schedule(sched: Schedule, config: ScheduleConfig) -> None:
    feasible = {tuple(e) for e in sched.feasible_edges.tolist()}
    seen: set[tuple[int, int]] = set()
    end = 0.0
    for phase in sched.phases:
        ends = phase.edges.ravel()
        assert len(np.unique(ends)) == len(ends)  # a matching
        assert phase.start_s >= end - 1e-9  # phases run one after another
        end = phase.start_s + phase.duration_s
        for e in map(tuple, np.sort(phase.edges, axis=1).tolist()):
            assert e in feasible
            assert e not in seen
            seen.add(e)
        assert np.all(phase.probability >= config.min_probability)
    assert sched.total_s <= config.budget_s + 1e-9
    # the decomposition covers the feasible graph with matchings
    cover = np.sort(np.concatenate(sched.matchings)) if sched.matchings else np.empty(0, int)
    np.testing.assert_array_equal(cover, np.arange(len(sched.feasible_edges)))


@pytest.mark.parametrize("seed", range(6))
def test_schedule_is_valid_and_union_beats_each_of_its_matchings(seed: int) -> None:
    table, config = city_table(seed, model_bytes=0.5e6, blocks=2)
    sched = plan_schedule(table, config)
    check_schedule(sched, config)
    assert sched.phases
    union = fiedler_value(sched.expected_laplacian())
    for phase in sched.phases:
        alone = fiedler_value(laplacian(table.n, phase.edges, phase.probability))
        assert union >= alone - 1e-12
    assert union > 0  # a dense city: the chosen phases join everyone


def test_choice_beats_random_choices_of_the_same_size_when_clusters_can_be_joined() -> None:
    """lambda2 (summed over clusters) of the choice >= every random choice, 10 cities."""
    for seed in range(10):
        table, config = city_table(seed, model_bytes=0.5e6, blocks=3)
        best = plan_schedule(table, config)
        check_schedule(best, config)
        rng = np.random.default_rng(seed)
        for _ in range(20):
            rand = plan_schedule(table, config, max_phases=len(best.phases), rng=rng)
            check_schedule(rand, config)
            assert best.connectivity() >= rand.connectivity() - 1e-12
            assert best.score >= rand.score - 1e-12


def test_choice_against_random_choices_with_heavy_models() -> None:
    """With 8 MB exchanges only 1-3 phases fit a round and most clusters cannot be joined:
    the objective still beats nearly every random same-budget choice, and lambda2 beats
    their average (the beam search is a heuristic, not an exact optimum)."""
    worse, total = 0, 0
    for seed in range(8):
        table, config = city_table(seed, model_bytes=4e6, blocks=3)
        best = plan_schedule(table, config)
        rng = np.random.default_rng(seed)
        rands = [plan_schedule(table, config, rng=rng) for _ in range(20)]
        worse += sum(r.score > best.score + 1e-12 for r in rands)
        total += len(rands)
        assert best.connectivity() >= np.mean([r.connectivity() for r in rands]) - 1e-12
    assert worse <= 0.02 * total


def test_schedule_is_deterministic_and_empty_when_nobody_is_in_range() -> None:
    table, config = city_table(4, model_bytes=1e6, blocks=3)
    one, two = plan_schedule(table, config), plan_schedule(table, config)
    assert len(one.phases) == len(two.phases)
    for a, b in zip(one.phases, two.phases, strict=True):
        np.testing.assert_array_equal(a.edges, b.edges)
        assert a.start_s == b.start_s
        assert a.duration_s == b.duration_s
    far = np.arange(3)[:, None, None] * np.array([1000.0, 0.0]) + np.zeros((3, 40, 2))
    empty = plan_schedule(link_table(far, RadioModel(), 1e6, 0.25), config)
    assert empty.phases == ()
    assert empty.total_s == 0.0
    assert empty.connectivity() == 0.0


def test_schedule_config_validation() -> None:
    with pytest.raises(ValueError, match="budget_s"):
        ScheduleConfig(budget_s=0.0)
    with pytest.raises(ValueError, match="min_probability"):
        ScheduleConfig(min_probability=1.0)
    with pytest.raises(ValueError, match="merge_weight"):
        ScheduleConfig(merge_weight=-0.1)


@pytest.mark.timeout(60)
def test_planning_100_vehicles_takes_well_under_a_second_of_cpu() -> None:
    """Issue 7: link table + schedule for 100 vehicles "in well under a second" per
    round.  Measured in process CPU time (immune to other programs' load); the bound
    is the issue's 1 s, the bench prints the typical figure (a few hundred ms)."""
    import time

    from gossipnet.mobility.routes import CityGrid as Grid

    cfg = SimConfig(vehicles=100, city=Grid(blocks_x=8, blocks_y=8), seed=3)
    fleet = Fleet(cfg)
    t0 = 60.0
    grid = t0 + cfg.dt_s * np.arange(int(cfg.schedule.budget_s / cfg.dt_s) + 1)
    fleet.predicted_positions(t0, grid)  # warm-up: imports, caches
    start = time.process_time()
    pos = fleet.predicted_positions(t0, grid)
    sched = plan_schedule(link_table(pos, cfg.radio, 2 * cfg.model_bytes, cfg.dt_s), cfg.schedule)
    cpu = time.process_time() - start
    assert sched.phases, "100 vehicles in an 8x8 city always have some feasible link"
    assert cpu < 1.0, f"planning took {cpu:.2f} s of CPU"
