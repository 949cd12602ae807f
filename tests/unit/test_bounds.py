"""Issue 37, findings 4 and 5: what one member's packets may do to round ids and sums
(the lossy all-reduce, and SPARQ's copies); and the owner's optional robust
aggregation (centered clipping).

A member holds its own key, so its packets are authenticated as its own; these tests
send them with its node (``Node.send``), as its own software would, with values no
honest peer sends: a round id at the end of the valid range, weights and values that
overflow float32 sums, an int8 scale that decodes to inf.  Every one must be a
counted drop or move nothing, and every round's result must stay the exact mean.
MemoryNetwork peers on one loop under a FakeClock, seeded.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from gossipnet import CollectiveReport, Config, FakeClock, Int8
from gossipnet.collectives.chunks import ChunkPlan, ShardMap
from gossipnet.collectives.compress import CompressSession
from gossipnet.collectives.compress.payload import Z
from gossipnet.collectives.compress.quant import MAX_SCALE
from gossipnet.collectives.lossy import gather
from gossipnet.collectives.lossy.claims import PARTICIPANT_ROUNDS, ROUND_WINDOW, RoundClaims
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.collectives.lossy.reducer import MAX_WEIGHT, ShardReducer
from gossipnet.collectives.lossy.robust import CenteredClip, ClippingReducer, centered_clip
from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.round_id import MAX_ROUND, layout_of
from gossipnet.collectives.sparq import codec as sparq_codec
from gossipnet.collectives.sparq.codec import VALUE_BOUND as SPARQ_BOUND
from gossipnet.collectives.sparq.codec import Layout
from gossipnet.runtime.kinds import NodeKind
from gossipnet.transport.wire import Packet

CHUNK_BYTES = 1024
IDS3 = ("p0", "p1", "p2")
NUMEL = 4096  # 16 float32 chunks of 256
#: Each test runs a handful of rounds of at most 2 s of virtual time: 30 s bounds a hang.
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    return fast_config.replace(chunk_bytes=CHUNK_BYTES)


def owners(n: int) -> list[str]:
    ids = tuple(f"p{i}" for i in range(n))
    smap = ShardMap(ChunkPlan(NUMEL, torch.float32, CHUNK_BYTES), ids)
    return [smap.owner(c) for c in range(smap.plan.nchunks)]


def chunk_fields(r: int, c: int, w: float = 1.0) -> dict[str, Any]:
    """A plain round's data packet fields for chunk ``c`` of NUMEL float32."""
    plan = ChunkPlan(NUMEL, torch.float32, CHUNK_BYTES)
    layout, _ = layout_of([plan])
    return {"r": r, "m": 0, "L": layout, "b": 0, "c": c, "w": w, "dt": "f32", "n": 256}


async def one_round(
    drive: Any, clock: FakeClock, engines: Sequence[LossyAllReduce], xs: Sequence[torch.Tensor]
) -> list[CollectiveReport]:
    runs = [e.run([x], RoundOptions(timeout_s=2.0)) for e, x in zip(engines, xs, strict=True)]
    return list(await drive(clock, asyncio.gather(*runs), timeout_s=10))


def inputs(gen: torch.Generator, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    xs = [torch.randn(NUMEL, generator=gen) for _ in range(n)]
    return xs, torch.stack([x.double() for x in xs]).mean(0)


# ---------------------------------------------------------------------- finding 4
def test_a_beacon_at_the_largest_round_id_neither_moves_nor_wedges_the_run(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p2 tells p0 and p1, before each of six rounds, that it is in round 2**53 - 1
    (a beacon and a data packet of that round).  Before: both jumped there, the round
    after it was out of range for every receiver (wrong means, then timeouts).  Now
    one peer's word is no quorum: ids go 0..5 on every peer, every mean is exact."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(n) for n in nodes]
            insider = nodes[2]
            chunk = owners(3).index("p0")
            gen = torch.Generator().manual_seed(37)
            for k in range(6):
                for dst in ("p0", "p1"):
                    assert insider.send(dst, NodeKind.HEARTBEAT, {"ar": MAX_ROUND})
                    junk = torch.full((256,), 7.0).numpy().tobytes()
                    insider.send(dst, LossyKind.RS_DATA, chunk_fields(MAX_ROUND, chunk), junk)
                xs, mean = inputs(gen, 3)
                reports = await one_round(drive, clock, engines, xs)
                assert [r.round for r in reports] == [k] * 3
                for x, rep in zip(xs, reports, strict=True):
                    assert rep.ok, rep
                    torch.testing.assert_close(x.double(), mean, rtol=1e-6, atol=1e-6)
            assert all(e.next_round == 6 for e in engines)
            for e in engines[:2]:
                assert e.dropped["round_jump"] >= 6  # each far claim counted, none buffered
                assert e._nbuffered == 0
                assert e.participants_seen == {"p0", "p1", "p2"} - {e.node.peer_id}

    run_async(main())


def test_ids_that_never_took_part_are_neither_ahead_nor_a_quorum(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p2 and p3 are members that never send data, only beacons far ahead.  Before,
    they counted as "ahead" (two against p0 and p1: p0 believed itself behind and
    would realign from them) and moved p0's next plain round to theirs."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(4, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(n) for n in nodes[:2]]
            gen = torch.Generator().manual_seed(38)

            async def pair_round() -> list[CollectiveReport]:
                xs = [torch.randn(NUMEL, generator=gen) for _ in range(2)]
                opts = RoundOptions(timeout_s=2.0, participants=("p0", "p1"))
                runs = [e.run([x], opts) for e, x in zip(engines, xs, strict=True)]
                return list(await drive(clock, asyncio.gather(*runs), timeout_s=10))

            await pair_round()  # p0 and p1 took part with each other
            for sybil in nodes[2:]:
                sybil.beacon["ar"] = 5_000
            t_end = clock.now() + 3 * cfg.heartbeat_interval_s
            await drive(clock, clock.sleep(t_end - clock.now()))
            assert all(e.max_seen == 5_000 for e in engines)  # heard them
            for k in (1, 2):
                reports = await pair_round()
                assert [r.round for r in reports] == [k, k]
                assert all(r.ok for r in reports)
                for e in engines:
                    align = e.alignment()
                    assert align.ahead == {}
                    assert not align.we_are_behind
                    assert e.participants_seen == {"p0", "p1"} - {e.node.peer_id}

    run_async(main())


def test_round_claims_quorum_window_and_participants() -> None:
    claims = RoundClaims()
    # a fresh engine (no participants): the alive members vote
    assert claims.electorate(["p0", "p1", "p2"], "p0") == {"p1", "p2"}
    assert claims.claim("p2", MAX_ROUND, base=10) == (10 + ROUND_WINDOW, False)
    assert claims.claim("p1", 12, base=10) == (12, True)
    assert claims.quorum({"p1", "p2"}) == 12  # more than half: both
    assert claims.quorum({"p2"}) == 10 + ROUND_WINDOW  # one voter: its word, clamped
    assert claims.quorum({"p1", "p2", "p3"}) == 12  # p3 has no claim: -1
    assert claims.quorum(set()) == -1
    # round packets only raise a claim; a beacon replaces it
    assert claims.claim("p1", 11, base=10) == (11, True)
    assert claims.quorum({"p1"}) == 12
    claims.claim("p1", 11, base=10, latest=True)
    assert claims.quorum({"p1"}) == 11
    claims.cap(5)
    assert claims.quorum({"p1", "p2"}) == 5
    # participants: whose data our rounds took, for PARTICIPANT_ROUNDS of our rounds
    claims.took_part(["p1"])
    assert claims.participants() == {"p1"}
    assert claims.electorate(["p0", "p1", "p2"], "p0") == {"p1"}
    for _ in range(PARTICIPANT_ROUNDS - 1):
        claims.took_part([])
    assert claims.participants() == {"p1"}
    claims.took_part([])
    assert claims.participants() == frozenset()
    claims.keep({"p1"})
    assert set(claims._claims) == {"p1"}


def test_a_peer_claiming_the_end_of_the_range_moves_ids_a_window_per_round() -> None:
    """With one voter (a run of two), whatever it claims moves us at most a window
    per round we run: from 0, the largest id is more than 2**32 rounds away."""
    claims = RoundClaims()
    nxt = 0
    for _ in range(1000):
        claims.claim("p1", MAX_ROUND, base=nxt, latest=True)
        r = max(nxt, claims.quorum({"p1"}))
        assert r - nxt <= ROUND_WINDOW
        nxt = r + 1
    assert nxt <= 1000 * (ROUND_WINDOW + 1)
    assert MAX_ROUND // (ROUND_WINDOW + 1) > 2**32


# ---------------------------------------------------------------------- finding 5
@pytest.mark.parametrize(
    ("weight", "value", "reason"),
    [
        (1e300, 1.0, "bad_weight"),
        (MAX_WEIGHT + 1, 1.0, "bad_weight"),
        (MAX_WEIGHT, 1e32, "value_range"),
    ],
    ids=["weight-1e300", "weight-past-max", "value-past-limit"],
)
def test_a_contribution_that_would_overflow_the_sum_is_a_counted_drop(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    weight: float,
    value: float,
    reason: str,
) -> None:
    """p1 sends p0, ahead of round 0, a contribution to p0's shard whose weighted
    values overflow float32.  Before: weight 1e300 made ``add_`` raise out of the round
    (and counted first, it would have zeroed the chunk), a finite 1e32 at weight 2**24
    made p0's average inf.  Now it is dropped with its reason, p1's real contribution
    is taken, and every peer holds the exact mean."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(n) for n in nodes]
            chunk = owners(3).index("p0")
            junk = torch.full((256,), value).numpy().tobytes()
            assert nodes[1].send("p0", LossyKind.RS_DATA, chunk_fields(0, chunk, weight), junk)
            gen = torch.Generator().manual_seed(39)
            xs = [torch.randn(NUMEL, generator=gen) for _ in range(3)]
            mean = torch.stack([x.double() for x in xs]).mean(0)
            reports = await one_round(drive, clock, engines, xs)
            for x, rep in zip(xs, reports, strict=True):
                assert rep.ok, rep
                torch.testing.assert_close(x.double(), mean, rtol=1e-6, atol=1e-6)
            assert engines[0].dropped[reason] == 1

    run_async(main())


def test_the_reducer_refuses_weights_and_values_that_overflow() -> None:
    acc = torch.zeros(512)
    red = ShardReducer(acc, range(0, 2), 256, 1.0, ("p1", "p2", "p3"))
    ones = torch.ones(256)
    assert red.accumulate("p1", 0, ones, 1e300) == "bad_weight"
    assert red.accumulate("p1", 0, ones, float("nan")) == "bad_weight"
    assert red.accumulate("p1", 0, ones * 1e30, MAX_WEIGHT) == "value_range"
    assert red.accumulate("p1", 0, ones * float("inf"), 1.0) == "non_finite"
    parts = [("p2", 0, ones * 1e30, 1.0), ("p2", 1, ones, 1e300), ("p3", 0, ones, MAX_WEIGHT)]
    assert red.accumulate_batch(parts) == ["value_range", "bad_weight", None]
    assert red.accumulate_batch([("p1", 0, ones, 1.0), ("p1", 1, ones * 1e30, 2.0)]) == [
        None,
        "value_range",
    ]
    out = red.average(torch.zeros(512))
    assert bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="weight"):
        RoundOptions(weight=MAX_WEIGHT * 2)


class _Ctx:
    """The part of a PhaseContext the all-gather's decoders touch."""

    def __init__(self) -> None:
        self.dropped: collections.Counter[str] = collections.Counter()
        self.node = type("N", (), {"clock": FakeClock()})()

    def note_after_end(self, rnd: Any, pkt: Any) -> None:
        pass

    def spans(self, phase: str) -> collections.deque[float]:
        return collections.deque()


def _int8(scale: float, q: int, n: int) -> bytes:
    return struct.pack("<BI", 2, n) + struct.pack("<f", scale) + struct.pack("b", q) * n


@pytest.mark.parametrize(
    ("scale", "q", "reason"),
    [
        (3e38, 127, "compressed_scale"),
        (-1.0, 1, "compressed_scale"),
        (MAX_SCALE, -128, "non_finite"),
    ],
    ids=["scale-3e38", "negative-scale", "largest-scale-at-minus-128"],
)
def test_an_int8_broadcast_that_decodes_past_float32_is_a_counted_drop(
    scale: float, q: int, reason: str
) -> None:
    """Before: a scale of 3e38 passed the finiteness check and decoded to inf, which
    the broadcast wrote into ``dst`` unchecked."""
    ids = ("p0", "p1", "p2")
    src = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(40))]
    rnd = Round(5, "p0", ids, src, [t.clone() for t in src], 1.0, [CHUNK_BYTES])
    sess = CompressSession(Int8())
    rnd.codec = sess
    sess.begin(rnd, False)
    rnd.sending = False
    ctx = _Ctx()
    c = rnd.maps[0].chunks_of("p1").start
    n = rnd.plans[0].chunk(c)[1]
    payload = _int8(scale, q, n)
    fields = {"r": 5, "m": 0, "L": 0, "b": 0, "c": c, "dt": "u8", "n": len(payload), "z": Z.QUANT}
    before = rnd.dst[0].clone()
    gather.on_ag(ctx, rnd, Packet("p1", 1, 1, 16, fields, memoryview(payload)))  # type: ignore[arg-type]
    assert torch.equal(rnd.dst[0], before)
    assert not rnd.got_np[0][c]
    assert ctx.dropped == {reason: 1}
    assert sess.counters[f"dropped_{reason}"] == 1


def test_int8_rounds_stay_finite_when_an_owner_broadcasts_a_huge_scale(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p2's software sends, for one chunk of its shard, int8 values at scale 3e38.
    The receivers drop it (counted) and keep their own values there: every result is
    finite, and the other chunks are the int8 mean as usual."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(n) for n in nodes]
            sessions = [CompressSession(Int8()) for _ in nodes]
            forged: list[slice] = []
            real = sessions[2].encode_ag

            def encode_ag(rnd: Any, b: int, c: int, values: torch.Tensor, counted: Any) -> Any:
                got = real(rnd, b, c, values, counted)
                if got is None or forged:
                    return got
                off, n = rnd.plans[b].chunk(c)
                forged.append(slice(off, off + n))
                return Z.QUANT, _int8(3e38, 127, n), got[2]

            sessions[2].encode_ag = encode_ag  # type: ignore[method-assign]
            gen = torch.Generator().manual_seed(41)
            xs = [torch.randn(NUMEL, generator=gen) for _ in range(3)]
            own = [x.clone() for x in xs]
            want = torch.stack(xs).mean(0)
            runs = [
                e.run([x], RoundOptions(timeout_s=2.0, compress=s))
                for e, x, s in zip(engines, xs, sessions, strict=True)
            ]
            reports = list(await drive(clock, asyncio.gather(*runs), timeout_s=10))
            assert len(forged) == 1
            lost = forged[0]
            kept = torch.ones(NUMEL, dtype=torch.bool)
            kept[lost] = False
            for i, (e, rep) in enumerate(zip(engines[:2], reports[:2], strict=True)):
                assert bool(torch.isfinite(xs[i]).all())
                assert torch.equal(xs[i][lost], own[i][lost])  # stale: its own values
                err = (xs[i][kept] - want[kept]).abs().max() / want.abs().max()
                assert float(err) < 0.02  # int8 rounding, as test_compress_allreduce's
                assert rep.chunks_stale == 1
                assert e.dropped["compressed_scale"] == 1

    run_async(main())


# ---------------------------------------------------------------------- robust mode
def test_centered_clip_is_the_mean_within_tau_and_bounds_one_garbage_peer() -> None:
    gen = torch.Generator().manual_seed(42)
    signal = torch.randn(16, 256, generator=gen)
    x = signal + 0.1 * torch.randn(8, 16, 256, generator=gen)
    w = torch.ones(8, 16, dtype=torch.float64)
    honest = x.mean(0)
    # every contribution within the radius: one iteration is the mean
    torch.testing.assert_close(centered_clip(x, w, tau=10.0, iters=1), honest)
    bad = x.clone()
    bad[7] = x[7] * 1e3  # one peer sends its gradient times 1000
    mean_err = (bad.mean(0) - honest).norm() / honest.norm()
    clip_err = (centered_clip(bad, w, tau=0.3, iters=3) - x[:7].mean(0)).norm() / honest.norm()
    assert float(mean_err) > 50
    assert float(clip_err) < 0.1
    # a sender whose chunk did not arrive (weight 0) takes no part
    w[7, :] = 0
    torch.testing.assert_close(centered_clip(bad, w, tau=10.0, iters=1), x[:7].mean(0))
    with pytest.raises(ValueError, match="tau"):
        CenteredClip(tau=0.0)
    with pytest.raises(ValueError, match="iters"):
        CenteredClip(tau=1.0, iters=0)


def test_robust_rounds_keep_one_garbage_peer_from_moving_the_mean(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Four peers, p3 sends its values times 1000.  Plain rounds follow it (each
    replica moves by about 250 times p3's values).  With centered clipping every
    chunk an honest peer owns is within about tau of the mean of the three others,
    the same on every peer; from the median, so is p3's own shard (its own software
    clips its own input).  With no attacker and a radius above the honest spread,
    the clipped round is the plain mean."""
    own_of = owners(4)
    honest_owned = torch.tensor([own_of[i // 256] != "p3" for i in range(NUMEL)])

    async def main() -> None:
        clock = FakeClock()
        async with cluster(4, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(n) for n in nodes]
            gen = torch.Generator().manual_seed(43)
            signal = torch.randn(NUMEL, generator=gen)

            async def round_(
                robust: CenteredClip | None, garbage: bool, where: torch.Tensor
            ) -> tuple[float, list[torch.Tensor]]:
                xs = [signal + 0.1 * torch.randn(NUMEL, generator=gen) for _ in range(4)]
                honest = torch.stack(xs[:3]).mean(0) if garbage else torch.stack(xs).mean(0)
                if garbage:
                    xs[3] = xs[3] * 1e3
                runs = [
                    e.run([x], RoundOptions(timeout_s=2.0, robust=robust))
                    for e, x in zip(engines, xs, strict=True)
                ]
                reports = await drive(clock, asyncio.gather(*runs), timeout_s=10)
                assert all(r.ok for r in reports)
                h = honest[where]
                errs = [float((x[where] - h).norm() / h.norm()) for x in xs[:3]]
                return max(errs), xs

            everywhere = torch.ones(NUMEL, dtype=torch.bool)
            plain_err, _ = await round_(None, True, everywhere)
            assert plain_err > 50
            for clip, where in (
                (CenteredClip(tau=0.3, iters=3), honest_owned),
                (CenteredClip(tau=0.3, iters=3, start="median"), everywhere),
            ):
                clip_err, xs = await round_(clip, True, where)
                # its fixed point: one peer of four holds v about tau / 3 (RMS) from
                # the others' mean, whatever it sends (the signal's RMS is about 1)
                assert clip_err < 1.5 * clip.tau / 3, clip
                assert all(torch.equal(x, xs[0]) for x in xs[:3])  # one result everywhere
            quiet_err, _ = await round_(CenteredClip(tau=10.0, iters=1), False, everywhere)
            assert quiet_err < 1e-5

    run_async(main())


def test_clipping_reducer_takes_parts_alone_or_in_batches_alike() -> None:
    gen = torch.Generator().manual_seed(44)
    own = torch.randn(1000, generator=gen)  # 4 chunks of 256, the last of 232
    others = {p: torch.randn(1000, generator=gen) for p in ("p1", "p2")}
    rule = CenteredClip(tau=0.5, iters=2)

    def reducer() -> ClippingReducer:
        return ClippingReducer(own.clone(), range(4, 8), 256, 2.0, rule, IDS3, "p0")

    parts = [
        (p, 4 + c, others[p][c * 256 : (c + 1) * 256], 1.0) for p in ("p1", "p2") for c in range(4)
    ]
    parts = [p for p in parts if (p[0], p[1]) != ("p2", 5)]  # one part lost
    one, batch = reducer(), reducer()
    assert [one.accumulate(*p) for p in parts] == [None] * 7
    assert batch.accumulate_batch(parts) == [None] * 7
    assert one.accumulate("p9", 4, torch.ones(256), 1.0) == "not_participant"
    assert batch.accumulate("p1", 4, torch.ones(256), 1.0) == "duplicate"
    a, b = one.average(own), batch.average(own)
    assert torch.equal(a, b)
    assert bool(torch.isfinite(a).all())
    assert one.contributors.tolist() == [3, 2, 3, 3]
    # a chunk no weight arrived for keeps our own values, as the mean does
    lone = ClippingReducer(own.clone(), range(4, 8), 256, 0.0, rule, IDS3, "p0")
    assert torch.equal(lone.average(own), own)


# ---------------------------------------------------------------------- SPARQ
def test_sparq_deltas_and_refreshes_past_the_value_bound_parse_to_none() -> None:
    """A DELTA at scale 3e38 decoded to inf (127 * 3e38) and entered the neighbour's
    copy, then every mix; a REFRESH of finite 3e38 values overflowed the mix."""
    layout = Layout.for_payload(2000, 0.1, 256)
    fields = {"b": 0, "u": 0, "n": 1}

    def delta(scale: float) -> bytes:
        return struct.pack("<fHb", scale, 3, 127)

    got = sparq_codec.parse_delta(fields, delta(0.5), layout)
    assert got is not None
    assert float(got[3][0]) == 63.5
    assert sparq_codec.parse_delta(fields, delta(SPARQ_BOUND / 127), layout) is not None
    for scale in (3e38, SPARQ_BOUND):
        assert sparq_codec.parse_delta(fields, delta(scale), layout) is None, scale
    seg = {"b": 0, "u": 0, "o": 0, "n": layout.segment}
    for value, ok in ((1.0, True), (SPARQ_BOUND, True), (3e38, False), (-3e38, False)):
        vals = torch.full((layout.segment,), value).numpy().tobytes()
        assert (sparq_codec.parse_refresh(seg, vals, layout) is not None) is ok, value


@pytest.mark.timeout(60)
def test_peer_all_reduce_with_centered_clipping_bounds_a_faulty_peer() -> None:
    """``net.all_reduce(..., robust=CenteredClip(tau))``: one of four peers sends its
    values times 1e3; the honest peers' result stays near the honest mean (the plain
    mean would be hundreds of times off), and robust with compress is refused."""
    import gossipnet
    from gossipnet.testing import run_peers

    honest = [torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    mean = torch.stack(honest).mean(0)  # rank 3 honest, as it would be

    def body(rank: int, net: gossipnet.Peer) -> torch.Tensor:
        x = honest[rank].clone() * (1e3 if rank == 3 else 1.0)
        if rank == 0:
            with pytest.raises(ValueError, match="robust"):
                net.all_reduce([x.clone()], robust=gossipnet.CenteredClip(tau=1.0), compress="bf16")
        net.all_reduce([x], robust=gossipnet.CenteredClip(tau=1.0))
        return x

    out = run_peers(4, body, timeout_s=50, collective_timeout_s=5.0)
    for x in out[:3]:
        err = (x - mean).norm() / mean.norm()
        assert err < 0.5, float(err)  # the plain mean: about 250
