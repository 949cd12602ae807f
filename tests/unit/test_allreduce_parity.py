"""XOR parity packets (``Config.parity_group``): one lost packet per group comes back.

The layout and XOR are checked byte for byte; the engine on a MemoryNetwork with
a FakeClock (as in ``test_allreduce.py``): a loss parity can repair leaves the
round exact, random loss leaves about p * (1 - (1 - p)^k) stale instead of p,
the auto mode sends nothing on a clean network, and forged parity is counted.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from gossipnet import CollectiveReport, Config, ConfigError, FakeClock, FaultPlan
from gossipnet.clock import Clock
from gossipnet.collectives.chunks import ChunkPlan, ShardMap
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.collectives.lossy.parity import group_count, members, parities, recover
from gossipnet.collectives.lossy.round_id import layout_of
from gossipnet.transport.wire import Packet

from .test_allreduce import lose_on_arrival

N = 4
CHUNK_BYTES = 1024
NUMEL = 4096 * 3  # 48 chunks of 256 float32: 12 per owner, groups of k interleave
IDS = tuple(f"p{i}" for i in range(N))


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    return fast_config.replace(chunk_bytes=CHUNK_BYTES, parity_group=3, parity_always=True)


async def allreduce(
    drive: Any, clock: Clock, engines: Sequence[LossyAllReduce], inputs: Sequence[torch.Tensor]
) -> list[CollectiveReport]:
    runs = [e.run([x], RoundOptions(timeout_s=1.0)) for e, x in zip(engines, inputs, strict=True)]
    return list(await drive(clock, asyncio.gather(*runs), timeout_s=6.0))


# ------------------------------------------------------------------ layout and XOR
@pytest.mark.parametrize(
    ("total", "chunk", "k"),
    [(1000, 64, 3), (64 * 7 + 8, 64, 4), (64 * 9 - 8, 64, 4), (640, 64, 1), (64 * 15 + 1, 64, 8)],
)
def test_any_one_member_of_any_group_is_rebuilt_bit_exactly(total: int, chunk: int, k: int) -> None:
    raw = os.urandom(total)
    n = -(-total // chunk)
    chunks = [raw[i * chunk : (i + 1) * chunk] for i in range(n)]
    par = parities(raw, chunk, k)
    assert len(par) == group_count(n, k) == n // k
    covered = sorted(c for g in range(len(par)) for c in members(0, n, k, g))
    assert covered == list(range(n))  # every chunk in exactly one group
    for g, p in enumerate(par):
        group = list(members(0, n, k, g))
        assert k <= len(group) < 2 * k  # so parity costs at most 1/k of the traffic
        for lost in group:
            rest = [chunks[c] for c in group if c != lost]
            assert bytes(recover(p, rest, len(chunks[lost]))) == chunks[lost]


@pytest.mark.parametrize(("total", "k"), [(64, 4), (30, 4), (64 * 7, 8)])
def test_a_stream_shorter_than_one_group_gets_no_parity(total: int, k: int) -> None:
    # one "group" of fewer than k chunks would cost more than 1/k: a full copy at n = 1
    n = -(-total // 64)
    assert group_count(n, k) == 0
    assert parities(os.urandom(total), 64, k) == []


def test_neighbouring_chunks_fall_in_different_groups() -> None:
    # a burst of up to G consecutive losses costs each group one member at most
    n, k = 12, 3
    groups = group_count(n, k)
    owner = {c: g for g in range(groups) for c in members(0, n, k, g)}
    for c in range(n - groups + 1):
        assert len({owner[c + i] for i in range(groups)}) == groups


# ------------------------------------------------------------------ the engine
@pytest.mark.timeout(20)
def test_a_loss_parity_can_repair_leaves_the_round_exact(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p0 loses one reduce-scatter contribution from p3 and one broadcast chunk
    from p2 (each the only loss of its group): both are rebuilt from parity, so
    every peer ends with the exact mean and nothing stale, yet the report still
    counts the two packets the network lost."""
    smap = ShardMap(ChunkPlan(NUMEL, torch.float32, CHUNK_BYTES), IDS)
    rs_lost, ag_lost = smap.chunks_of("p0")[4], smap.chunks_of("p2")[7]

    def lost(pkt: Packet) -> bool:
        if "g" in pkt.fields or pkt.fields.get("r") != 0:
            return False
        rs = pkt.kind == LossyKind.RS_DATA and pkt.src == "p3" and pkt.fields["c"] == rs_lost
        ag = pkt.kind == LossyKind.AG_DATA and pkt.src == "p2" and pkt.fields["c"] == ag_lost
        return rs or ag

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            lose_on_arrival(nodes[0], lost)
            engines = [LossyAllReduce(n) for n in nodes]
            gen = torch.Generator().manual_seed(3)
            inputs = [torch.randn(NUMEL, generator=gen) for _ in range(N)]
            mean = torch.stack([x.double() for x in inputs]).mean(0)
            reports = await allreduce(drive, clock, engines, inputs)
            for x in inputs:
                torch.testing.assert_close(x.double(), mean, rtol=1e-6, atol=1e-6)
            assert inputs[0].equal(inputs[1])  # bit-identical, not merely close
            rep = reports[0]
            assert rep.chunks_stale == 0
            assert rep.extra["recovered"] == 2
            assert rep.packets_lost == 2
            assert all(r.extra["parity_sent"] > 0 for r in reports)
            assert sum(e.dropped["bad_parity"] for e in engines) == 0

    run_async(main())


@pytest.mark.timeout(40)
def test_parity_turns_loss_p_into_about_p_times_a_group_loss(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """At 30% random loss, groups of 2 leave about 0.3 * (1 - 0.7^2) = 15% of the
    broadcast chunks stale instead of 30%, and the result is exact where lossless."""
    loss, rounds = 0.3, 6

    async def stale_fraction(k: int, loss: float = loss) -> float:
        clock = FakeClock()
        conf = cfg.replace(parity_group=k)
        async with cluster(
            N, config=conf, clock=clock, faults=lambda i: FaultPlan(loss=loss, seed=70 + i)
        ) as nodes:
            engines = [LossyAllReduce(n) for n in nodes]
            stale = total = 0
            for _ in range(rounds):
                inputs = [torch.full((NUMEL,), float(i)) for i in range(N)]
                reps = await allreduce(drive, clock, engines, inputs)
                if loss == 0:
                    assert all(bool((x == 1.5).all()) for x in inputs)
                    assert all(r.extra["recovered"] == 0 for r in reps)
                for rep in reps:
                    stale += rep.chunks_stale
                    total += rep.chunks_total - rep.chunks_total // N
            return stale / total

    async def main() -> None:
        none = await stale_fraction(0)
        pairs = await stale_fraction(2)
        assert none > 0.22, none
        assert pairs < 0.2, pairs
        assert pairs < 0.75 * none, (pairs, none)
        assert await stale_fraction(2, loss=0.0) == 0.0

    run_async(main())


@pytest.mark.timeout(30)
def test_auto_parity_stops_on_a_quiet_network_and_resumes_on_loss(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Without ``parity_always``: parity while the network is unknown (the first
    rounds, as END copies), none once rounds have been clean, back after a loss."""
    conf = cfg.replace(parity_always=False)
    lossy_round = 7

    def lost(pkt: Packet) -> bool:  # one broadcast chunk of one round, at p0
        f = pkt.fields
        return pkt.kind == LossyKind.AG_DATA and f.get("r") == lossy_round and f.get("c") == 13

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=conf, clock=clock) as nodes:
            lose_on_arrival(nodes[0], lost)
            engines = [LossyAllReduce(n) for n in nodes]
            sent = []
            for _ in range(lossy_round + 3):
                inputs = [torch.full((NUMEL,), float(i)) for i in range(N)]
                reps = await allreduce(drive, clock, engines, inputs)
                sent.append(sum(r.extra["parity_sent"] for r in reps))
            assert sent[0] > 0  # nothing known yet: protected
            assert sent[lossy_round] == 0  # quiet for several rounds: no overhead
            assert sent[lossy_round + 1] > 0  # p0 saw loss: it protects the next round
            # and told its peers (the flag on its END markers): a round later they do too
            assert all(r.extra["parity_sent"] > 0 for r in reps)

    run_async(main())


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("fields", "payload_bytes", "reason"),
    [
        ({"gs": 0, "g": 0}, CHUNK_BYTES, "bad_parity"),
        ({"gs": 999, "g": 0}, CHUNK_BYTES, "bad_parity"),
        ({"gs": 3, "g": 4}, CHUNK_BYTES, "bad_parity"),  # 12 chunks / 3 = groups 0..3
        ({"gs": 3, "g": 0}, CHUNK_BYTES - 4, "bad_parity"),  # wrong length
        ({"gs": 3, "g": "0"}, CHUNK_BYTES, "bad_parity"),
        ({"gs": 3, "g": 0, "b": 5}, CHUNK_BYTES, "bad_parity"),
    ],
)
def test_forged_parity_is_counted_and_harmless(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    fields: dict[str, Any],
    payload_bytes: int,
    reason: str,
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg.replace(parity_group=0), clock=clock) as nodes:
            engines = [LossyAllReduce(n) for n in nodes]
            layout, _ = layout_of([ChunkPlan(NUMEL, torch.float32, CHUNK_BYTES)])
            head = {"r": 0, "m": 0, "L": layout, "b": 0, "w": 1.0, "n": payload_bytes, **fields}
            assert nodes[1].send("p0", LossyKind.RS_DATA, head, b"\xff" * payload_bytes)
            inputs = [torch.full((NUMEL,), float(i)) for i in range(N)]
            reports = await allreduce(drive, clock, engines, inputs)
            assert engines[0].dropped[reason] == 1
            assert all(bool((x == 1.5).all()) for x in inputs)
            assert all(r.chunks_stale == 0 for r in reports)

    run_async(main())


def test_parity_group_is_validated(cfg: Config) -> None:
    with pytest.raises(ConfigError, match="parity_group"):
        cfg.replace(parity_group=-1)
    with pytest.raises(ConfigError, match="parity_group"):
        cfg.replace(parity_group=65)
    assert cfg.replace(parity_group=0).parity_group == 0
