"""A lossless round replays bit for bit, whatever order the contributions arrive in.

An owner's sum of a chunk must not depend on which sender's part came first: the
same inputs give the same outputs on every run (float addition is not
associative, so adding in arrival order moved results by an ulp or so between
runs, and ARC-Top-K's near-tied block choices with them).  Here four nodes on a
MemoryNetwork (FakeClock) run the same rounds under two arrangements of per-link
delays, no loss: each owner hears the senders in another order (checked), and
every output, the compressed ones and ARC-Top-K's chosen sets included, is the
same bits.  At the reducer: parts in any order and any batching give one sum,
which is the fixed-order fold (our own part, then the senders in order).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from gossipnet import ArcTopK, Config, FakeClock, FaultPlan, Int8
from gossipnet.collectives.compress import CompressSession
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.collectives.lossy.intake import Intake
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.collectives.lossy.reducer import ShardReducer
from gossipnet.reports import CollectiveReport
from gossipnet.transport.wire import Packet

from .test_batch_intake import _batched as batched

N = 4
IDS = tuple(f"p{i}" for i in range(N))
ADDRS = tuple(f"mem://{p}" for p in IDS)
#: float32 elements: bucket 0 with a short last chunk, bucket 1 of whole chunks.
SIZES = (5000, 3072)


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    # no copies of compressed packets: nothing is lost, and copies are another order
    return fast_config.replace(chunk_bytes=1024, compressed_copies=1)


def arrangement(seed: int, loss: float = 0.0) -> Callable[[int], FaultPlan]:
    """Per node, a fixed delay on each outgoing link: every owner hears each sender's
    stream whole (one delay per link keeps it in order), the senders in an order
    drawn from ``seed``; ``loss`` of the packets lost (none by default)."""
    rng = random.Random(seed)
    delay: dict[tuple[str, str], float] = {}
    for dst in ADDRS:
        senders = [a for a in ADDRS if a != dst]
        rng.shuffle(senders)
        for k, src in enumerate(senders):
            delay[(src, dst)] = 0.002 * (k + 1)

    def plan(i: int) -> FaultPlan:
        links = {
            (s, d): FaultPlan(delay_s=t, loss=loss) for (s, d), t in delay.items() if s == ADDRS[i]
        }
        return FaultPlan(seed=i, loss=loss, links=links)

    return plan


def watch_arrivals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record (receiver, sender) of every reduce-scatter data packet, in arrival order."""
    seen: list[tuple[str, str]] = []
    on_packet, on_batch = Intake._on_packet, Intake._on_batch

    def note(self: Intake, pkt: Packet) -> None:
        if pkt.kind in (LossyKind.RS_DATA, self.k.rs_data):
            seen.append((self.node.peer_id, pkt.src))

    def packet(self: Intake, pkt: Packet) -> None:
        note(self, pkt)
        on_packet(self, pkt)

    def batch(self: Intake, pkts: list[Packet]) -> None:
        for pkt in pkts:
            note(self, pkt)
        on_batch(self, pkts)

    monkeypatch.setattr(Intake, "_on_packet", packet)
    monkeypatch.setattr(Intake, "_on_batch", batch)
    return seen


def watch_sums(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, int, int], torch.Tensor]:
    """Record every owner's averaged shards, (peer, round, bucket) -> values, before
    the all-gather (which rounds them again in a compressed round)."""
    from gossipnet.collectives.lossy import engine, scatter

    sums: dict[tuple[str, int, int], torch.Tensor] = {}

    def finish(rnd: Any) -> list[Any]:
        shards = scatter.finish_rs(rnd)
        for sh in shards:
            sums[(rnd.me, rnd.r, sh.bucket)] = sh.average.clone()
        return shards

    monkeypatch.setattr(engine, "finish_rs", finish)
    return sums


def first_heard(seen: Sequence[tuple[str, str]]) -> dict[str, tuple[str, ...]]:
    """Per receiver, the senders in the order their first data packet arrived."""
    out: dict[str, list[str]] = {}
    for dst, src in seen:
        heard = out.setdefault(dst, [])
        if src not in heard:
            heard.append(src)
    return {k: tuple(v) for k, v in out.items()}


def inputs(r: int, i: int, decades: float) -> list[torch.Tensor]:
    """Peer ``i``'s buckets in round ``r``: each value times its own power of ten
    within ``decades``, so that sums in another order round differently (bf16's
    8-bit values need a wide spread for that; int8's one scale a packet, a narrow one)."""
    g = torch.Generator().manual_seed(1000 * r + i)
    return [
        torch.randn(n, generator=g) * 10.0 ** (decades * (torch.rand(n, generator=g) - 0.5))
        for n in SIZES
    ]


async def run_rounds(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    plan: Callable[[int], FaultPlan],
    n_rounds: int,
    *,
    weights: Sequence[float] = (1.0,) * N,
    compress: Callable[[], Any] | None = None,
    decades: float = 6.0,
    drained: bool = False,
) -> tuple[list[list[list[torch.Tensor]]], list[list[CollectiveReport]], list[Any]]:
    """``n_rounds`` rounds on 4 fresh nodes under ``plan``: per round, every peer's
    outputs and reports; the compress sessions (or Nones).  ``drained``: packets
    handed over in drains of random sizes (the batched intake), not one by one."""
    clock = FakeClock()
    outs: list[list[list[torch.Tensor]]] = []
    reps: list[list[CollectiveReport]] = []
    async with cluster(N, config=cfg, clock=clock, faults=plan) as nodes:
        calls: list[int] = []  # packets per drain
        if drained:
            for i, node in enumerate(nodes):
                batched(node, 7 + i, calls)
        engines = [LossyAllReduce(node) for node in nodes]
        sessions = [compress() if compress is not None else None for _ in range(N)]
        for r in range(n_rounds):
            xs = [inputs(r, i, decades) for i in range(N)]
            runs = [
                e.run(x, RoundOptions(weight=w, timeout_s=5.0, compress=s))
                for e, x, w, s in zip(engines, xs, weights, sessions, strict=True)
            ]
            reps.append(list(await drive(clock, asyncio.gather(*runs), timeout_s=30)))
            outs.append(xs)
    assert not drained or max(calls) > 1
    return outs, reps, sessions


def replays(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    monkeypatch: pytest.MonkeyPatch,
    n_rounds: int,
    *,
    drained: tuple[bool, bool] = (False, False),
    **kw: Any,
) -> tuple[list[Any], list[Any]]:
    """The same rounds under two arrangements (``drained``: per run, whether in
    drains); asserts the arrival orders differ, every round was lossless and
    complete, and every owner's sums are the same bits.  Returns both runs'
    (outputs, sessions)."""
    seen = watch_arrivals(monkeypatch)
    sums = watch_sums(monkeypatch)
    runs, orders, owned = [], [], []
    for seed, drain in zip((1, 2), drained, strict=True):
        seen.clear()
        sums.clear()
        outs, reps, sessions = run_async(
            run_rounds(
                run_async, cluster, drive, cfg, arrangement(seed), n_rounds, drained=drain, **kw
            )
        )
        for rr in reps:
            for rep in rr:
                assert rep.ok, rep
                assert rep.chunks_stale == rep.packets_lost == 0, rep
        runs.append((outs, sessions))
        orders.append(first_heard(seen))
        owned.append(dict(sums))
    assert orders[0] != orders[1]  # each owner heard its senders in another order
    assert all(len(v) == N - 1 for v in orders[0].values())
    assert owned[0].keys() == owned[1].keys()
    for key, avg in owned[0].items():
        diff = int((avg != owned[1][key]).sum())
        assert diff == 0, f"owner {key[0]}, round {key[1]}, bucket {key[2]}: {diff} sums differ"
    return runs[0], runs[1]


def assert_same_bits(a: list[list[list[torch.Tensor]]], b: list[list[list[torch.Tensor]]]) -> None:
    for r, (ra, rb) in enumerate(zip(a, b, strict=True)):
        for i, (xa, xb) in enumerate(zip(ra, rb, strict=True)):
            for k, (ta, tb) in enumerate(zip(xa, xb, strict=True)):
                diff = int((ta != tb).sum())
                assert diff == 0, f"round {r}, peer {i}, bucket {k}: {diff} values differ"


# --------------------------------------------------------------------------- engine
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("weights", "drained"),
    [
        ((1.0,) * N, (False, False)),
        ((0.5, 1.0, 3.0, 0.37), (False, False)),
        ((1.0,) * N, (False, True)),
    ],
    ids=["equal", "weighted", "drained"],
)
def test_lossless_dense_round_replays_whatever_the_arrival_order(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    monkeypatch: pytest.MonkeyPatch,
    weights: tuple[float, ...],
    drained: tuple[bool, bool],
) -> None:
    """Dense rounds, equal or unequal weights; the second run's packets handed over
    in drains (stacked rows, the batched intake) against one by one."""
    (a, _), (b, _) = replays(
        run_async, cluster, drive, cfg, monkeypatch, 2, weights=weights, drained=drained
    )
    assert_same_bits(a, b)
    for ra in a:  # and, as ever, every replica holds the same values
        for x in ra[1:]:
            assert all(torch.equal(t, u) for t, u in zip(x, ra[0], strict=True))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("spec", "decades"),
    [
        (lambda: Int8(), 1.0),
        (lambda: "bf16", 6.0),
        (lambda: ArcTopK(density=0.1, values="int8"), 1.0),
        (lambda: ArcTopK(density=0.05), 1.0),
    ],
    ids=["int8", "bf16", "arctopk-int8", "arctopk"],
)
def test_lossless_compressed_rounds_replay_whatever_the_arrival_order(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    monkeypatch: pytest.MonkeyPatch,
    spec: Callable[[], Any],
    decades: float,
) -> None:
    """Sums and, for ARC-Top-K, the summed sketches that choose the next sets: four
    rounds (each round's sets come from the last one's sketches) give the same
    outputs, sets and error feedback bit for bit."""

    def make() -> CompressSession:
        return CompressSession(spec())

    (a, sa), (b, sb) = replays(
        run_async, cluster, drive, cfg, monkeypatch, 4, compress=make, decades=decades
    )
    assert_same_bits(a, b)
    for s, t in zip(sa, sb, strict=True):
        assert s.force.keys() == t.force.keys()
        for key, (tag, blocks) in s.force.items():
            assert tag == t.force[key][0]
            assert torch.equal(blocks, t.force[key][1]), key
        assert s.sk.keys() == t.sk.keys()  # the last round's summed sketches
        for key, energy in s.sk.items():
            assert torch.equal(energy, t.sk[key]), key
        assert all(torch.equal(e, f) for e, f in zip(s.e, t.e, strict=True))


@pytest.mark.timeout(60)
def test_lossy_round_is_the_fixed_order_mean_of_what_arrived(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    cfg: Config,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """15% loss, the senders heard in a shuffled order: every owner's chunk is
    exactly its own part plus the parts that arrived, in the round's order, over
    their count; every peer holds that average where the broadcast reached it,
    else its own input (stale)."""
    from gossipnet.collectives.lossy import engine, scatter

    arrived: dict[tuple[str, int, int], Any] = {}

    def finish(rnd: Any) -> list[Any]:
        shards = scatter.finish_rs(rnd)
        for sh in shards:
            arrived[(rnd.me, rnd.r, sh.bucket)] = (rnd, sh.average.clone())
        return shards

    monkeypatch.setattr(engine, "finish_rs", finish)
    plan = arrangement(3, loss=0.15)
    outs, reps, _ = run_async(run_rounds(run_async, cluster, drive, cfg, plan, 3))
    assert sum(r.packets_lost for rr in reps for r in rr) > 0
    partial = stale = 0
    for (me, r, b), (rnd, avg) in arrived.items():
        plan_b, owned = rnd.plans[b], rnd.owned[b]
        red = rnd.reducers[b]
        start = plan_b.chunk(owned.start)[0] if len(owned) else 0
        xs = [inputs(r, i, 6.0)[b] for i in range(N)]
        for c in owned:
            off, n = plan_b.chunk(c)
            want = xs[IDS.index(me)][off : off + n].clone()
            count = 1
            for s in IDS:
                if s != me and red.has(s, c):
                    want.add_(xs[IDS.index(s)][off : off + n])
                    count += 1
            want.div_(float(count))
            partial += count < N
            assert torch.equal(avg[off - start : off - start + n], want), (me, r, b, c)
            for i in range(N):
                got = outs[r][i][b][off : off + n]
                if not torch.equal(got, want):
                    assert torch.equal(got, xs[i][off : off + n]), (me, r, b, c, i)
                    stale += 1
    assert partial > 0  # some owner averaged a chunk without every part
    assert stale > 0  # some broadcast was lost


def test_arctopk_summed_sketch_does_not_depend_on_the_arrival_order() -> None:
    """Three senders' sketches of one chunk: one large block energy and two just under
    half its ulp.  Added in arrival order, the small ones vanish one at a time (a, b,
    c) or first add up and move the sum by an ulp (c, b, a): near-tied blocks then
    ranked differently.  The owner's summed sketch is the same bits either way."""
    from types import SimpleNamespace

    from gossipnet.collectives.chunks import ChunkPlan
    from gossipnet.collectives.compress import sparse
    from gossipnet.collectives.compress.payload import NONE, join, uvarint
    from gossipnet.collectives.compress.quant import CODEC_IDS

    n = 256
    rnd = SimpleNamespace(
        plans=[ChunkPlan(n, torch.float32, 4 * n)], participants=IDS, me="p0", r=0
    )
    small = 0.8671875 * 2.0**-12  # exact in bf16; squared, 0.75 of half an ulp of 1
    norms = {"p1": 1.0, "p2": small, "p3": small}

    def summed(order: Sequence[str]) -> torch.Tensor:
        sess = CompressSession(ArcTopK(density=0.1))
        m = -(-n // sess.block)
        for src in order:
            ids = torch.tensor([0], dtype=torch.int32)
            props = torch.tensor([norms[src]], dtype=torch.bfloat16)
            head = sparse._TOPK_RS.pack(CODEC_IDS[sess.values], NONE) + uvarint(1) + uvarint(0)
            payload = memoryview(join(head, ids, props))
            sparse.decode_rs(sess, rnd, src, 0, 0, sparse.Z.TOPK_RS, payload, 1.0)
        energy = sess.sk[(0, 0)]
        assert energy.numel() == m
        return energy

    first, last = summed(("p1", "p2", "p3")), summed(("p3", "p2", "p1"))
    assert torch.equal(first, last), (float(first[0]) - 1.0, float(last[0]) - 1.0)
    e = torch.tensor([norms[p] for p in IDS[1:]]).square()
    assert float(first[0]) == float(e[0] + e[1] + e[2])  # the participants' order


# --------------------------------------------------------------------------- reducer
CHUNK = 4
SENDERS = ("a", "b", "c", "d", "e")


def _parts(
    seed: int, dtype: torch.dtype, weights: Sequence[float]
) -> list[tuple[str, int, torch.Tensor, float]]:
    """Every sender's part of every chunk of a 3.5-chunk shard (chunks 10..13), a few
    lost; values of many magnitudes; each sender's weight drawn from ``weights``."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = []
    for s in SENDERS:
        w = rng.choice(weights)
        for c in range(10, 14):
            if rng.random() < 0.2:
                continue  # lost
            n = 2 if c == 13 else CHUNK
            x = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** rng.randrange(-4, 5)
            out.append((s, c, x.to(dtype), w))
    return out


def _reducer(own: torch.Tensor, weight: float) -> ShardReducer:
    return ShardReducer(own.clone(), range(10, 14), CHUNK, weight, senders=SENDERS)


def _fold(
    own: torch.Tensor, weight: float, parts: list[tuple[str, int, torch.Tensor, float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: per chunk, our weighted part, then each sender's in ``SENDERS``
    order, one ``add_`` each; divided by the weights summed in the same order."""
    acc = own.clone().mul_(weight)
    total = torch.full((4,), weight, dtype=torch.float64)
    by = {(s, c): (x, w) for s, c, x, w in parts}
    for s in SENDERS:
        for c in range(10, 14):
            if (s, c) in by:
                x, w = by[(s, c)]
                lo = (c - 10) * CHUNK
                acc[lo : lo + x.numel()].add_(x.to(acc.dtype), alpha=w)
                total[c - 10] += w
    for c in range(4):
        acc[c * CHUNK : (c + 1) * CHUNK].div_(float(total[c]))
    return acc, total


def _orders(own: torch.Tensor, weight: float, parts: list[Any], seed: int) -> list[Any]:
    """(average, weights, contributors) of ``parts`` shuffled four ways, taken one by
    one or in batches of random sizes."""
    rng = random.Random(seed)
    results = []
    for trial in range(4):
        order = parts[:]
        rng.shuffle(order)
        red = _reducer(own, weight)
        if trial % 2 == 0:
            assert [red.accumulate(*p) for p in order] == [None] * len(order)
        else:
            i = 0
            while i < len(order):
                k = rng.randrange(1, 9)
                assert red.accumulate_batch(order[i : i + k]) == [None] * len(order[i : i + k])
                i += k
        results.append((red.average(own).clone(), red.weights.clone(), red.contributors.clone()))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(5))
def test_reducer_sum_is_the_fixed_order_fold_whatever_the_order_and_batching(
    seed: int, dtype: torch.dtype
) -> None:
    """Parts shuffled, fed one by one or in batches of random sizes: the same bits,
    which are the fold in the senders' fixed order.  (Weights that are powers of
    two, so that every product is exact and the reference may add chunk by chunk.)"""
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    own = torch.randn(14, generator=torch.Generator().manual_seed(seed), dtype=acc_dtype)
    parts = _parts(seed, dtype, (1.0, 0.5, 2.0, 0.25, 4.0))
    want, total = _fold(own, 0.75, parts)
    for avg, w, n in _orders(own, 0.75, parts, seed):
        assert torch.equal(avg, want), (avg - want).abs().max()
        assert torch.equal(w, total)
        assert n.tolist() == [1 + sum(p[1] == c for p in parts) for c in range(10, 14)]


@pytest.mark.parametrize("seed", range(5))
def test_reducer_sum_does_not_depend_on_the_order_with_any_weights(seed: int) -> None:
    """Weights whose products round (0.37, 3): still the same bits in every order,
    the summed weights too."""
    own = torch.randn(14, generator=torch.Generator().manual_seed(seed))
    parts = _parts(seed, torch.float32, (1.0, 0.37, 3.0, 1e-3, 7.5))
    results = _orders(own, 0.3, parts, seed)
    for avg, w, n in results[1:]:
        assert torch.equal(avg, results[0][0])
        assert torch.equal(w, results[0][1])
        assert torch.equal(n, results[0][2])


def test_reducer_refuses_a_sender_outside_its_senders() -> None:
    """Rows are kept per sender: an id outside the round's senders is refused, counted
    by its reason, never given a row (an insider cannot grow the owner's memory)."""
    red = _reducer(torch.zeros(14), 1.0)
    assert red.accumulate("zz", 10, torch.ones(CHUNK), 1.0) == "not_participant"
    assert red.accumulate_batch([("zz", 11, torch.ones(CHUNK), 1.0)]) == ["not_participant"]
    assert red.contributors.tolist() == [1, 1, 1, 1]
