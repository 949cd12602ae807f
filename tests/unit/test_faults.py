"""FaultyTransport: each fault at its configured rate, replayable by seed, per link.

Rates are checked against binomial bounds (+-4.5 sigma) on seeded runs, so the
asserts are exact replays that would still hold for almost any seed, and fail
when a rate is wrong.  Time is a FakeClock: delays and shaping cost no real time.
"""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import pytest

from gossipnet.clock import FakeClock
from gossipnet.errors import ConfigError
from gossipnet.transport.base import Buffer, PacketHandler, Transport
from gossipnet.transport.faults import (
    Crash,
    FaultPlan,
    FaultStats,
    FaultyTransport,
    GilbertElliott,
    Partition,
)
from gossipnet.transport.memory import MemoryNetwork, MemoryTransport

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one test coroutine on a fresh loop in debug mode (no pytest-asyncio)."""
    return asyncio.run(coro, debug=True)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


class Recorder(Transport):
    """Inner transport that records (time, dst, seq, bytes) of what it is asked to send."""

    def __init__(self, address: str, clock: FakeClock) -> None:
        super().__init__()
        self._bind = address
        self.clock = clock
        self.sent: list[tuple[float, str, int, bytes]] = []
        self.forgotten: list[str] = []
        self.closed = False

    @property
    def max_packet_bytes(self) -> int:
        return 12345

    async def start(self, handler: PacketHandler) -> str:
        self._handler = handler
        self.address = self._bind
        return self.address

    def send(self, dst: str, frames: Sequence[Buffer]) -> bool:
        data = b"".join(bytes(f) for f in frames)
        self.sent.append((self.clock.now(), dst, int.from_bytes(data[:4], "big"), data))
        self.stats.sent_packets += 1
        return True

    def forget(self, dst: str) -> None:
        self.forgotten.append(dst)

    async def close(self) -> None:
        self.closed = True


def faulty(
    plan: FaultPlan, clock: FakeClock | None = None, address: str = "a"
) -> tuple[FaultyTransport, Recorder]:
    clock = clock or FakeClock()
    inner = Recorder(address, clock)
    transport = FaultyTransport(inner, plan, clock)
    run(transport.start(lambda frames: None))
    return transport, inner


def send_seq(t: FaultyTransport, dst: str, n: int, size: int = 4, start: int = 0) -> None:
    for i in range(start, start + n):
        t.send(dst, [i.to_bytes(4, "big") + bytes(size - 4)])


def seqs(inner: Recorder, dst: str | None = None) -> list[int]:
    return [s for _, d, s, _ in inner.sent if dst is None or d == dst]


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("p", [0.05, 0.2, 0.5])
def test_loss_rate_within_binomial_bounds(p: float) -> None:
    n = 6000
    t, inner = faulty(FaultPlan(loss=p, seed=11))
    send_seq(t, "b", n)
    delivered = len(inner.sent)
    assert within_binomial(delivered, n, 1 - p)
    assert t.fault_stats.dropped_loss + t.fault_stats.passed == n
    assert t.fault_stats.passed == delivered
    assert t.link_stats[("a", "b")] == t.fault_stats


def test_same_seed_same_pattern_other_seed_differs() -> None:
    patterns = []
    for seed in (5, 5, 6):
        t, inner = faulty(FaultPlan(loss=0.3, seed=seed))
        send_seq(t, "b", 2000)
        patterns.append(seqs(inner))
    assert patterns[0] == patterns[1]
    assert patterns[0] != patterns[2]


def test_third_peer_does_not_change_other_links() -> None:
    plan = FaultPlan(loss=0.3, seed=3)
    alone, inner_alone = faulty(plan)
    send_seq(alone, "b", 2000)
    busy, inner_busy = faulty(plan)
    for i in range(2000):  # interleave traffic to a new peer c
        busy.send("c", [i.to_bytes(4, "big")])
        busy.send("b", [i.to_bytes(4, "big")])
    assert seqs(inner_busy, "b") == seqs(inner_alone, "b")
    assert set(busy.link_stats) == {("a", "b"), ("a", "c")}


def test_loss_pattern_independent_of_other_faults() -> None:
    plain, inner_plain = faulty(FaultPlan(loss=0.2, seed=9))
    send_seq(plain, "b", 3000)
    clock = FakeClock()
    busy_plan = FaultPlan(loss=0.2, seed=9, delay_s=0.01, jitter_s=0.02, reorder=0.1, duplicate=0.3)
    busy, inner_busy = faulty(busy_plan, clock)
    send_seq(busy, "b", 3000)
    clock.advance(1.0)
    assert busy.fault_stats.duplicated > 0
    assert set(seqs(inner_busy)) == set(seqs(inner_plain))


def test_gilbert_elliott_mean_loss_and_burst_length() -> None:
    ge = GilbertElliott.from_rate(0.1, 5.0)
    assert ge.mean_loss == pytest.approx(0.1)
    n = 60_000
    t, inner = faulty(FaultPlan(burst=ge, seed=2))
    send_seq(t, "b", n)
    lost = [True] * n
    for s in seqs(inner):
        lost[s] = False
    bursts: list[int] = []
    for i, gone in enumerate(lost):
        if gone:
            if i > 0 and lost[i - 1]:
                bursts[-1] += 1
            else:
                bursts.append(1)
    assert sum(lost) == t.fault_stats.dropped_burst
    assert sum(lost) / n == pytest.approx(0.1, abs=0.02)
    assert sum(bursts) / len(bursts) == pytest.approx(5.0, abs=0.6)
    half = GilbertElliott(p_good_to_bad=0.1, p_bad_to_good=0.3, loss_good=0.02, loss_bad=0.5)
    assert half.mean_loss == pytest.approx(0.25 * 0.5 + 0.75 * 0.02)


def test_delay_and_jitter_deliver_later_and_reorder() -> None:
    clock = FakeClock()
    t, inner = faulty(FaultPlan(delay_s=0.01, jitter_s=0.02, seed=4), clock)
    send_seq(t, "b", 500)
    assert inner.sent == []
    assert t.fault_stats.delayed == t.pending_delayed == 500
    clock.advance(0.0099)
    assert inner.sent == []
    clock.advance(0.0202)
    assert len(inner.sent) == 500
    assert t.pending_delayed == 0
    times = [when for when, *_ in inner.sent]
    assert all(0.01 <= when <= 0.03 for when in times)
    order = seqs(inner)
    assert sorted(order) == list(range(500))
    assert order != sorted(order)  # jitter reorders

    steady, inner_steady = faulty(FaultPlan(delay_s=0.01), clock := FakeClock())
    send_seq(steady, "b", 100)
    clock.advance(0.01)
    assert seqs(inner_steady) == list(range(100))  # constant delay keeps FIFO


def test_reorder_holds_back_a_fraction() -> None:
    n = 6000
    clock = FakeClock()
    t, inner = faulty(FaultPlan(reorder=0.1, reorder_delay_s=0.005, seed=8), clock)
    send_seq(t, "b", n)
    immediate = set(seqs(inner))
    held = t.fault_stats.reordered
    assert within_binomial(held, n, 0.1)
    assert len(immediate) == n - held == n - t.pending_delayed
    clock.advance(0.005)
    late = seqs(inner)[len(immediate) :]
    assert len(late) == held
    assert not immediate & set(late)


def test_duplicate_rate() -> None:
    n = 6000
    t, inner = faulty(FaultPlan(duplicate=0.1, seed=12))
    send_seq(t, "b", n)
    dups = t.fault_stats.duplicated
    assert within_binomial(dups, n, 0.1)
    assert len(inner.sent) == n + dups
    counts: dict[int, int] = {}
    for s in seqs(inner):
        counts[s] = counts.get(s, 0) + 1
    assert set(counts.values()) == {1, 2}
    assert sum(c == 2 for c in counts.values()) == dups


def test_bandwidth_cap_and_overflow() -> None:
    rate, size = 1_000_000.0, 1000
    clock = FakeClock()
    plan = FaultPlan(bandwidth_bytes_per_s=rate, bucket_bytes=10_000, max_queue_delay_s=0.05)
    t, inner = faulty(plan, clock)
    sent_at: dict[int, float] = {}
    seq = 0
    for _ in range(2000):  # offer 2 MB/s for 2 s
        for _ in range(2):
            sent_at[seq] = clock.now()
            send_seq(t, "b", 1, size=size, start=seq)
            seq += 1
        clock.advance(0.001)
    clock.advance(0.1)
    window = [when for when, *_ in inner.sent if 0.5 <= when < 1.5]
    assert len(window) * size == pytest.approx(rate * 1.0, rel=0.1)
    stats = t.fault_stats
    assert stats.passed + stats.dropped_bandwidth == seq
    assert 0.4 < stats.dropped_bandwidth / seq < 0.6  # half the offered load is excess
    waits = [when - sent_at[s] for when, _, s, _ in inner.sent]
    assert max(waits) <= 0.05 + 1e-9
    assert max(waits) > 0.04  # the queue really filled up

    light, inner_light = faulty(plan, clock := FakeClock())
    for i in range(500):  # 0.5 MB/s: under the cap, nothing dropped
        send_seq(light, "b", 1, size=size, start=i)
        clock.advance(0.002)
    clock.advance(0.1)
    assert light.fault_stats.dropped_bandwidth == 0
    assert seqs(inner_light) == list(range(500))


def _matrix(plan: FaultPlan, names: Sequence[str], times: Sequence[float]) -> list[set[str]]:
    """For each time, the set of "src>dst" links whose packet was forwarded."""
    clock = FakeClock()
    ends = {n: faulty(plan, clock, address=n) for n in names}
    out = []
    for when in times:
        clock.advance(when - clock.now())
        for src, (t, _) in ends.items():
            for dst in names:
                if dst != src:
                    t.send(dst, [b"\0\0\0\0"])
        out.append(
            {f"{s}>{d}" for s, (_, inner) in ends.items() for at, d, *_ in inner.sent if at == when}
        )
    return out


def test_partition_blocks_exactly_its_links_and_heals() -> None:
    names = ("a", "b", "c", "d")
    everything = {f"{s}>{d}" for s in names for d in names if s != d}
    plan = FaultPlan(partitions=(Partition(1.0, 2.0, groups=(frozenset("a"), frozenset("bc"))),))
    before, during, late, healed = _matrix(plan, names, (0.5, 1.0, 1.999, 2.0))
    assert before == healed == everything
    cut = {"a>b", "b>a", "a>c", "c>a"}
    assert during == late == everything - cut  # d is in no group: not cut off
    one_way = FaultPlan(partitions=(Partition(1.0, 2.0, links=frozenset({("a", "b")})),))
    assert _matrix(one_way, names, (1.5,)) == [everything - {"a>b"}]


def test_plan_time_starts_at_start() -> None:
    clock = FakeClock(start=100.0)
    plan = FaultPlan(partitions=(Partition(1.0, 2.0, links=frozenset({("a", "b")})),))
    t, inner = faulty(plan, clock)
    clock.advance(1.5)
    assert t.plan_time_s == pytest.approx(1.5)
    t.send("b", [b"\0\0\0\0"])
    assert inner.sent == []
    assert t.fault_stats.dropped_partition == 1


def test_crash_black_holes_both_ways_and_revives() -> None:
    async def main() -> None:
        clock, net = FakeClock(), MemoryNetwork()
        plan = FaultPlan(
            crash=(Crash("mem://b", 1.0, until_s=2.0),),
            links={("mem://a", "mem://b"): FaultPlan(delay_s=0.3)},
        )
        got: dict[str, list[bytes]] = {"mem://a": [], "mem://b": []}
        ends = {}
        for name in got:
            ends[name] = FaultyTransport(MemoryTransport(net, name), plan, clock)
            await ends[name].start(lambda f, name=name: got[name].append(bytes(f[0])))
        a, b = ends["mem://a"], ends["mem://b"]

        async def at(when: float, tag: bytes) -> None:
            clock.advance(when - clock.now())
            await settle()
            a.send("mem://b", [tag])
            b.send("mem://a", [tag])
            await settle()

        await at(0.5, b"up")
        await at(0.8, b"in-flight")  # a->b lands at 1.1, when b is down
        await at(1.2, b"down")
        await at(2.0, b"revived")
        clock.advance(0.3)
        await settle()
        assert got["mem://a"] == [b"up", b"in-flight", b"revived"]
        assert got["mem://b"] == [b"up", b"revived"]
        assert a.fault_stats.dropped_crash == 1  # a->b while b is down
        assert b.fault_stats.dropped_crash == 2  # b->a while down + in-flight arrival
        assert a.is_crashed("mem://b", 1.5)
        assert not a.is_crashed("mem://b", 2.0)
        await a.close()
        await b.close()

    run(main())


def test_link_override_and_counters_match() -> None:
    async def main() -> None:
        clock, net = FakeClock(), MemoryNetwork()
        names = [f"mem://p{i}" for i in range(3)]
        plan = FaultPlan(
            seed=21,
            loss=0.1,
            burst=GilbertElliott.from_rate(0.05, 3),
            jitter_s=0.01,
            reorder=0.05,
            duplicate=0.05,
            bandwidth_bytes_per_s=0.5e6,
            bucket_bytes=8000,
            partitions=(Partition(0.2, 0.3, groups=(frozenset(names[:1]), frozenset(names[1:]))),),
            links={(names[0], names[2]): FaultPlan(loss=1.0)},
        )
        inbox = {n: 0 for n in names}
        ends = []
        for name in names:
            t = FaultyTransport(MemoryTransport(net, name), plan, clock)
            await t.start(lambda f, name=name: inbox.__setitem__(name, inbox[name] + 1))
            ends.append(t)
        sends = 0
        for step in range(500):
            for t in ends:
                for dst in names:
                    if dst != t.name:
                        t.send(dst, [step.to_bytes(4, "big") + bytes(996)])
                        sends += 1
            clock.advance(0.001)
            await settle()
        clock.advance(1.0)
        await settle()
        totals = FaultStats()
        for t in ends:
            per_link = FaultStats()
            for stats in t.link_stats.values():
                for k, v in stats.as_dict().items():
                    setattr(per_link, k, getattr(per_link, k) + v)
                    setattr(totals, k, getattr(totals, k) + v)
            assert per_link == t.fault_stats
            assert t.stats is t.inner.stats
            assert t.stats.sent_packets == t.fault_stats.passed + t.fault_stats.duplicated
        assert totals.passed + totals.dropped == sends
        assert all(getattr(totals, k) > 0 for k in totals.as_dict() if k != "dropped_crash")
        assert sum(inbox.values()) == sum(t.stats.sent_packets for t in ends)
        override = ends[0].link_stats[(names[0], names[2])]
        assert override.passed == 0
        assert override.dropped_loss + override.dropped_partition == 500
        for t in ends:
            await t.close()

    run(main())


def test_forwarding_and_close_cancels_delayed() -> None:
    clock = FakeClock()
    t, inner = faulty(FaultPlan(delay_s=0.1), clock)
    assert t.address == "a" == t.name
    assert t.stats is inner.stats
    assert t.max_packet_bytes == 12345
    assert t.default_chunk_bytes == inner.default_chunk_bytes
    t.forget("b")
    assert inner.forgotten == ["b"]
    buf = bytearray(b"\0\0\0\1orig")
    t.send("b", [buf])
    buf[4:] = b"gone"
    t.send("b", [b"\0\0\0\2"])
    clock.advance(0.1)
    assert [d for *_, d in inner.sent] == [b"\0\0\0\1orig", b"\0\0\0\2"]  # copied when delayed
    t.send("b", [b"\0\0\0\3"])
    assert t.pending_delayed == 1
    run(t.close())
    run(t.close())
    assert inner.closed
    assert t.pending_delayed == 0
    clock.advance(1.0)
    assert len(inner.sent) == 2
    assert not t.send("b", [b"\0\0\0\4"])
    unstarted = FaultyTransport(Recorder("z", clock), FaultPlan(), clock)
    assert not unstarted.send("b", [b"\0\0\0\0"])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FaultPlan(loss=1.5), "loss"),
        (lambda: FaultPlan(duplicate=float("nan")), "duplicate"),
        (lambda: FaultPlan(delay_s=-0.1), "delay_s"),
        (lambda: FaultPlan(jitter_s=float("inf")), "jitter_s"),
        (lambda: FaultPlan(bandwidth_bytes_per_s=0), "bandwidth"),
        (lambda: FaultPlan(bucket_bytes=0), "bucket_bytes"),
        (lambda: FaultPlan(seed=1.5), "seed"),  # type: ignore[arg-type]
        (lambda: Partition(2.0, 1.0, links=frozenset()), "end_s"),
        (lambda: Partition(0.0, 1.0), "groups"),
        (lambda: Partition(0.0, 1.0, groups=(frozenset("ab"), frozenset("b"))), "overlap"),
        (lambda: Crash("a", 1.0, until_s=1.0), "until_s"),
        (lambda: GilbertElliott(p_good_to_bad=0.1, p_bad_to_good=0.0), "never ends"),
        (lambda: GilbertElliott.from_rate(1.0, 4), "mean_loss"),
        (lambda: GilbertElliott.from_rate(0.1, 0.5), "mean_burst"),
        (lambda: GilbertElliott.from_rate(0.9, 1.0), "longer bursts"),
        (lambda: FaultPlan(links={("a", "b"): FaultPlan(crash=(Crash("a", 0),))}), "top-level"),
    ],
)
def test_invalid_plans_raise_config_error(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_plan_value_semantics() -> None:
    links = {("a", "b"): FaultPlan(loss=0.5)}
    plan = FaultPlan(seed=1, links=links, partitions=[Partition(0, 1, groups=[{"a"}, {"b"}])])  # type: ignore[arg-type]
    links.clear()  # the plan keeps its own copy
    assert plan.for_link("a", "b").loss == 0.5
    assert plan.for_link("b", "a") is plan
    assert plan.partitions[0].groups == (frozenset("a"), frozenset("b"))
    assert pickle.loads(pickle.dumps(plan)) == plan  # plans travel to spawned peers
    assert hash(plan) == hash(
        FaultPlan(seed=1, links={("a", "b"): FaultPlan(loss=0.5)}, partitions=plan.partitions)
    )
