"""The loss-tolerant all-reduce (ALGORITHMS.md section 1) on a MemoryNetwork.

Four nodes share one event loop and, except where wall time is the point, a
:class:`~gossipnet.FakeClock`: phase deadlines and failure timeouts cost no
wall time and a seeded fault plan replays the same fates on every run.
Small ``chunk_bytes`` (1 KiB = 256 float32) turns small tensors into many
chunks, so every peer owns several and loss hits many packets per round.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import pytest
import torch

from gossipnet import CollectiveReport, Config, FakeClock, FaultPlan
from gossipnet.clock import Clock
from gossipnet.collectives.chunks import ChunkPlan, ShardMap
from gossipnet.collectives.lossy.engine import END_COPIES, LossyAllReduce, OwnedShard, RoundOptions
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.collectives.lossy.loss_watch import COLD_ROUNDS
from gossipnet.collectives.lossy.round_id import layout_of
from gossipnet.runtime.node import Node
from gossipnet.testing import MemoryNetwork, MemoryTransport
from gossipnet.transport import _data_header as wire_fixed
from gossipnet.transport.faults import GilbertElliott
from gossipnet.transport.wire import Packet, WireCodec

N = 4
CHUNK_BYTES = 1024
#: 16 float32 chunks: every one of the 4 peers owns 4.
NUMEL = 4096
IDS = tuple(f"p{i}" for i in range(N))
#: |z| above this rejects "the estimator is unbiased" (two-sided p ~ 7e-6).
Z_REJECT = 4.5


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    """The conftest's fast membership, with 1 KiB chunks."""
    return fast_config.replace(chunk_bytes=CHUNK_BYTES)


def engines_of(nodes: Sequence[Node]) -> list[LossyAllReduce]:
    return [LossyAllReduce(node) for node in nodes]


async def allreduce(
    drive: Any,
    clock: Clock | None,
    engines: Sequence[LossyAllReduce],
    inputs: Sequence[Sequence[torch.Tensor]],
    *,
    weights: Sequence[float] | None = None,
    hooks: Sequence[Any] | None = None,
    timeout_s: float = 2.0,
) -> list[CollectiveReport]:
    """One round on every engine at once (in place on ``inputs``)."""
    weights = weights or [1.0] * len(engines)
    hooks = hooks or [None] * len(engines)
    runs = [
        e.run(list(x), RoundOptions(weight=w, timeout_s=timeout_s, on_reduced=h))
        for e, x, w, h in zip(engines, inputs, weights, hooks, strict=True)
    ]
    return list(await drive(clock, asyncio.gather(*runs), timeout_s=timeout_s + 5))


def chunk_slices(numel: int, dtype: torch.dtype = torch.float32) -> list[slice]:
    plan = ChunkPlan(numel, dtype, CHUNK_BYTES)
    out = []
    for c in range(plan.nchunks):
        offset, count = plan.chunk(c)
        out.append(slice(offset, offset + count))
    return out


def owners(numel: int, participants: Sequence[str] = IDS) -> list[str]:
    smap = ShardMap(ChunkPlan(numel, torch.float32, CHUNK_BYTES), participants)
    return [smap.owner(c) for c in range(smap.plan.nchunks)]


def lose_on_arrival(node: Node, lost: Callable[[Packet], bool]) -> None:
    """Make the network lose exactly the packets ``lost`` selects, on arrival at ``node``."""
    decode = node.codec.decode

    def lossy_decode(frames: Any, *, local: bool = False) -> Packet | None:
        pkt = decode(frames, local=local)
        return None if pkt is not None and lost(pkt) else pkt

    node.codec.decode = lossy_decode  # type: ignore[method-assign]


def z_score(samples: Sequence[float]) -> float:
    """Mean over its standard error (the measured spread, not an assumed one)."""
    se = statistics.stdev(samples) / math.sqrt(len(samples))
    return statistics.fmean(samples) / se


# --------------------------------------------------------------------------- exactness
@pytest.mark.timeout(15)
def test_exact_mean_without_loss_identical_on_every_peer(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    sizes = (5000, 3, 1)  # a partial last chunk; buckets with fewer chunks than peers

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(0)
            for rnd in range(2):
                inputs = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(N)]
                expected = [
                    torch.stack([x[b].double() for x in inputs]).mean(0) for b in range(len(sizes))
                ]
                reports = await allreduce(drive, clock, engines, inputs)
                for x in inputs:
                    for b in range(len(sizes)):
                        torch.testing.assert_close(x[b].double(), expected[b], rtol=1e-6, atol=1e-6)
                        assert torch.equal(x[b], inputs[0][b])  # bitwise the same everywhere
                for rep in reports:
                    assert rep.round == rnd
                    assert rep.method == "allreduce"
                    assert rep.participants == IDS
                    assert rep.contributors == IDS
                    assert rep.ok, rep
                    assert rep.missing == ()
                    assert rep.chunks_total == 20 + 1 + 1
                    assert rep.chunks_stale == 0
                    assert rep.delivered_fraction == 1.0
                    assert not rep.timed_out

    run_async(main())


@pytest.mark.timeout(15)
@pytest.mark.parametrize(
    ("dtypes", "rtol"),
    [
        ((torch.float16,), 1e-3),
        ((torch.bfloat16,), 8e-3),
        ((torch.float64,), 1e-12),
        ((torch.float32, torch.float16, torch.bfloat16, torch.float64), 8e-3),
    ],
    ids=["float16", "bfloat16", "float64", "mixed"],
)
def test_exact_mean_low_precision_and_mixed_buckets(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    dtypes: tuple[torch.dtype, ...],
    rtol: float,
    cfg: Config,
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(1)
            inputs = [
                [(torch.randn(3000, generator=gen) * 4).to(dt) for dt in dtypes] for _ in range(N)
            ]
            expected = [
                torch.stack([x[b].double() for x in inputs]).mean(0) for b in range(len(dtypes))
            ]
            reports = await allreduce(drive, clock, engines, inputs)
            for x in inputs:
                for b, dt in enumerate(dtypes):
                    assert x[b].dtype == dt
                    torch.testing.assert_close(x[b].double(), expected[b], rtol=rtol, atol=rtol)
                    assert torch.equal(x[b], inputs[0][b])
            assert all(r.ok for r in reports)

    run_async(main())


# --------------------------------------------------------------------------- unbiasedness
@pytest.mark.timeout(120)  # ~1 s on 2 idle cores, 14 s at a load of 12: a hang bound
def test_unbiased_under_random_loss_and_divide_by_n_is_rejected(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """E[owner's estimate] = true mean at 20% loss; the zero-fill/N estimate is biased low.

    Every peer's input is ``mean + noise`` (fresh noise per round), the
    condition under which dividing by the contributions that arrived is
    unbiased (ALGORITHMS.md 1.1).  One sample is one (round, chunk): the mean
    error over the chunk's elements, on the chunk's owner.
    """
    loss, seeds, rounds, true_mean = 0.2, 3, 12, 2.0
    plan = ChunkPlan(NUMEL, torch.float64, CHUNK_BYTES)  # 32 chunks, 8 per owner
    unbiased: list[float] = []
    divide_by_n: list[float] = []
    contributors: list[int] = []

    def capture(shards: list[OwnedShard]) -> list[torch.Tensor]:
        for shard in shards:
            avg = shard.average.double()
            for k in range(shard.weights.numel()):
                part = avg[k * plan.chunk_elems : (k + 1) * plan.chunk_elems]
                wsum = float(shard.weights[k])
                unbiased.append(float(part.mean()) - true_mean)
                # the same arrivals, zero-filled and divided by N
                divide_by_n.append(float(part.mean()) * wsum / N - true_mean)
                contributors.append(int(shard.contributors[k]))
        return [s.average for s in shards]

    async def main() -> None:
        for seed in range(seeds):
            clock = FakeClock()
            async with cluster(
                N, config=cfg, clock=clock, faults=FaultPlan(loss=loss, seed=seed)
            ) as nodes:
                engines = engines_of(nodes)
                gen = torch.Generator().manual_seed(100 + seed)
                for _ in range(rounds):
                    inputs = [
                        [true_mean + torch.randn(NUMEL, generator=gen, dtype=torch.float64)]
                        for _ in range(N)
                    ]
                    await allreduce(
                        drive, clock, engines, inputs, hooks=[capture] * N, timeout_s=1.0
                    )

    run_async(main())
    n_samples = seeds * rounds * plan.nchunks
    assert len(unbiased) == n_samples
    # loss really happened: on average 1 + 3 * 0.8 = 3.4 contributions per chunk
    mean_count = statistics.fmean(contributors)
    assert 3.2 < mean_count < 3.6, mean_count
    assert min(contributors) >= 1
    z_unbiased = z_score(unbiased)
    z_biased = z_score(divide_by_n)
    assert abs(z_unbiased) < Z_REJECT, f"owner estimate looks biased: z={z_unbiased:.2f}"
    assert z_biased < -Z_REJECT, f"divide-by-N was not rejected: z={z_biased:.2f}"
    # and its bias is the predicted (1 - p) shrinkage of the mean contribution
    assert statistics.fmean(divide_by_n) == pytest.approx(
        true_mean * (mean_count / N - 1), abs=0.05
    )


# --------------------------------------------------------------------------- weights
@pytest.mark.timeout(15)
def test_weights_give_the_weighted_mean_and_zero_weight_contributes_nothing(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(2)
            # weighted mean
            weights = [1.0, 2.0, 3.0, 4.0]
            inputs = [[torch.randn(NUMEL, generator=gen, dtype=torch.float64)] for _ in range(N)]
            expected = sum(w * x[0] for w, x in zip(weights, inputs, strict=True)) / sum(weights)
            await allreduce(drive, clock, engines, inputs, weights=weights)
            for x in inputs:
                torch.testing.assert_close(x[0], expected, rtol=1e-12, atol=1e-12)
            # a weight-0 peer's (huge) values leave no trace; it still gets the mean
            inputs = [[torch.randn(NUMEL, generator=gen, dtype=torch.float64)] for _ in range(N)]
            inputs[0][0].fill_(1e9)
            expected = sum(x[0] for x in inputs[1:]) / 3
            reports = await allreduce(drive, clock, engines, inputs, weights=[0.0, 1.0, 1.0, 1.0])
            for x in inputs:
                torch.testing.assert_close(x[0], expected, rtol=1e-12, atol=1e-12)
            assert all(r.chunks_stale == 0 for r in reports)

    run_async(main())


@pytest.mark.timeout(15)
def test_all_zero_weights_give_no_nan(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            inputs = [[torch.full((NUMEL,), float(10**i))] for i in range(N)]
            before = [x[0].clone() for x in inputs]
            await allreduce(drive, clock, engines, inputs, weights=[0.0] * N)
            for i, x in enumerate(inputs):
                assert bool(torch.isfinite(x[0]).all())
                own = owners(NUMEL)
                for c, s in enumerate(chunk_slices(NUMEL)):
                    if own[c] == IDS[i]:  # the owner's own chunks keep its own values
                        assert torch.equal(x[0][s], before[i][s])

    run_async(main())


@pytest.mark.timeout(15)
def test_all_zero_weights_keep_every_peers_own_values(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Nobody contributed, so there is no average: each peer keeps its own values.

    (``LossyAllReduce.run``: "A chunk whose arrived weights sum to 0 keeps
    this peer's own values"; ``Peer.all_reduce``: "0 = contribute nothing".)
    """

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            inputs = [[torch.full((NUMEL,), float(10**i))] for i in range(N)]
            before = [x[0].clone() for x in inputs]
            await allreduce(drive, clock, engines, inputs, weights=[0.0] * N)
            for x, b in zip(inputs, before, strict=True):
                assert torch.equal(x[0], b)

    run_async(main())


@pytest.mark.timeout(15)
def test_a_weight_zero_owner_never_leaks_its_values_under_loss(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Only p3 has weight, and its contributions to p0's shard are lost (its END
    is not).  p0 then holds no weighted value for its chunks, so the result there
    must not be p0's values: the one weighted peer keeps its own."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            lose_on_arrival(nodes[0], lambda pkt: pkt.kind == LossyKind.RS_DATA and pkt.src == "p3")
            inputs = [[torch.full((NUMEL,), float(10**i))] for i in range(N)]
            reports = await allreduce(drive, clock, engines, inputs, weights=[0.0, 0.0, 0.0, 1.0])
            # p0 holds no weighted value for its chunks, so it shares none: p3 keeps its own
            # values there and counts those chunks as stale
            assert reports[3].chunks_stale == owners(NUMEL).count("p0")
            own = owners(NUMEL)
            for c, s in enumerate(chunk_slices(NUMEL)):
                assert torch.equal(inputs[3][0][s], torch.full_like(inputs[3][0][s], 1000.0)), (
                    f"chunk {c} of {own[c]}"
                )

    run_async(main())


# --------------------------------------------------------------------------- stale chunks
@pytest.mark.timeout(20)
def test_lost_broadcasts_keep_own_values_and_are_counted_stale(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """At 30% loss every chunk of every peer is either the owner's broadcast or
    this peer's own input (never zero, never a mix), and ``chunks_stale`` counts
    exactly the latter."""
    slices = chunk_slices(NUMEL)
    own = owners(NUMEL)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(
            N, config=cfg, clock=clock, faults=lambda i: FaultPlan(loss=0.3, seed=10 + i)
        ) as nodes:
            engines = engines_of(nodes)
            total_stale = 0
            for _ in range(6):
                # powers of ten: no average of a subset can equal another peer's input
                inputs = [[torch.full((NUMEL,), float(10**i))] for i in range(N)]
                before = [x[0].clone() for x in inputs]
                reports = await allreduce(drive, clock, engines, inputs, timeout_s=1.0)
                for i, rep in enumerate(reports):
                    out = inputs[i][0]
                    assert rep.chunks_total == len(slices)
                    assert bool((out != 0).all())
                    stale = 0
                    for c, s in enumerate(slices):
                        owner = IDS.index(own[c])
                        broadcast = inputs[owner][0][s]
                        if owner == i:
                            continue
                        if torch.equal(out[s], before[i][s]):
                            stale += 1
                        else:
                            assert torch.equal(out[s], broadcast), (i, c)
                    assert rep.chunks_stale == stale, (i, rep)
                    total_stale += stale
            assert total_stale > 0  # the loss did hit broadcasts

    run_async(main())


# --------------------------------------------------------------------------- time
@pytest.mark.timeout(30)
def test_round_time_does_not_grow_with_loss(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Real time: rounds at 30% loss end on their END markers (or a learned,
    short deadline), far from the call's timeout, and are not twice as slow as
    lossless ones (medians).  Rounds of both networks alternate, so machine load
    hits both alike.  The first rounds teach the engines their phase spans.
    """
    numel, warmup, rounds, timeout_s = 8192, 2, 10, 10.0
    # real time on a busy machine: a loop starved for half a second must not look like
    # a dead peer (a false death makes the views, hence the shard maps, disagree)
    cfg = cfg.replace(heartbeat_interval_s=0.1, failure_timeout_s=5.0)

    async def main() -> None:
        async with (
            cluster(N, config=cfg) as clean,
            cluster(
                N,
                config=cfg,
                network=MemoryNetwork(),  # the same names p0..p3 on a world of their own
                faults=lambda i: FaultPlan(loss=0.3, seed=20 + i),
            ) as lossy,
        ):
            elapsed: dict[str, list[float]] = {"clean": [], "lossy": []}
            stale = 0
            gen = torch.Generator().manual_seed(3)
            engines_by_name = {"clean": engines_of(clean), "lossy": engines_of(lossy)}
            for rnd in range(warmup + rounds):
                for name, engines in engines_by_name.items():
                    inputs = [[torch.randn(numel, generator=gen)] for _ in range(N)]
                    if rnd < warmup:  # (a cold round may sit out its timeout: see below)
                        await allreduce(drive, None, engines, inputs, timeout_s=0.5)
                        continue
                    reports = await allreduce(drive, None, engines, inputs, timeout_s=timeout_s)
                    for rep in reports:
                        # never sat out the call's deadline (a bound loose enough for a
                        # machine busy with other test runs: there a lossless round can
                        # take seconds)
                        assert rep.elapsed_s < 0.9 * timeout_s, rep
                        elapsed[name].append(rep.elapsed_s)
                        stale += rep.chunks_stale if name == "lossy" else 0
            assert stale > 0  # the loss did bite
            clean_s = statistics.median(elapsed["clean"])
            lossy_s = statistics.median(elapsed["lossy"])
            assert lossy_s <= 2 * clean_s, (lossy_s, clean_s)

    run_async(main())


@pytest.mark.timeout(60)
def test_bursty_loss_does_not_stall_rounds(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Real time, Gilbert-Elliott loss (10% in bursts of 8 packets on average):
    bursts take all back-to-back END copies, or every packet of one sender, so
    before senders announced that they moved on (their later packets, heartbeat
    rounds, re-sent ENDs) a round's median was ~4x the lossless one and some
    sat out most of the timeout.  Rounds of both networks alternate so machine
    load hits both alike."""
    numel, warmup, rounds, timeout_s = 65536, 3, 16, 10.0
    conf = cfg.replace(chunk_bytes=4096, heartbeat_interval_s=0.1, failure_timeout_s=5.0)
    burst = GilbertElliott.from_rate(0.1, 8.0)

    async def main() -> None:
        async with (
            cluster(N, config=conf) as clean,
            cluster(
                N,
                config=conf,
                network=MemoryNetwork(),
                faults=lambda i: FaultPlan(seed=5 + i, burst=burst),
            ) as bursty,
        ):
            elapsed: dict[str, list[float]] = {"clean": [], "bursty": []}
            gen = torch.Generator().manual_seed(4)
            engines_by_name = {"clean": engines_of(clean), "bursty": engines_of(bursty)}
            for rnd in range(warmup + rounds):
                for name, engines in engines_by_name.items():
                    inputs = [[torch.randn(numel, generator=gen)] for _ in range(N)]
                    reports = await allreduce(drive, None, engines, inputs, timeout_s=timeout_s)
                    if rnd >= warmup:
                        elapsed[name] += [rep.elapsed_s for rep in reports]
            clean_s = statistics.median(elapsed["clean"])
            bursty_s = statistics.median(elapsed["bursty"])
            assert bursty_s <= 2.5 * clean_s, (bursty_s, clean_s)
            # no round sat out the call's bound (a link down for seconds can still cost
            # seconds: that is an outage, not a burst)
            assert max(elapsed["bursty"]) < 0.6 * timeout_s, max(elapsed["bursty"])

    run_async(main())


@pytest.mark.timeout(15)
def test_lossy_rounds_wait_little_beyond_their_work(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Virtual time: work is free under a FakeClock, so a round's elapsed time is
    exactly what it spent waiting for deadlines.  Once the engines know their
    phase spans, a round at 30% loss waits a few ``phase_min_wait_s`` at most,
    never anything near its timeout, whatever packets and END markers were lost."""
    timeout_s = 2.0

    async def main() -> None:
        clock = FakeClock()
        async with cluster(
            N, config=cfg, clock=clock, faults=lambda i: FaultPlan(loss=0.3, seed=30 + i)
        ) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(10)
            waited = []
            for rnd in range(12):
                inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
                t = 0.5 if rnd < 2 else timeout_s  # cold rounds may sit out their timeout
                reports = await allreduce(drive, clock, engines, inputs, timeout_s=t)
                if rnd >= 2:
                    waited += [r.elapsed_s for r in reports]
            assert max(waited) <= 5 * cfg.phase_min_wait_s + 0.02, waited
            assert max(waited) < timeout_s / 4  # far from sitting out the timeout

    run_async(main())


@pytest.mark.timeout(15)
def test_lost_end_markers_do_not_stall_a_cold_round(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """The first round of a fresh engine: p1's three RS_END copies to p0 are lost
    (probability p^3 per link, so common at scale), every data packet arrives.
    p0 received all it can expect from p1 (it knows how many chunks it owns), so
    the round must not sit out the call's timeout."""
    timeout_s = 4.0

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            lose_on_arrival(nodes[0], lambda pkt: pkt.kind == LossyKind.RS_END and pkt.src == "p1")
            gen = torch.Generator().manual_seed(9)
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
            mean = torch.stack([x[0].double() for x in inputs]).mean(0)
            reports = await allreduce(drive, clock, engines, inputs, timeout_s=timeout_s)
            assert max(r.elapsed_s for r in reports) < timeout_s / 4, reports[0]
            for x in inputs:  # nothing but markers was lost: the result is exact
                torch.testing.assert_close(x[0].double(), mean, rtol=1e-6, atol=1e-6)

    run_async(main())


@pytest.mark.timeout(15)
def test_lost_end_markers_and_data_do_not_stall_a_cold_round(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """As above, but one of p1's contributions to p0 is lost too, so p0 cannot
    tell from the count that p1 is done.  p2 and p3 finished long ago: their
    spans say how long a sender takes, even in the very first round."""
    timeout_s = 4.0
    lost_chunk = owners(NUMEL).index("p0")
    lost = {"data": 0}

    def drop(pkt: Packet) -> bool:
        if pkt.src != "p1":
            return False
        if pkt.kind == LossyKind.RS_END:
            return True
        if pkt.kind == LossyKind.RS_DATA and pkt.fields.get("c") == lost_chunk:
            lost["data"] += 1
            return True
        return False

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            lose_on_arrival(nodes[0], drop)
            gen = torch.Generator().manual_seed(11)
            inputs = [[torch.randn(NUMEL, generator=gen, dtype=torch.float64)] for _ in range(N)]
            before = [x[0].clone() for x in inputs]
            reports = await allreduce(drive, clock, engines, inputs, timeout_s=timeout_s)
            assert lost["data"] == 1
            assert max(r.elapsed_s for r in reports) < timeout_s / 4, reports[0]
            # p0's shard reached everyone; the chunk that missed p1 is the mean of
            # the three contributions that arrived, every other chunk that of all four
            assert [r.chunks_stale for r in reports] == [0] * N
            expected = torch.stack(before).mean(0)
            s = chunk_slices(NUMEL, torch.float64)[lost_chunk]
            expected[s] = (before[0][s] + before[2][s] + before[3][s]) / 3
            for x in inputs:
                torch.testing.assert_close(x[0], expected, rtol=1e-12, atol=1e-12)

    run_async(main())


# --------------------------------------------------------------------------- churn
@pytest.mark.timeout(15)
def test_a_peer_killed_mid_round_costs_its_shard_then_drops_out(
    run_async: Callable[..., Any], cluster: Any, drive: Any, wait_until: Any, cfg: Config
) -> None:
    timeout_s = 5.0
    slices = chunk_slices(NUMEL)
    own = owners(NUMEL)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(4)
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
            before = [x[0].clone() for x in inputs]
            mean4 = torch.stack([b.double() for b in before]).mean(0)
            t0 = clock.now()
            tasks = [
                asyncio.ensure_future(e.run(x, RoundOptions(timeout_s=timeout_s)))
                for e, x in zip(engines, inputs, strict=True)
            ]
            await asyncio.sleep(0)  # every round started and sent its reduce-scatter
            await nodes[3].close(announce=False)  # p3 dies silently, mid-round
            reports = await drive(clock, asyncio.gather(*tasks[:3]), timeout_s=timeout_s + 1)
            for i, rep in enumerate(reports):
                # survivors finish by their deadline; the failure detector ends the wait
                assert rep.elapsed_s <= timeout_s
                assert clock.now() - t0 <= cfg.failure_timeout_s + cfg.heartbeat_interval_s + 0.02
                assert rep.chunks_stale == sum(1 for o in own if o == "p3")
                out = inputs[i][0]
                for c, s in enumerate(slices):
                    if own[c] == "p3":  # its broadcast never came: own values
                        assert torch.equal(out[s], before[i][s])
                    else:  # its contribution to the others' shards did arrive
                        torch.testing.assert_close(out[s].double(), mean4[s], rtol=1e-6, atol=1e-6)
            await drive(clock, tasks[3], timeout_s=timeout_s + 1)
            await wait_until(
                lambda: all(n.alive_peers() == ["p0", "p1", "p2"] for n in nodes[:3]),
                2 * cfg.failure_timeout_s,
                clock=clock,
            )
            # the next round runs without p3
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(3)]
            mean3 = torch.stack([x[0].double() for x in inputs]).mean(0)
            reports = await allreduce(drive, clock, engines[:3], inputs)
            for x, rep in zip(inputs, reports, strict=True):
                assert rep.participants == ("p0", "p1", "p2")
                assert rep.round == 1
                assert rep.ok, rep
                torch.testing.assert_close(x[0].double(), mean3, rtol=1e-6, atol=1e-6)

    run_async(main())


@pytest.mark.timeout(15)
@pytest.mark.parametrize("restart", [False, True], ids=["late-joiner", "restarted"])
def test_a_late_or_restarted_peer_catches_up_in_one_call(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    wait_until: Any,
    start_node: Any,
    restart: bool,
    cfg: Config,
) -> None:

    async def main() -> None:
        clock = FakeClock()
        network = MemoryNetwork()
        first = N if restart else N - 1
        async with cluster(first, config=cfg, clock=clock, network=network) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(5)
            for _ in range(3):
                inputs = [[torch.randn(NUMEL, generator=gen)] for _ in engines]
                await allreduce(drive, clock, engines, inputs)
            assert [e.next_round for e in engines] == [3] * first
            if restart:  # p3 dies without a word and comes straight back: a newer epoch
                await nodes[3].close(announce=False)
                nodes.pop()
                engines.pop()
            node = await start_node(network, "p3", config=cfg, clock=clock, bootstrap=["mem://p0"])
            nodes.append(node)
            engines.append(LossyAllReduce(node))
            assert engines[3].next_round == 0
            await wait_until(
                lambda: all(len(n.alive_peers()) == N for n in nodes), 2.0, clock=clock
            )
            # one heartbeat carries the others' round to it
            t_end = clock.now() + 2 * cfg.heartbeat_interval_s
            await wait_until(lambda: clock.now() >= t_end, 1.0, clock=clock)
            inputs = [[torch.randn(NUMEL, generator=gen, dtype=torch.float64)] for _ in range(N)]
            mean = torch.stack([x[0] for x in inputs]).mean(0)
            reports = await allreduce(drive, clock, engines, inputs)
            assert [r.round for r in reports] == [3] * N
            for x, rep in zip(inputs, reports, strict=True):
                assert rep.ok, rep
                torch.testing.assert_close(x[0], mean, rtol=1e-12, atol=1e-12)

    run_async(main())


# --------------------------------------------------------------------------- bad packets
def chunk_fields(r: int, c: int, numel: int = NUMEL) -> dict[str, Any]:
    """A data packet's fields for round ``r`` of a plain ``all_reduce`` of ``numel``
    float32 elements (with the layout fingerprint such a round carries)."""
    plan = ChunkPlan(numel, torch.float32, CHUNK_BYTES)
    _, count = plan.chunk(c)
    layout, _ = layout_of([plan])
    return {"r": r, "m": 0, "L": layout, "b": 0, "c": c, "w": 1.0, "dt": "f32", "n": count}


@pytest.mark.timeout(15)
@pytest.mark.parametrize("kind", [LossyKind.RS_DATA, LossyKind.AG_DATA], ids=["reduce", "gather"])
def test_non_finite_packets_are_dropped_and_counted(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    wait_until: Any,
    kind: LossyKind,
    cfg: Config,
) -> None:
    own = owners(NUMEL)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            # p1 sends, ahead of round 0, a chunk with one NaN: to p0 as a
            # contribution to p0's shard, or to p2 as the average of p1's shard
            if kind == LossyKind.RS_DATA:
                chunk, dst = own.index("p0"), 0
            else:
                chunk, dst = own.index("p1"), 2
            poison = torch.ones(CHUNK_BYTES // 4)
            poison[7] = float("nan")
            assert nodes[1].send(IDS[dst], kind, chunk_fields(0, chunk), poison.numpy().tobytes())
            gen = torch.Generator().manual_seed(6)
            inputs = [[torch.randn(NUMEL, generator=gen, dtype=torch.float32)] for _ in range(N)]
            mean = torch.stack([x[0].double() for x in inputs]).mean(0)
            reports = await allreduce(drive, clock, engines, inputs)
            assert engines[dst].dropped["non_finite"] == 1
            assert sum(e.dropped["non_finite"] for e in engines) == 1
            for x in inputs:
                assert bool(torch.isfinite(x[0]).all())
                torch.testing.assert_close(x[0].double(), mean, rtol=1e-6, atol=1e-6)
            assert all(r.chunks_stale == 0 for r in reports)

    run_async(main())


@pytest.mark.timeout(15)
def test_forged_packets_are_rejected_before_they_touch_a_buffer(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    own = owners(NUMEL)

    async def main() -> None:
        clock = FakeClock()
        network = MemoryNetwork()
        async with cluster(N, config=cfg, clock=clock, network=network) as nodes:
            engines = engines_of(nodes)
            # an outsider without the secret claims to be p1
            rogue = MemoryTransport(network, "mem://rogue")
            await rogue.start(lambda frames: None)
            forger = WireCodec(b"not-the-secret", cfg, "p1")
            huge = torch.full((CHUNK_BYTES // 4,), 1e30).numpy().tobytes()
            fields = chunk_fields(0, own.index("p0"))
            assert rogue.send(
                "mem://p0", forger.encode(LossyKind.RS_DATA, fields, huge, dst="p0")
            )
            gen = torch.Generator().manual_seed(7)
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
            mean = torch.stack([x[0].double() for x in inputs]).mean(0)
            await allreduce(drive, clock, engines, inputs)
            assert nodes[0].codec.rejects["unknown_key"] == 1  # no key of it is bound
            for x in inputs:
                torch.testing.assert_close(x[0].double(), mean, rtol=1e-6, atol=1e-6)
            await rogue.close()

    run_async(main())


@pytest.mark.timeout(15)
def test_packets_of_an_old_round_are_counted_late(
    run_async: Callable[..., Any], cluster: Any, drive: Any, wait_until: Any, cfg: Config
) -> None:
    own = owners(NUMEL)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(8)
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
            await allreduce(drive, clock, engines, inputs)
            late = engines[0].dropped["late"]
            # a replayed-looking contribution to round 0, after round 0 ended
            junk = torch.full((CHUNK_BYTES // 4,), 1e6).numpy().tobytes()
            assert nodes[1].send("p0", LossyKind.RS_DATA, chunk_fields(0, own.index("p0")), junk)
            await wait_until(lambda: engines[0].dropped["late"] == late + 1, 0.1, clock=clock)
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
            mean = torch.stack([x[0].double() for x in inputs]).mean(0)
            reports = await allreduce(drive, clock, engines, inputs)
            assert [r.round for r in reports] == [1] * N
            for x in inputs:
                torch.testing.assert_close(x[0].double(), mean, rtol=1e-6, atol=1e-6)
            assert engines[0].dropped["late"] == late + 1
            # the user sees it without reaching into the engine
            assert nodes[0].stats()["engine_drops"]["lossy:ar"]["late"] == late + 1

    run_async(main())


@pytest.mark.timeout(10)
def test_bad_arguments_raise(run_async: Callable[..., Any], cluster: Any, cfg: Config) -> None:
    async def main() -> None:
        async with cluster(1, config=cfg) as nodes:
            engine = LossyAllReduce(nodes[0])
            x = torch.zeros(8)
            for weight in (-1.0, float("nan")):
                with pytest.raises(ValueError, match="weight"):
                    await engine.run([x], RoundOptions(weight=weight))
            with pytest.raises(ValueError, match="1-D"):
                await engine.run([torch.zeros(2, 2)])
            with pytest.raises(ValueError, match="wire"):
                await engine.run([torch.zeros(4, dtype=torch.complex64)])
            # a lone peer's round is its own values
            y = torch.arange(8.0)
            rep = await engine.run([y], RoundOptions(timeout_s=1.0))
            assert torch.equal(y, torch.arange(8.0))
            assert rep.participants == ("p0",)
            assert rep.ok

    run_async(main())


# --------------------------------------------------------------------------- redundancy
@pytest.mark.timeout(30)
def test_redundant_copies_turn_loss_p_into_about_p_squared(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """At 30% random loss, two copies per data packet leave about 0.3^2 = 9% of the
    broadcast chunks stale instead of 30%, the result stays exact where it arrived,
    and the duplicates are dropped as replays, never double counted."""
    loss, rounds = 0.3, 8

    async def stale_fraction(
        redundancy: int, loss: float = loss
    ) -> tuple[float, list[CollectiveReport]]:
        clock = FakeClock()
        conf = cfg.replace(redundancy=redundancy)
        async with cluster(
            N, config=conf, clock=clock, faults=lambda i: FaultPlan(loss=loss, seed=40 + i)
        ) as nodes:
            engines = engines_of(nodes)
            stale = total = 0
            reports: list[CollectiveReport] = []
            for _ in range(rounds):
                inputs = [[torch.full((NUMEL,), float(i))] for i in range(N)]
                reps = await allreduce(drive, clock, engines, inputs, timeout_s=1.0)
                if loss == 0:  # a copy counted twice would skew the mean off 1.5
                    assert all(bool((x[0] == 1.5).all()) for x in inputs)
                for rep in reps:
                    own_chunks = rep.chunks_total // N
                    stale += rep.chunks_stale
                    total += rep.chunks_total - own_chunks
                reports += reps
            return stale / total, reports

    async def main() -> None:
        single, _ = await stale_fraction(1)
        double, reports = await stale_fraction(2)
        # stale needs the broadcast lost; with 2 copies both must be (plus the rare
        # chunk whose every contribution was lost): 0.09-ish against 0.3-ish
        assert single > 0.2, single
        assert double < 0.16, double
        assert all(rep.extra["copies_sent"] > 0 for rep in reports)
        exact, _ = await stale_fraction(2, loss=0.0)
        assert exact == 0.0

    run_async(main())


def test_redundancy_is_validated(cfg: Config) -> None:
    from gossipnet import ConfigError

    with pytest.raises(ConfigError, match="redundancy"):
        cfg.replace(redundancy=0)


# --------------------------------------------------------------------------- buffers
@pytest.mark.timeout(15)
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "hook"])
def test_round_buffers_are_reused_every_other_round_and_results_stay_exact(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, hooked: bool
) -> None:
    """In place (``dst`` is ``src``) a shard is averaged inside the input: no
    accumulator at all.  What it broadcasts is copied (the caller overwrites its
    input as soon as the call returns, while the broadcast may still be queued)
    into a pool of two sets used in alternation: no allocation per round after
    the second, and a round never writes into memory the previous round may
    still be sending.  The store of the contributions is reused every round."""

    def triple(shards: list[OwnedShard]) -> list[torch.Tensor]:
        return [s.average * 3 for s in shards]  # fresh tensors: broadcast from a copy

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(11)
            ptrs: list[set[int]] = []
            for _ in range(5):
                inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
                mean = torch.stack([x[0].double() for x in inputs]).mean(0)
                hooks = [triple] * N if hooked else None
                await allreduce(drive, clock, engines, inputs, hooks=hooks)
                for x in inputs:
                    want = mean * 3 if hooked else mean
                    torch.testing.assert_close(x[0].double(), want, rtol=1e-6, atol=1e-6)
                slots = engines[0]._pool._slots
                ptrs.append({t.data_ptr() for t in slots.values()})
            # no accumulator; the store of the others' parts (.reducer) is one set
            assert {k[1] for k in engines[0]._pool._slots} == {"bcast", "parts"}
            assert len(ptrs[0]) == 2  # the broadcast copy and the store
            assert len(ptrs[1]) == 3  # the other set's broadcast copy
            assert ptrs[1] == ptrs[2] == ptrs[3] == ptrs[4]  # reused, never reallocated

    run_async(main())


@pytest.mark.timeout(15)
def test_an_in_place_broadcast_survives_the_caller_overwriting_its_input(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """The bytes an in-place round broadcasts are not the input: a caller that
    overwrites its tensor right after the call returns must not change packets
    still queued to a slower peer."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(13)
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
            await allreduce(drive, clock, engines, inputs)
            sent = [bytes(e._last.broadcast[0]) for e in engines]
            for x in inputs:
                x[0].fill_(float("nan"))  # the caller's next backward()
            assert [bytes(e._last.broadcast[0]) for e in engines] == sent
            assert all(len(b) > 0 for b in sent)

    run_async(main())


@pytest.mark.timeout(15)
def test_separate_dst_and_repaired_rounds_never_average_inside_the_input(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Only a plain in-place round averages inside ``src``: with a separate
    ``dst`` the input is left as it was, and a repaired round (a resync, whose
    broadcast is served again after the round) accumulates in pooled memory."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(12)
            inputs = [torch.randn(NUMEL, generator=gen) for _ in range(N)]
            kept = [x.clone() for x in inputs]
            outs = [torch.zeros(NUMEL) for _ in range(N)]
            mean = torch.stack(kept).mean(0)
            runs = [
                e.run([x], RoundOptions(dst=[o], timeout_s=2.0))
                for e, x, o in zip(engines, inputs, outs, strict=True)
            ]
            await drive(clock, asyncio.gather(*runs), timeout_s=7)
            for x, k, o in zip(inputs, kept, outs, strict=True):
                assert torch.equal(x, k)  # src untouched
                torch.testing.assert_close(o, mean, rtol=1e-6, atol=1e-6)
            assert sum(k[1] == "acc" for k in engines[0]._pool._slots) == 1
            runs = [
                e.run([x], RoundOptions(timeout_s=2.0, repair=True))
                for e, x in zip(engines, inputs, strict=True)
            ]
            await drive(clock, asyncio.gather(*runs), timeout_s=7)
            for x in inputs:
                torch.testing.assert_close(x, mean, rtol=1e-6, atol=1e-6)
            assert sum(k[1] == "acc" for k in engines[0]._pool._slots) == 2  # the other set

    run_async(main())


@pytest.mark.timeout(15)
def test_contributions_after_the_reduce_scatter_closed_are_late(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Once an owner averaged its shard, a contribution for it (lost earlier,
    or a copy still queued somewhere) is counted late and never added: the
    average may already be on the wire, zero-copy."""
    own = owners(NUMEL)
    target = own.index("p0")
    injected: list[bool] = []

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            lost: list[Packet] = []

            def first_from_p1(p: Packet) -> bool:
                hit = p.kind == LossyKind.RS_DATA and p.src == "p1" and p.fields["c"] == target
                if hit and not lost:
                    lost.append(p)
                    return True
                return False

            # p1's contribution to one of p0's chunks is lost on the way ...
            lose_on_arrival(nodes[0], first_from_p1)
            junk = torch.full((CHUNK_BYTES // 4,), 1e6).numpy().tobytes()

            def late_copy(shards: list[OwnedShard]) -> list[torch.Tensor]:
                # ... and p1's next contribution arrives once p0 has averaged
                injected.append(
                    nodes[1].send("p0", LossyKind.RS_DATA, chunk_fields(0, target), junk)
                )
                return [s.average for s in shards]

            gen = torch.Generator().manual_seed(12)
            inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
            without_p1 = torch.stack([inputs[i][0].double() for i in (0, 2, 3)]).mean(0)
            hooks = [late_copy, None, None, None]
            reports = await allreduce(drive, clock, engines, inputs, hooks=hooks)
            await drive(clock, asyncio.sleep(0.05), timeout_s=5)  # let the copy arrive
            assert injected == [True]
            assert engines[0].dropped["late"] == 1
            s = chunk_slices(NUMEL)[target]
            for x in inputs:  # 3 contributions averaged, the late one never added
                torch.testing.assert_close(x[0][s].double(), without_p1[s], rtol=1e-6, atol=1e-6)
            assert reports[0].round == 0

    run_async(main())


# --------------------------------------------------------------------------- END markers
@pytest.mark.timeout(30)
def test_no_end_markers_on_a_quiet_network_and_copies_once_loss_shows(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """ENDs matter only to a receiver that lost data: a cold engine (its first round) sends
    ``END_COPIES`` of each, a quiet one (no loss for a few rounds, here or at any
    peer) none; loss seen at *another* peer (our outgoing link) brings the copies
    back through its heartbeat, and rounds with lost data and lost ENDs still end
    quickly."""
    ends = [0]
    lossy = [False]

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = engines_of(nodes)
            send = nodes[0].transport.send

            def spy(dst: str, frames: Any, *, urgent: bool = False, group_bytes: int = 0) -> bool:
                head = bytes(frames[0])  # data packets have a fixed header: never an END
                is_data = head[0] == wire_fixed.MAGIC
                if not is_data and msgpack.unpackb(head)["k"] in (
                    LossyKind.RS_END,
                    LossyKind.AG_END,
                ):
                    ends[0] += 1
                return bool(send(dst, frames, urgent=urgent, group_bytes=group_bytes))

            nodes[0].transport.send = spy  # type: ignore[method-assign]
            # from round 8 on, p1 loses everything p2 sends it in the reduce-scatter
            lose_on_arrival(
                nodes[1],
                lambda p: (
                    lossy[0] and p.src == "p2" and p.kind in (LossyKind.RS_DATA, LossyKind.RS_END)
                ),
            )
            gen = torch.Generator().manual_seed(13)
            per_round, slowest = [], []
            for rnd in range(12):
                lossy[0] = rnd >= 8
                ends[0] = 0
                inputs = [[torch.randn(NUMEL, generator=gen)] for _ in range(N)]
                reports = await allreduce(drive, clock, engines, inputs)
                per_round.append(ends[0])
                slowest.append(max(r.elapsed_s for r in reports))
                await drive(clock, clock.sleep(0.2))  # heartbeats carry each engine's flag
            both_phases = 2 * (N - 1)
            assert per_round[:COLD_ROUNDS] == [both_phases * END_COPIES] * COLD_ROUNDS  # cold
            # quiet: every sender completes on its data
            assert per_round[COLD_ROUNDS:8] == [0] * (8 - COLD_ROUNDS), per_round
            # loss starts at p1, which p0 does not see: none (+ re-announces while it waits)
            assert per_round[8] < both_phases * END_COPIES
            # p1's heartbeat told p0 (+ re-announces while p0 waits for the slowed p1)
            assert all(n >= both_phases * END_COPIES for n in per_round[9:]), per_round
            assert max(slowest[8:]) < 0.5, slowest  # lost data and ENDs: cut, not the 2 s bound

    run_async(main())
