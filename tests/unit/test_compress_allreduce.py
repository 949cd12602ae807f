"""Compressed rounds of the loss-tolerant all-reduce on a MemoryNetwork (FakeClock).

What the issue asks to hold under loss (ALGORITHMS.md section 6): every peer
applies bit-identical values where the broadcast arrived; ARC-Top-K values are
only ever added at the index set the owner has in force; error feedback neither
double-counts nor silently drops a contribution (the ledger sums it up); the
report carries bytes and the ratio; forged compressed fields are counted drops.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from gossipnet import (
    DCT,
    Accordion,
    ArcTopK,
    Config,
    FakeClock,
    FaultPlan,
    Int8,
    LayoutMismatchError,
)
from gossipnet.collectives.chunks import ChunkPlan, ShardMap
from gossipnet.collectives.compress import CompressSession, Ledger
from gossipnet.collectives.compress import sparse as sparse_mod
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.node import Node

N = 4
NUMEL = 20_000
CHUNK = 1024
IDS = tuple(f"p{i}" for i in range(N))


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    # these tests are about what loss does to compressed rounds: copies would hide it
    # (test_copies_while_loss_is_seen_cut_what_is_lost_and_cost_nothing_when_quiet)
    return fast_config.replace(chunk_bytes=CHUNK, compressed_copies=1)


async def rounds(
    drive: Any,
    clock: FakeClock,
    nodes: Sequence[Node],
    sessions: Sequence[CompressSession],
    make: Callable[[int, int], torch.Tensor],
    n_rounds: int,
    on_round: Callable[[int, list[torch.Tensor], list[CollectiveReport]], None] | None = None,
) -> list[list[CollectiveReport]]:
    engines = [LossyAllReduce(node) for node in nodes]
    out = []
    for r in range(n_rounds):
        xs = [make(i, r) for i in range(N)]
        runs = [
            e.run([x], RoundOptions(timeout_s=2.0, compress=s))
            for e, x, s in zip(engines, xs, sessions, strict=True)
        ]
        reps = list(await drive(clock, asyncio.gather(*runs), timeout_s=10))
        if on_round is not None:
            on_round(r, xs, reps)
        out.append(reps)
    return out


def grads(seed: int) -> Callable[[int, int], torch.Tensor]:
    def make(i: int, r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1000 + r * N + i)
        return torch.randn(NUMEL, generator=g) * torch.linspace(0.01, 3.0, NUMEL)

    return make


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec", ["bf16", "fp16", Int8()], ids=["bf16", "fp16", "int8"])
def test_quantised_mean_close_and_identical(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, spec: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            sessions = [CompressSession(spec) for _ in range(N)]
            make = grads(1)

            def check(r: int, xs: list[torch.Tensor], reps: list[CollectiveReport]) -> None:
                want = torch.stack([make(i, r) for i in range(N)]).mean(0)
                for x in xs:
                    assert torch.equal(x, xs[0])
                    err = (x - want).abs().max() / want.abs().max()
                    assert err < (0.02 if spec != "bf16" else 0.03)
                for rep in reps:
                    assert rep.chunks_stale == 0
                    assert rep.extra["compression_ratio"] > 1.5
                    assert rep.extra["bytes_sent"] > 0

            await rounds(drive, clock, nodes, sessions, make, 2, check)

    run_async(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "spec",
    [
        ArcTopK(density=0.05),
        DCT(density=0.05, refresh_every=3),
        ArcTopK(density=0.05, values="int8"),
        DCT(density=0.05, refresh_every=3, values="int8"),
        ArcTopK(density=0.05, values="bf16"),
    ],
    ids=["arctopk", "dct", "arctopk-int8", "dct-int8", "arctopk-bf16"],
)
def test_sparse_ef_conserves_mass_under_loss(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    spec: Any,
    monkeypatch: Any,
) -> None:
    """At 20% loss over 12 rounds: for every peer, gradients put in = confirmed +
    e + pending + unresolved; what owners counted from it equals what it confirmed,
    except for contributions reported unresolved; values never at another set.
    With a value codec the rounding error stays in ``e`` and what leaves it is what
    the owner decodes, so the same law holds; every payload fits its packet."""

    sizes = _watch_payload_sizes(monkeypatch)

    async def main() -> None:
        clock = FakeClock()
        plan = lambda i: FaultPlan(loss=0.2, seed=70 + i)  # noqa: E731
        async with cluster(N, config=cfg, clock=clock, faults=plan) as nodes:
            sessions = [CompressSession(spec) for _ in range(N)]
            for s in sessions:
                s.ledger = Ledger()
            reps = await rounds(drive, clock, nodes, sessions, grads(2), 12)
            _check_ledgers(sessions)
            assert max(sizes) <= CHUNK
            extra = [r.extra for rr in reps for r in rr]
            assert sum(x.get("ef_restored", 0) for x in extra) > 0  # loss was seen and fixed
            assert all(x["bytes_sent"] < x["bytes_dense"] / 2 for x in extra[N:])

    run_async(main())


def _watch_payload_sizes(monkeypatch: Any) -> list[int]:
    """Record the byte length of every compressed payload the sparse encoders make."""
    sizes: list[int] = []
    for name in ("encode_rs", "encode_ag"):
        real = getattr(sparse_mod, name)

        def watched(*args: Any, _real: Any = real) -> Any:
            out = _real(*args)
            sizes.append(len(out[1]))
            return out

        monkeypatch.setattr(sparse_mod, name, watched)
    return sizes


def _check_ledgers(sessions: Sequence[CompressSession]) -> None:
    for i, s in enumerate(sessions):
        led = s.ledger
        assert led is not None
        pend = torch.zeros(NUMEL)
        pend_abs = torch.zeros(NUMEL)
        for _, b, idx, vals in s.pending.values():
            assert b == 0
            pend.index_add_(0, idx, vals)
            pend_abs.index_add_(0, idx, vals.abs())
        lhs = led.put_in[0]
        rhs = led.confirmed[0] + s.e[0] + pend + led.unresolved[0]
        torch.testing.assert_close(lhs, rhs, rtol=1e-4, atol=1e-3)
        counted = torch.zeros(NUMEL)
        for o in sessions:
            assert o.ledger is not None
            per = o.ledger.counted.get(IDS[i])
            if per is not None:
                counted += per[0]
        diff = counted - led.confirmed[0]
        # never double-counted: anything the owners counted beyond what we confirmed
        # is still pending (its answer comes next round) or had both answers lost
        # (reported as unresolved); a restored contribution the owner counted
        # would show here as a difference with neither
        bad = diff.abs() > led.unresolved_abs[0] + pend_abs + 1e-3
        assert not bool(bad.any()), (i, torch.nonzero(bad).flatten()[:10], diff[bad][:10], s.totals)
        if s.totals["ef_unresolved"] == 0 and not s.pending:
            torch.testing.assert_close(counted, led.confirmed[0], rtol=1e-5, atol=1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("values", ["fp32", "int8"])
def test_arctopk_index_sets_agree_and_applied_bits_identical_under_loss(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    monkeypatch: Any,
    values: str,
) -> None:
    """Seeded 15% loss: every value an owner adds sits at the set it has in force
    (the decoder is watched), and all peers hold bit-identical values at every
    chunk whose broadcast reached them (int8: the owner applies what it sends)."""
    added_outside = []
    real = sparse_mod.decode_rs

    def watched(sess: Any, rnd: Any, src: str, b: int, c: int, *rest: Any) -> Any:
        out = real(sess, rnd, src, b, c, *rest)
        dense, w = out
        n = rnd.plans[b].chunk(c)[1]
        _, blocks = sparse_mod._set_in_force(sess, rnd, b, c, n)
        idx = sparse_mod.topk.block_indices(blocks, sess.block, n)
        mask = torch.ones(n, dtype=torch.bool)
        mask[idx] = False
        if w != 0.0 and bool(dense[mask].any()):
            added_outside.append((rnd.r, src, c))
        return out

    monkeypatch.setattr(sparse_mod, "decode_rs", watched)

    async def main() -> None:
        clock = FakeClock()
        plan = lambda i: FaultPlan(loss=0.15, seed=90 + i)  # noqa: E731
        async with cluster(N, config=cfg, clock=clock, faults=plan) as nodes:
            sessions = [CompressSession(ArcTopK(density=0.05, values=values)) for _ in range(N)]

            cb = sessions[0].chunk_bytes(CHUNK, NUMEL, 4, N, False)
            smap = ShardMap(ChunkPlan(NUMEL, torch.float32, cb), IDS)
            make = grads(3)
            stale = [0]

            def check(r: int, xs: list[torch.Tensor], reps: list[CollectiveReport]) -> None:
                # per chunk: every peer holds the owner's values bit for bit (the
                # broadcast arrived) or its own input (stale), never anything else
                for c in range(smap.plan.nchunks):
                    off, n = smap.plan.chunk(c)
                    owner = IDS.index(smap.owner(c))
                    truth = xs[owner][off : off + n]
                    for i, x in enumerate(xs):
                        got = x[off : off + n]
                        if not torch.equal(got, truth):
                            assert torch.equal(got, make(i, r)[off : off + n]), (r, c, i)
                            stale[0] += 1

            reps = await rounds(drive, clock, nodes, sessions, make, 10, check)
            assert stale[0] > 0  # the loss did hit broadcasts
            mism = sum(r.extra["index_mismatch"] for rr in reps for r in rr)
            missed = sum(r.extra["missed_announcement"] for rr in reps for r in rr)
            assert missed > 0  # loss hit announcements, and it was counted
            assert mism >= 0
        assert added_outside == []

    run_async(main())


@pytest.mark.timeout(60)
def test_value_codecs_cut_bytes_and_stay_close_to_the_mean(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Lossless first round (every peer uses the same bootstrap set): int8 values send
    fewer bytes than bf16, which send fewer than float32, and the report says so;
    where values arrived, the result is the inputs' mean within the two roundings
    (each contribution's and the broadcast's: 1/254 of a packet's largest magnitude)."""
    make = grads(6)
    want = torch.stack([make(i, 0) for i in range(N)]).mean(0)
    sent: dict[str, float] = {}
    ratio: dict[str, float] = {}

    async def one(values: str) -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            sessions = [CompressSession(ArcTopK(density=0.05, values=values)) for _ in range(N)]

            def check(r: int, xs: list[torch.Tensor], reps: list[CollectiveReport]) -> None:
                for x in xs:
                    assert torch.equal(x, xs[0])
                at = xs[0] != 0
                assert 0.04 * NUMEL <= int(at.sum()) <= 0.08 * NUMEL  # whole blocks, rounded up
                err = (xs[0][at] - want[at]).abs().max()
                # largest input magnitude bounds every packet's scale
                bound = {"fp32": 1e-5, "bf16": 0.02, "int8": 0.03}[values]
                assert float(err) <= bound * float(
                    torch.stack([make(i, 0) for i in range(N)]).abs().max()
                )
                sent[values] = sum(rep.extra["bytes_sent"] for rep in reps)
                ratio[values] = reps[0].extra["compression_ratio"]

            await rounds(drive, clock, nodes, sessions, make, 1, check)

    for values in ("fp32", "bf16", "int8"):
        run_async(one(values))
    # the rounds' END markers (the same in every row) are in bytes_sent too
    assert sent["int8"] < 0.9 * sent["bf16"] < 0.9 * 0.8 * sent["fp32"], sent
    assert ratio["int8"] > ratio["bf16"] > ratio["fp32"], ratio


@pytest.mark.timeout(60)
def test_peers_with_other_value_codecs_raise_layout_mismatch_never_mix(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Two peers send int8 values, two float32 (a misconfiguration): the setting is
    part of the round's layout, so no packet of the other pair is read as ours
    (counted ``layout_mismatch``), each peer's own values stay finite and from its
    own pair, and every peer raises ``LayoutMismatchError`` naming both settings."""

    def make(i: int, r: int) -> torch.Tensor:
        # the int8 pair's inputs are positive, the float32 pair's negative
        g = torch.Generator().manual_seed(900 + r * N + i)
        return (torch.rand(NUMEL, generator=g) + 0.5) * (1.0 if i < 2 else -1.0)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(node) for node in nodes]
            sessions = [
                CompressSession(ArcTopK(density=0.05, values="int8" if i < 2 else "fp32"))
                for i in range(N)
            ]
            xs = [make(i, 0) for i in range(N)]
            runs = [
                e.run([x], RoundOptions(timeout_s=2.0, compress=s))
                for e, x, s in zip(engines, xs, sessions, strict=True)
            ]
            out = await drive(clock, asyncio.gather(*runs, return_exceptions=True), timeout_s=10)
            for i, (x, res) in enumerate(zip(xs, out, strict=True)):
                assert isinstance(res, LayoutMismatchError), res
                assert "compress=topk16/int8" in str(res)
                assert "compress=topk16/fp32" in str(res)
                assert bool(torch.isfinite(x).all())
                assert bool((x >= 0).all() if i < 2 else (x <= 0).all()), i
            assert sum(e.dropped["layout_mismatch"] for e in engines) > 0

    run_async(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "spec",
    [
        Accordion(low=ArcTopK(density=0.1), high=ArcTopK(density=0.01), interval=2),
        Accordion(low=DCT(density=0.1), high=DCT(density=0.01), interval=2),
    ],
    ids=["arctopk", "dct"],
)
def test_accordion_switches_per_bucket(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, spec: Accordion
) -> None:

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            sessions = [CompressSession(spec) for _ in range(N)]
            reps = await rounds(drive, clock, nodes, sessions, grads(4), 6)
            first = reps[0][0].extra
            last = reps[-1][0].extra
            assert first["accordion_critical"] == 1.0  # first interval is critical
            assert last["accordion_critical"] == 0.0  # stationary noise: not critical
            assert last["bytes_sent"] < first["bytes_sent"]

    run_async(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["bf16", Int8()], ids=["bf16", "int8"])
def test_owner_average_of_compressed_contributions_is_unbiased_under_loss(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, spec: Any
) -> None:
    """30% loss, inputs ``mean + noise``: the owner's average of what arrived, over
    (round, chunk) samples, is centred on the true mean (|z| < 4.5), as on the
    dense path; zero-fill / N would sit near (1 - p) * mean."""
    true_mean = 2.0
    samples: list[float] = []

    def make(i: int, r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(500 + r * N + i)
        return true_mean + torch.randn(NUMEL, generator=g)

    async def main() -> None:
        clock = FakeClock()
        plan = lambda i: FaultPlan(loss=0.3, seed=110 + i)  # noqa: E731
        async with cluster(N, config=cfg, clock=clock, faults=plan) as nodes:
            sessions = [CompressSession(spec) for _ in range(N)]
            cb = sessions[0].chunk_bytes(CHUNK, NUMEL, 4, N, False)
            smap = ShardMap(ChunkPlan(NUMEL, torch.float32, cb), IDS)

            def collect(r: int, xs: list[torch.Tensor], reps: list[CollectiveReport]) -> None:
                inputs = torch.stack([make(i, r) for i in range(N)])
                for i, x in enumerate(xs):
                    for c in smap.chunks_of(IDS[i]):
                        off, n = smap.plan.chunk(c)
                        # the noise mean of what arrived: the estimate's error
                        samples.append(float(x[off : off + n].mean()) - true_mean)
                assert float(inputs.mean()) == pytest.approx(true_mean, abs=0.05)

            await rounds(drive, clock, nodes, sessions, make, 8, collect)

    run_async(main())
    se = statistics.stdev(samples) / math.sqrt(len(samples))
    assert abs(statistics.fmean(samples) / se) < 4.5
    assert abs(statistics.fmean(samples)) < 0.1 * true_mean  # zero-fill: about -0.6


@pytest.mark.timeout(60)
def test_arctopk_bootstraps_after_the_view_changes(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """A peer leaves the view (churn): the chunking and the owners change, so no
    announced set carries over; every peer falls back to the seeded bootstrap set
    of the round, and no value is refused as a mismatch nor sent without a set."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(node) for node in nodes]
            sessions = [CompressSession(ArcTopK(density=0.05)) for _ in range(N)]
            for s in sessions:
                s.ledger = Ledger()
            make = grads(5)
            for r, view in enumerate([IDS] * 3 + [IDS[:3]] * 3):
                members = [i for i in range(N) if IDS[i] in view]
                runs = [
                    engines[i].run(
                        [make(i, r)],
                        RoundOptions(timeout_s=2.0, compress=sessions[i], participants=view),
                    )
                    for i in members
                ]
                reps = list(await drive(clock, asyncio.gather(*runs), timeout_s=10))
                for rep in reps:
                    assert rep.extra["index_mismatch"] == 0
                    assert rep.extra["missed_announcement"] == 0
                    assert rep.chunks_stale == 0
            for i in range(3):
                led = sessions[i].ledger
                assert led is not None
                torch.testing.assert_close(
                    led.put_in[0], led.confirmed[0] + sessions[i].e[0], rtol=1e-4, atol=1e-3
                )

    run_async(main())


def _count_runs(monkeypatch: Any, *, apart: bool) -> list[int]:
    """Record the length of every run of chunks sent as one packet (``apart``: every
    chunk alone, as before bundles)."""
    from gossipnet.collectives.lossy import bundle

    real = bundle.group
    lengths: list[int] = []

    def grouped(records: list[Any], room: int) -> Any:
        for run in ([r] for r in records) if apart else real(records, room):
            lengths.append(len(run))
            yield run

    monkeypatch.setattr(bundle, "group", grouped)
    return lengths


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("loss", "copies"), [(0.0, 1), (0.2, 1), (0.2, 2)], ids=["lossless", "loss20", "loss20-x2"]
)
def test_light_chunks_share_packets_and_change_nothing(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    monkeypatch: Any,
    loss: float,
    copies: int,
) -> None:
    """Accordion after its first interval (the critical density 0.1 sizes the chunks,
    the calm 0.01 is in force): consecutive chunks share packets, so far fewer data
    packets go out than chunks; lossless, every peer's result is bit-identical to
    sending each chunk alone; at 20% loss the error-feedback ledger still balances,
    with every bundle sent once or twice (``redundancy=2``: a copy is a duplicate)."""
    spec = Accordion(low=ArcTopK(density=0.1), high=ArcTopK(density=0.01), interval=2)
    make = grads(8)

    async def once(apart: bool) -> tuple[list[torch.Tensor], list[int]]:
        lengths = _count_runs(monkeypatch, apart=apart)
        clock = FakeClock()
        plan = (lambda i: FaultPlan(loss=loss, seed=130 + i)) if loss else None
        config = cfg.replace(redundancy=copies)
        async with cluster(N, config=config, clock=clock, faults=plan) as nodes:
            sessions = [CompressSession(spec) for _ in range(N)]
            for s in sessions:
                s.ledger = Ledger()
            seen: list[torch.Tensor] = []
            await rounds(drive, clock, nodes, sessions, make, 8, lambda r, xs, _: seen.extend(xs))
            assert sessions[0].accordion is not None
            assert sessions[0].accordion.critical_share(0, NUMEL) < 1.0  # calm layers sent
            if loss:
                _check_ledgers(sessions)
        return seen, lengths

    together, runs = run_async(once(apart=False))
    assert sum(runs) > 2 * len(runs)  # chunks per packet, over the eight rounds
    assert max(runs) > 2
    if not loss:
        alone, single = run_async(once(apart=True))
        assert set(single) == {1}
        assert sum(single) == sum(runs)  # the same chunks were sent
        for a, b in zip(together, alone, strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(60)
def test_copies_while_loss_is_seen_cut_what_is_lost_and_cost_nothing_when_quiet(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """``Config.compressed_copies``: under seeded 20% loss a second copy of every
    compressed packet leaves far fewer chunks stale than none; on a loss-free network
    no copy goes out once the engine has seen a few quiet rounds."""

    behind: dict[int, float] = {}

    async def stale_and_copies(config: Config, loss: float) -> tuple[int, list[int]]:
        clock = FakeClock()
        plan = (lambda i: FaultPlan(loss=loss, seed=150 + i)) if loss else None
        async with cluster(N, config=config, clock=clock, faults=plan) as nodes:
            sessions = [CompressSession(ArcTopK(density=0.05, values="int8")) for _ in range(N)]
            reps = await rounds(drive, clock, nodes, sessions, grads(5), 12)
        stale = sum(r.chunks_stale for rr in reps for r in rr)
        behind[config.compressed_copies] = sum(r.extra["arrived_behind"] for rr in reps for r in rr)
        return stale, [int(sum(r.extra.get("copies_sent", 0) for r in rr)) for rr in reps]

    async def main() -> None:
        lone, lone_copies = await stale_and_copies(cfg, 0.2)
        two, two_copies = await stale_and_copies(cfg.replace(compressed_copies=2), 0.2)
        assert sum(lone_copies) == 0
        assert all(c > 0 for c in two_copies)  # every round of a lossy network
        assert lone > 0
        assert two * 3 < lone, (lone, two)  # about p^2 instead of p
        # a copy that stood in for a lost original is seen (it arrives behind later
        # packets), so the loss the copies hide still counts as loss; no copies, none
        assert behind[2] > 0
        assert behind[1] == 0
        _, quiet = await stale_and_copies(cfg.replace(compressed_copies=2), 0.0)
        assert quiet[-5:] == [0] * 5, quiet  # a cold engine counts as lossy at first

    run_async(main())
