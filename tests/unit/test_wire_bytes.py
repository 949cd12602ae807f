"""A round's bytes are the bytes its packets put on the wire (collectives/lossy/wirebytes.py),
and ``stats()["wire"]`` is the whole run's, control traffic included.

Why these tests: the compressed rounds' report counted only their data packets, once
per copy on both sides of the ratio, so ``compression_ratio`` did not fall when
``Config.compressed_copies`` tripled the bytes on the wire, and a run's control
traffic (ENDs, heartbeats, introductions) appeared nowhere.  Each check compares a
report or a stats figure with what the memory transport itself counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet import ArcTopK, Config, FakeClock, FaultPlan
from gossipnet.collectives.compress import CompressSession
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.node import Node
from gossipnet.testing import run_peers

N = 4
NUMEL = 20_000


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    return fast_config.replace(chunk_bytes=1024)


def _grads(seed: int, r: int) -> list[torch.Tensor]:
    return [
        torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed * 100 + 10 * r + i))
        for i in range(N)
    ]


def _sent(node: Node) -> tuple[int, int]:
    """(the transport's sent bytes, the node-control part of them)."""
    assert node.transport is not None
    return node.transport.stats.sent_bytes, node.stats()["wire"]["control_bytes"]


async def _rounds(
    drive: Any,
    clock: FakeClock,
    nodes: Sequence[Node],
    n_rounds: int,
    spec: Any = None,
    check: Callable[[int, list[CollectiveReport], list[int]], None] | None = None,
) -> list[list[CollectiveReport]]:
    """``n_rounds`` all-reduces on every node; ``check(r, reports, counted)`` gets each
    node's transport bytes over the round less its node-control bytes."""
    engines = [LossyAllReduce(node) for node in nodes]
    sessions = [CompressSession(spec) if spec is not None else None for _ in nodes]
    out = []
    for r in range(n_rounds):
        before = [_sent(node) for node in nodes] if check is not None else []
        xs = _grads(7, r)
        runs = [
            e.run([x], RoundOptions(timeout_s=2.0, compress=s))
            for e, x, s in zip(engines, xs, sessions, strict=True)
        ]
        reps = list(await drive(clock, asyncio.gather(*runs), timeout_s=10))
        if check is not None:
            after = [_sent(node) for node in nodes]
            pairs = zip(after, before, strict=True)
            check(r, reps, [(a[0] - b[0]) - (a[1] - b[1]) for a, b in pairs])
        out.append(reps)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("spec", "extra"),
    [
        (None, {}),
        (ArcTopK(density=0.05, values="int8"), {}),
        ("bf16", {}),
        (ArcTopK(density=0.05), {"compressed_copies": 3, "parity_always": True}),
        (None, {"redundancy": 2, "parity_group": 4, "parity_always": True}),
    ],
    ids=["dense", "arctopk-int8", "bf16", "arctopk-3-copies", "dense-copies-parity"],
)
def test_report_bytes_are_the_transports_bytes_for_the_round(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    spec: Any,
    extra: dict[str, Any],
) -> None:
    """On a memory network every byte this peer's transport counted over a round, less
    its heartbeats and other node control, is in the round's ``bytes_sent``: data,
    copies, parity and the ENDs (the first rounds of a cold engine send END copies)."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg.replace(**extra), clock=clock) as nodes:

            def check(r: int, reps: list[CollectiveReport], counted: list[int]) -> None:
                for rep, c in zip(reps, counted, strict=True):
                    assert rep.ok, rep
                    assert rep.extra["bytes_sent"] == c > 0, (r, rep.extra, c)
                    if spec is not None:
                        assert rep.extra["compression_ratio"] == pytest.approx(
                            rep.extra["bytes_dense"] / c
                        )
                    if extra.get("compressed_copies") or extra.get("redundancy"):
                        assert rep.extra["copies_sent"] > 0
                    if extra.get("parity_group"):
                        assert rep.extra["parity_sent"] > 0

            await _rounds(drive, clock, nodes, 3, spec, check)

    run_async(main())


@pytest.mark.timeout(60)
def test_copies_raise_the_reported_bytes_and_lower_the_ratio(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """``compressed_copies=3`` (in every round: ``parity_always``) puts about three times
    the compressed data on the wire: the report's bytes grow with it, and as a dense round
    of the same settings sends no copies, ``bytes_dense`` stays and the ratio falls."""
    spec = ArcTopK(density=0.05, values="int8")
    got: dict[int, list[CollectiveReport]] = {}

    async def one(copies: int) -> None:
        clock = FakeClock()
        config = cfg.replace(compressed_copies=copies, parity_always=True)
        async with cluster(N, config=config, clock=clock) as nodes:
            got[copies] = (await _rounds(drive, clock, nodes, 3, spec))[-1]

    run_async(one(1))
    run_async(one(3))
    for one_copy, three in zip(got[1], got[3], strict=True):
        a, b = one_copy.extra, three.extra
        assert b["copies_sent"] > 0 == a["copies_sent"]
        assert b["bytes_sent"] > 2.2 * a["bytes_sent"], (a, b)
        assert b["bytes_dense"] == pytest.approx(a["bytes_dense"], rel=0.05)
        assert b["compression_ratio"] < a["compression_ratio"] / 2.2, (a, b)
        assert a["compression_ratio"] > 5  # 5% of the blocks, int8 values


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "plan",
    [None, FaultPlan(loss=0.5, seed=3), FaultPlan(duplicate=0.5, seed=4)],
    ids=["clean", "half-lost", "duplicating"],
)
def test_stats_wire_total_is_what_the_peer_sent_heartbeats_included(
    run_async: Callable[..., Any],
    cluster: Any,
    wait_until: Any,
    cfg: Config,
    plan: FaultPlan | None,
) -> None:
    """Joined nodes with no collective send only node control (introductions, views,
    heartbeats, acks): the wire total grows with the heartbeats and is all control.
    Under a fault plan the packets its network lost were sent (the inner transport never
    saw them) and the copies it duplicated were not (the inner transport saw them twice)."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock, faults=plan) as nodes:
            first = [node.stats()["wire"] for node in nodes]
            # ten heartbeat intervals later (virtual time)
            t = clock.now() + 10 * cfg.heartbeat_interval_s
            await wait_until(lambda: clock.now() >= t, timeout_s=5.0, clock=clock)
            for node, w0 in zip(nodes, first, strict=True):
                w = node.stats()["wire"]
                assert node.transport is not None
                inner = node.transport.stats.sent_bytes
                assert w["control_packets"] - w0["control_packets"] >= 9 * (N - 1)
                assert w["sent_bytes"] == w["control_bytes"] > w0["sent_bytes"]
                assert w["collective_bytes"] == {}
                assert w["other_bytes"] == 0
                if plan is None:
                    assert w["sent_bytes"] == inner
                elif plan.loss:
                    assert w["sent_bytes"] > 1.5 * inner
                else:
                    assert w["sent_bytes"] < inner / 1.2

    run_async(main())


@pytest.mark.timeout(120)
def test_a_step_call_reports_its_round_and_its_resync() -> None:
    """``all_reduce(..., step=opt)`` at the first call resyncs the parameters first: the
    call's report counts both rounds' bytes (``resync_bytes`` the resync's), equal to
    what the engine's counter and the transport (less node control) say over the call,
    and its ratio is against a dense call, which resyncs alike."""

    def body(rank: int, net: gossipnet.Peer) -> list[tuple[dict[str, float], int, int]]:
        w = torch.nn.Parameter(torch.zeros(NUMEL))
        opt = torch.optim.SGD([w], lr=0.1)
        out = []
        for step in range(2):
            w.grad = _grads(rank, step)[rank]
            before = net.stats()["wire"]
            rep = net.all_reduce([w.grad], compress=ArcTopK(density=0.05, values="int8"), step=opt)
            after = net.stats()["wire"]
            wire = after["sent_bytes"] - before["sent_bytes"]
            wire -= after["control_bytes"] - before["control_bytes"]
            engine = after["collective_bytes"]["lossy:ar"] - before["collective_bytes"]["lossy:ar"]
            out.append((rep.extra, wire, engine))
        return out

    out = run_peers(N, body, timeout_s=100, collective_timeout_s=5.0, chunk_bytes=1024)
    for calls in out:
        (first, wire0, engine0), (second, wire1, engine1) = calls
        assert first["resync"] == 1.0
        assert "resync" not in second
        assert first["resync_bytes"] > 0
        assert "resync_bytes" not in second
        assert first["bytes_sent"] == engine0
        assert second["bytes_sent"] == wire1 == engine1
        # besides the rounds, a resync announces this peer's replica digest to the
        # others (a packet each, the replica check's, not the collective's)
        assert 0 <= wire0 - engine0 <= 3 * 256
        # the dense resync is on both sides of the first call's ratio
        assert first["bytes_sent"] > first["resync_bytes"] + second["bytes_sent"] / 2
        assert first["compression_ratio"] < second["compression_ratio"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "extra",
    [{}, {"redundancy": 2}, {"parity_group": 4, "parity_always": True}],
    ids=["plain", "redundancy-2", "parity-4"],
)
def test_bytes_dense_is_what_a_dense_round_of_the_settings_sends(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, extra: dict[str, Any]
) -> None:
    """A compressed round's ``bytes_dense`` against the ``bytes_sent`` of dense rounds
    run on the same settings (the dense round's own copies and parity included, its
    ENDs too): equal but for the few bytes the END counts' encodings differ by.  From
    the third round on: until then how many END copies each engine sends follows when
    its peers' heartbeats said "no loss here", which virtual time orders differently
    for the two runs (``bytes_dense`` counts the round's ENDs as they were)."""
    config = cfg.replace(**extra)
    got: dict[str, list[list[CollectiveReport]]] = {}

    async def one(name: str, spec: Any) -> None:
        clock = FakeClock()
        async with cluster(N, config=config, clock=clock) as nodes:
            got[name] = await _rounds(drive, clock, nodes, 4, spec)

    run_async(one("dense", None))
    run_async(one("arctopk", ArcTopK(density=0.05)))
    run_async(one("int8", gossipnet.Int8()))
    for r in (2, 3):
        for i in range(N):
            want = got["dense"][r][i].extra["bytes_sent"]
            for name in ("arctopk", "int8"):
                assert got[name][r][i].extra["bytes_dense"] == pytest.approx(want, rel=1e-3)
