"""Blink tree packing: exact rates, MWU within 1%, few trees, capacities (ALGORITHMS.md 5.4).

networkx is the independent reference for min cuts and spanning-tree checks.
"""

from __future__ import annotations

import functools

import networkx as nx
import numpy as np
import pytest

from gossipnet.collectives.blink import packing as P
from gossipnet.collectives.blink._graph import (
    cut_rows,
    max_flow,
    min_arborescence,
    partition_bound,
    partition_rows,
)
from gossipnet.collectives.blink._lp import max_sum
from gossipnet.collectives.blink.ring import best_ring, ring_model
from gossipnet.collectives.blink.topology import parse_topo_matrix

from ._blink_fixtures import FIXTURES, SUBSETS, allocation, dgx1v

SEED = 20260508


def _nx_min_cut(cap: np.ndarray, root: int) -> float:
    g = nx.DiGraph()
    k = cap.shape[0]
    g.add_nodes_from(range(k))
    for u, v in zip(*np.nonzero(cap), strict=True):
        g.add_edge(int(u), int(v), capacity=float(cap[u, v]))
    return min(nx.minimum_cut(g, root, v)[0] for v in range(k) if v != root)


def _random_caps(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(n):
        k = int(rng.integers(2, 7))
        cap = rng.uniform(1.0, 50.0, (k, k)) * (rng.random((k, k)) < 0.7)
        np.fill_diagonal(cap, 0.0)
        out.append(cap)
    return out


@functools.cache
def _bcast(machine: str, sub: tuple[int, ...], max_trees: int | None = 6) -> P.Packing:
    return P.pack_broadcast(allocation(machine, sub), 0, max_trees=max_trees)


@functools.cache
def _allr(machine: str, sub: tuple[int, ...]) -> P.Packing:
    return P.pack_allreduce(allocation(machine, sub))


def _assert_spans(packing: P.Packing) -> None:
    for t in packing.trees:
        g = nx.DiGraph()
        g.add_nodes_from(range(packing.k))
        g.add_edges_from(t.edges)
        assert nx.is_arborescence(g), t
        assert t.parent[t.root] == -1
        assert t.rate > 0


# ------------------------------------------------------------------ graph primitives
def test_max_flow_and_arborescence_match_networkx() -> None:
    rng = np.random.default_rng(SEED)
    for cap in _random_caps(25):
        k = cap.shape[0]
        for v in range(1, k):
            g = nx.DiGraph()
            g.add_nodes_from(range(k))
            for a, b in zip(*np.nonzero(cap), strict=True):
                g.add_edge(int(a), int(b), capacity=float(cap[a, b]))
            assert max_flow(cap, 0, v) == pytest.approx(nx.maximum_flow_value(g, 0, v))
        length = np.where(cap > 0, rng.random(cap.shape), np.inf)
        parent = min_arborescence(length, 0)
        if P.broadcast_min_cut(cap, 0) == 0:
            assert parent is None
            continue
        g = nx.DiGraph()
        for a, b in zip(*np.nonzero(np.isfinite(length)), strict=True):
            if b != 0:
                g.add_edge(int(a), int(b), weight=float(length[a, b]))
        ref = nx.minimum_spanning_arborescence(g)
        want = sum(d["weight"] for _, _, d in ref.edges(data=True))
        assert parent is not None
        assert sum(length[parent[v], v] for v in range(1, k)) == pytest.approx(want)


def test_cut_and_partition_rows_give_the_exact_optima() -> None:
    for cap in _random_caps(15):
        k = cap.shape[0]
        m, _ = cut_rows(k, 0)
        assert (m @ cap.ravel()).min() == pytest.approx(_nx_min_cut(cap, 0))
        u = np.minimum(cap, cap.T)
        m, d = partition_rows(k)
        assert ((m @ u.ravel()) / d).min() == pytest.approx(partition_bound(u))


def test_simplex_optimum_and_duals() -> None:
    a = np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    res = max_sum(a, np.array([3.0, 2.0, 2.0]))
    assert res.value == pytest.approx(3.0)
    assert (a @ res.x <= np.array([3.0, 2.0, 2.0]) + 1e-9).all()
    assert res.y @ np.array([3.0, 2.0, 2.0]) == pytest.approx(3.0)  # strong duality


# ------------------------------------------------------------------ broadcast packing
def test_dgx1v_full_broadcast_from_gpu0_is_six_links() -> None:
    cap = dgx1v()
    assert P.broadcast_min_cut(cap, 0) == pytest.approx(150.0)
    mwu = _bcast("v100", tuple(range(8)), None)
    assert mwu.min_cut == pytest.approx(150.0)
    assert mwu.rate >= 0.99 * 150.0
    few = _bcast("v100", tuple(range(8)))
    assert few.rate == pytest.approx(150.0)  # Edmonds: 6 disjoint link-units exist
    assert len(few.trees) <= 6
    for p in (mwu, few):
        assert P.fits(p, cap, "down")
        assert P.fits(p, cap, "up")  # the reduce trees: edges reversed
        _assert_spans(p)


def test_mwu_within_one_percent_of_networkx_min_cut_on_random_graphs() -> None:
    for cap in _random_caps(12):
        ref = _nx_min_cut(cap, 0)
        mwu = P.pack_broadcast(cap, 0, max_trees=None)
        assert mwu.min_cut == pytest.approx(ref)
        if ref == 0:
            assert mwu.trees == ()
            continue
        assert ref * (1 + 1e-9) >= mwu.rate >= 0.99 * ref
        assert P.fits(mwu, cap, "down")
        _assert_spans(mwu)
        few = P.pack_broadcast(cap, 0)
        assert len(few.trees) <= 6
        assert few.rate >= 0.95 * ref
        assert P.fits(few, cap, "down")
        _assert_spans(few)


@pytest.mark.parametrize("machine", ["v100", "p100"])
@pytest.mark.parametrize("sub", SUBSETS)
def test_allocations_pack_at_the_min_cut(machine: str, sub: tuple[int, ...]) -> None:
    cap = allocation(machine, sub)
    few = _bcast(machine, sub)
    ref = _nx_min_cut(cap, 0)
    assert few.min_cut == pytest.approx(ref)
    assert few.rate == pytest.approx(ref, rel=0.01, abs=1e-9)
    assert len(few.trees) <= max(6, len(sub) - 1)
    assert P.fits(few, cap, "down")
    assert P.fits(few, cap, "up")
    _assert_spans(few)
    ar = _allr(machine, sub)
    assert P.fits(ar, cap, "both")
    assert len(ar.trees) <= max(6, len(sub) - 1)
    if ar.min_cut == 0:
        assert ar.trees == ()
    else:
        assert ar.rate >= 0.95 * ar.min_cut
        _assert_spans(ar)


def test_disconnected_allocation_has_no_trees() -> None:
    cap = allocation("v100", (0, 1, 6))  # 6 has no NVLink to 0 or 1
    assert P.pack_broadcast(cap, 0).rate == 0.0
    assert P.pack_allreduce(cap).trees == ()


def test_nvswitch_gets_one_hop_stars_at_the_bound() -> None:
    topo = parse_topo_matrix((FIXTURES / "dgx-a100-nvswitch.txt").read_text())
    cap = topo.capacity_matrix()
    ar = P.pack_allreduce(cap)
    assert len(ar.trees) == 8
    assert all(t.height == 1 for t in ar.trees)
    assert ar.rate == pytest.approx(ar.min_cut)
    assert P.fits(ar, cap, "both")


@pytest.mark.parametrize(
    "name",
    ["dgx1-v100.txt", "dgx1-p100.txt", "rtx-a6000-partial-nvlink.txt", "pcie-only-8x-rtx4090.txt"],
)
def test_fixture_islands_pack_at_the_min_cut(name: str) -> None:
    topo = parse_topo_matrix((FIXTURES / name).read_text())
    for island in topo.islands():
        cap = topo.capacity_matrix(island)
        if len(island) == 1:
            continue
        few = P.pack_broadcast(cap, 0)
        assert few.rate == pytest.approx(_nx_min_cut(cap, 0), rel=0.01)
        assert P.fits(few, cap, "down")
        assert P.fits(few, cap, "up")
        ar = P.pack_allreduce(cap)
        assert ar.rate >= 0.95 * ar.min_cut > 0
        assert P.fits(ar, cap, "both")


def test_bad_capacity_matrix_is_rejected() -> None:
    with pytest.raises(ValueError, match="k x k"):
        P.pack_broadcast(np.zeros((2, 3)), 0)
    with pytest.raises(ValueError, match="finite"):
        P.pack_allreduce(np.array([[0.0, -1.0], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="root"):
        P.pack_broadcast(np.zeros((2, 2)), 5)


# ------------------------------------------------------------------ ring model
def test_ring_falls_back_to_pcie_without_an_nvlink_cycle() -> None:
    cap = allocation("v100", (0, 1, 5))  # 5-0 is not an NVLink
    _, b = best_ring(cap)
    assert b == 0.0
    model = ring_model(cap, pcie_gbps=12.0)
    assert model.transport == "pcie"
    assert model.bandwidth == 12.0
    full = ring_model(dgx1v(), pcie_gbps=12.0)
    assert full.transport == "nvlink"
    load = np.zeros((8, 8))
    for order, bw in full.rings:
        o = np.array(order)
        load[o, np.roll(o, -1)] += bw
    assert (load <= dgx1v() + 1e-9).all()
