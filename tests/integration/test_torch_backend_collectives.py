"""The ``gossipnet`` torch.distributed backend's collectives, rank by rank.

Three ranks run in threads of this process, each a real peer on 127.0.0.1 found
through one shared ``HashStore`` (the rendezvous torch runs for
``init_process_group``), so every call crosses real sockets.  Each test asserts the
semantics DDP and frameworks rely on: SUM/AVG scaling of the lossy all-reduce, exact
broadcast and allgather in rank order, a barrier that holds until the last rank
enters, ``Work.wait``'s timeout, the errors for calls the backend does not offer, and
survivors that go on when a rank dies.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gossipnet import Config
from gossipnet.distributed import last_report
from gossipnet.distributed.options import GossipnetOptions, resolve_options
from gossipnet.distributed.process_group import ProcessGroupGossipnet
from gossipnet.distributed.rendezvous import start_peer
from gossipnet.distributed.tensors import UnsupportedError
from gossipnet.testing import wait_until_sync

WORLD = 3
#: Fast failure detection for the churn test; a generous collective bound elsewhere.
CONFIG = Config(
    heartbeat_interval_s=0.1,
    failure_timeout_s=1.0,
    control_retry_s=0.02,
    join_timeout_s=20.0,
    collective_timeout_s=5.0,
)
#: Bounds a hang of one call, not its speed (calls take milliseconds on loopback).
CALL_S = 30.0


def _groups(config: Config = CONFIG) -> list[ProcessGroupGossipnet]:
    store = dist.HashStore()
    opts = GossipnetOptions(config=config, handle_sigterm=False)

    def make(rank: int) -> ProcessGroupGossipnet:
        resolved = resolve_options(opts, rank, env={})
        td = datetime.timedelta(seconds=CALL_S)
        peer, exchange = start_peer(store, rank, WORLD, resolved, group="t", timeout=td)
        return ProcessGroupGossipnet(peer, exchange, rank, WORLD, resolved, CALL_S)

    with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(make, range(WORLD)))


@pytest.fixture(scope="module")
def groups() -> Iterator[list[ProcessGroupGossipnet]]:
    made = _groups()
    yield made
    for pg in made:
        pg.abort()


def on_all(
    groups: list[ProcessGroupGossipnet], fn: Callable[[ProcessGroupGossipnet, int], Any]
) -> list[Any]:
    """``fn(pg, rank)`` on every rank at once (collectives block until all call)."""
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        futs = [pool.submit(fn, pg, r) for r, pg in enumerate(groups)]
        return [f.result(timeout=CALL_S) for f in futs]


def _allreduce(
    op: Any, make: Callable[[int], torch.Tensor]
) -> Callable[[ProcessGroupGossipnet, int], torch.Tensor]:
    def run(pg: ProcessGroupGossipnet, rank: int) -> torch.Tensor:
        t = make(rank)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([t], opts).wait()
        return t

    return run


@pytest.mark.timeout(60)
def test_lossy_sum_is_world_times_mean_and_avg_the_mean(
    groups: list[ProcessGroupGossipnet],
) -> None:
    torch.manual_seed(0)
    n = 4096  # 16 KiB: above exact_max_bytes, so the lossy all-reduce
    base = torch.randn(n)
    before = [pg.totals["lossy_rounds"] for pg in groups]
    sums = on_all(groups, _allreduce(dist.ReduceOp.SUM, lambda r: base * (r + 1)))
    avgs = on_all(groups, _allreduce(dist.ReduceOp.AVG, lambda r: base * (r + 1)))
    for s, a in zip(sums, avgs, strict=True):
        torch.testing.assert_close(s, base * 6, rtol=1e-5, atol=1e-5)  # 3 x mean(1,2,3)
        torch.testing.assert_close(a, base * 2, rtol=1e-5, atol=1e-5)
    for pg, b in zip(groups, before, strict=True):
        assert pg.totals["lossy_rounds"] == b + 2
        report = last_report(pg)
        assert report is not None
        assert report.method == "allreduce"
        assert report.chunks_stale == 0
        assert report.packets_lost == 0
        assert "cpu_s" in report.extra


@pytest.mark.timeout(60)
def test_small_integer_and_min_max_product_are_exact(groups: list[ProcessGroupGossipnet]) -> None:
    cases = [
        (dist.ReduceOp.SUM, lambda r: torch.tensor([r, 10 * r], dtype=torch.int64), [3, 30]),
        (dist.ReduceOp.MAX, lambda r: torch.tensor([r, -r], dtype=torch.int32), [2, 0]),
        (dist.ReduceOp.MIN, lambda r: torch.tensor([r + 0.5]), [0.5]),
        (dist.ReduceOp.PRODUCT, lambda r: torch.tensor([r + 2.0]), [24.0]),
        (dist.ReduceOp.SUM, lambda r: torch.tensor([0.1 * (r + 1)]), [0.1 + 0.2 + 0.3]),
    ]
    before = groups[0].totals["lossy_rounds"]
    for op, make, want in cases:
        for got in on_all(groups, _allreduce(op, make)):
            assert got.tolist() == pytest.approx(want, rel=1e-6)
    assert groups[0].totals["lossy_rounds"] == before  # none of them went lossy


@pytest.mark.timeout(60)
def test_broadcast_is_byte_exact(groups: list[ProcessGroupGossipnet]) -> None:
    gen = torch.Generator().manual_seed(1)
    sent = [torch.randn(50_000, generator=gen), torch.randint(0, 255, (7, 3), generator=gen)]

    def run(pg: ProcessGroupGossipnet, rank: int) -> list[torch.Tensor]:
        mine = [t.clone() if rank == 1 else torch.zeros_like(t) for t in sent]
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        work = pg.broadcast(mine, opts)
        assert work.get_future().wait() == mine  # the future's value: the tensor list
        return mine

    for got in on_all(groups, run):
        for g, s in zip(got, sent, strict=True):
            assert torch.equal(g, s)


@pytest.mark.timeout(60)
def test_allgather_fills_rank_order(groups: list[ProcessGroupGossipnet]) -> None:
    def run(pg: ProcessGroupGossipnet, rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        outs = [[torch.zeros(2, 2) for _ in range(WORLD)]]
        pg.allgather(outs, [torch.full((2, 2), float(rank))]).wait()
        flat = torch.zeros(WORLD * 3, dtype=torch.int64)
        pg._allgather_base(flat, torch.arange(3) + 100 * rank).wait()
        return outs[0], flat

    for outs, flat in on_all(groups, run):
        assert [float(o[0, 0]) for o in outs] == [0.0, 1.0, 2.0]
        assert flat.tolist() == [0, 1, 2, 100, 101, 102, 200, 201, 202]


@pytest.mark.timeout(60)
def test_reduce_scatter_gives_each_rank_its_reduced_slice(
    groups: list[ProcessGroupGossipnet],
) -> None:
    def run(pg: ProcessGroupGossipnet, rank: int) -> torch.Tensor:
        out = torch.zeros(2, dtype=torch.int64)
        inputs = [[torch.tensor([10 * r + rank, 1]) for r in range(WORLD)]]
        pg.reduce_scatter([out], inputs).wait()
        return out

    for rank, out in enumerate(on_all(groups, run)):
        assert out.tolist() == [30 * rank + 3, 3]  # sum over senders s of 10*rank + s


@pytest.mark.timeout(60)
def test_barrier_holds_until_the_last_rank_and_wait_times_out(
    groups: list[ProcessGroupGossipnet],
) -> None:
    early = [groups[0].barrier(), groups[1].barrier()]
    with pytest.raises(dist.DistBackendError, match=r"did not complete within 0\.3 s"):
        early[0].wait(datetime.timedelta(seconds=0.3))
    assert not early[1].is_completed()
    groups[2].barrier().wait(datetime.timedelta(seconds=CALL_S))
    for w in early:
        assert w.wait(datetime.timedelta(seconds=CALL_S))
        assert w.is_success()


@pytest.mark.timeout(60)
def test_a_lossless_round_is_ok_on_every_rank(groups: list[ProcessGroupGossipnet]) -> None:
    """A 16 KiB all-reduce is one chunk, owned by rank 0: ranks 1 and 2 owe each other
    nothing, so neither names the other missing (before, every such round read
    ``ok: False`` on both and counted in ``rounds_missing_peers``)."""
    before = [pg.totals["rounds_missing_peers"] for pg in groups]
    for _ in range(3):
        on_all(groups, _allreduce(dist.ReduceOp.AVG, lambda r: torch.full((4096,), r + 1.0)))
        for pg in groups:
            report = last_report(pg)
            assert report is not None
            assert report.chunks_total == 1  # the case: fewer chunks than ranks
            assert report.missing == (), report
            assert report.ok, report
    assert [pg.totals["rounds_missing_peers"] for pg in groups] == before


@pytest.mark.timeout(60)
def test_unsupported_calls_and_ops_are_named(groups: list[ProcessGroupGossipnet]) -> None:
    pg = groups[0]
    with pytest.raises(UnsupportedError, match="all_to_all is not supported"):
        pg.alltoall([torch.zeros(1)], [torch.zeros(1)])
    with pytest.raises(UnsupportedError, match="send is not supported"):
        pg.send([torch.zeros(1)], 1, 0)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.BAND
    with pytest.raises(UnsupportedError, match="BAND needs integer"):
        pg.allreduce([torch.zeros(4)], opts)
    assert pg.totals["calls_allreduce"] >= 0  # the group still works afterwards:
    test_allgather_fills_rank_order(groups)


@pytest.mark.timeout(90)
def test_survivors_go_on_when_a_rank_dies() -> None:
    """A rank's peer vanishes (no LEAVE): the others' lossy all-reduces complete,
    within the failure timeout plus a round bound, averaging over the survivors."""
    made = _groups()
    try:
        on_all(made, _allreduce(dist.ReduceOp.SUM, lambda r: torch.ones(2048)))
        made[2].abort()
        survivors = made[:2]
        for step in range(4):
            got = on_all(
                survivors, _allreduce(dist.ReduceOp.SUM, lambda r: torch.full((2048,), r + 1.0))
            )
            if step == 3:  # the dead rank is known by now: 3 x mean(1, 2)
                for g in got:
                    torch.testing.assert_close(g, torch.full((2048,), 4.5))
        # rank 0 owns the one chunk, so it was owed the dead rank's contributions and
        # names it; rank 1 owns nothing and was owed nothing by it
        assert survivors[0].totals["rounds_missing_peers"] >= 1
        on_all(survivors, lambda pg, _r: pg.barrier().wait())  # the dead rank is excused
    finally:
        for pg in made[:2]:
            pg.abort()


@pytest.mark.timeout(60)
def test_a_broadcast_sent_before_the_receiver_built_its_group_arrives() -> None:
    """Rank 0 broadcasts (and its parts are acknowledged) before rank 1 has made its
    process group: the parts must wait in rank 1's inbox, not be acked and dropped.
    (A Lightning run at 10% loss once hung so: its rank 0 left the rendezvous first.)
    The root completes once rank 1 joined the broadcast, as under gloo."""
    store = dist.HashStore()
    opts = resolve_options(GossipnetOptions(config=CONFIG, handle_sigterm=False), 0, env={})
    td = datetime.timedelta(seconds=CALL_S)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = list(
            pool.map(lambda r: start_peer(store, r, 2, opts, group="early", timeout=td), range(2))
        )
    pgs: list[ProcessGroupGossipnet] = []
    try:
        pgs.append(ProcessGroupGossipnet(*started[0], 0, 2, opts, CALL_S))
        sent = torch.arange(10, dtype=torch.float64)
        root = pgs[0].broadcast([sent], dist.BroadcastOptions())
        inbox = started[1][1]
        wait_until_sync(lambda: inbox.counters["parts_in"] >= 1, CALL_S)  # acked by rank 1
        pgs.append(ProcessGroupGossipnet(*started[1], 1, 2, opts, CALL_S))
        got = torch.zeros(10, dtype=torch.float64)
        pgs[1].broadcast([got], dist.BroadcastOptions()).wait(td)
        root.wait(td)
        assert torch.equal(got, sent)
    finally:
        for pg in pgs:
            pg.abort()
        for peer, _ in started[len(pgs) :]:
            peer.close()
