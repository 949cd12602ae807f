"""Check the testbed's links before trusting them: measured loss and rate.

Why: a testbed that silently does not drop (a rule on the wrong hook, a
wrong port name) would make every "survives 10% loss" claim vacuous, and one
that drops more than asked (receive-buffer overflow, fragmentation) would
make gossipnet look worse than it is.  So before training, N numbered UDP
datagrams cross each link and the count that arrived must lie within
binomial bounds of the set rate; the switch's own counters and the
receiver's ``RcvbufErrors`` say where any extra loss came from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gossipnet.testbed import _probe

if TYPE_CHECKING:
    from gossipnet.testbed._host import Host
    from gossipnet.testbed._net import Testbed

__all__ = (
    "FrameCheck",
    "LossMeasurement",
    "binomial_bounds",
    "check_tcp_frames",
    "measure_links",
    "measure_loss",
    "measure_throughput",
)

#: z of the bounds: a fair link falls outside with probability ~7e-6 (4.5 sigma),
#: so the check is not flaky, yet 5000 packets pin 10% loss to +-1.9 points.
Z_BOUND = 4.5


def binomial_bounds(n: int, p: float, z: float = Z_BOUND) -> tuple[float, float]:
    """Range of loss *rates* that ``n`` Bernoulli(``p``) trials land in, +-``z`` sigma.

    Half a packet of continuity correction, so p = 0 allows exactly no loss and
    p = 1 exactly total loss.
    """
    if n <= 0:
        raise ValueError("n must be > 0")
    half = z * math.sqrt(n * p * (1.0 - p)) + 0.5
    return max(0.0, (n * p - half) / n), min(1.0, (n * p + half) / n)


@dataclass(frozen=True, slots=True)
class LossMeasurement:
    """Outcome of one probe from ``src`` to ``dst``.

    ``switch_dropped``: datagrams the switch's rules dropped during the probe
    (its counters; includes stray frames, usually none).
    ``rcvbuf_errors``: datagrams the receiving kernel dropped for a full buffer;
    non-zero means the probe, not the link, lost them.
    """

    src: str
    dst: str
    expected_rate: float
    sent: int
    received: int
    low: float
    high: float
    switch_dropped: int
    rcvbuf_errors: int

    @property
    def rate(self) -> float:
        return 1.0 - self.received / self.sent if self.sent else float("nan")

    @property
    def ok(self) -> bool:
        return self.sent > 0 and self.low <= self.rate <= self.high and self.rcvbuf_errors == 0

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "OUT OF BOUNDS"
        return (
            f"{self.src}->{self.dst}: lost {self.sent - self.received}/{self.sent} = "
            f"{self.rate:.2%} (set {self.expected_rate:.2%}, bounds "
            f"[{self.low:.2%}, {self.high:.2%}]) {verdict}; switch dropped "
            f"{self.switch_dropped}, receiver buffer drops {self.rcvbuf_errors}"
        )


def _expected(tb: Testbed, src: Host, dst: Host) -> float:
    a, b = tb.links[src.name], tb.links[dst.name]
    if tb.is_cut(src) or tb.is_cut(dst):
        return 1.0
    return 1.0 - (1.0 - a.loss_out) * (1.0 - b.loss_in)


def _drops(counters: dict[str, int], src: Host, dst: Host) -> int:
    keys = (
        f"{src.name} loss-out",
        f"{src.name} cut-out",
        f"{dst.name} loss-in",
        f"{dst.name} cut-in",
    )
    return sum(counters.get(k, 0) for k in keys)


def measure_loss(
    tb: Testbed,
    src: int | str | Host,
    dst: int | str | Host,
    *,
    count: int = 5000,
    rate_pps: float = 20000.0,
    port: int = 9900,
    timeout_s: float = 30.0,
) -> LossMeasurement:
    """Send ``count`` numbered datagrams ``src`` -> ``dst`` and count arrivals.

    The expected rate is what the testbed's settings imply for this pair
    (1 - (1 - src loss_out)(1 - dst loss_in), or 1 if either end is cut).
    Datagrams are 1000 bytes: one frame each, like gossipnet's MTU-sized chunks.
    """
    return measure_links(
        tb, [(src, dst)], count=count, rate_pps=rate_pps, port=port, timeout_s=timeout_s
    )[0]


def measure_links(
    tb: Testbed,
    pairs: Sequence[tuple[int | str | Host, int | str | Host]],
    *,
    count: int = 5000,
    rate_pps: float = 20000.0,
    port: int = 9900,
    timeout_s: float = 30.0,
) -> list[LossMeasurement]:
    """:func:`measure_loss` for several (src, dst) pairs at once (one port each).

    ``switch_dropped`` of a pair counts every frame its source sent and its
    destination was sent that the rules dropped, so it is exact when each
    host is the source of at most one pair (e.g. a ring h0->h1->...->h0).
    """
    hosts = [(tb.host(a), tb.host(b)) for a, b in pairs]
    marks = []
    for i, (s, d) in enumerate(hosts):
        ready = tb.run_dir / f"probe-{s.name}-{d.name}-{port + i}.ready"
        done = ready.with_suffix(".done")
        ready.unlink(missing_ok=True)
        done.unlink(missing_ok=True)
        marks.append((ready, done))
    before = tb.counters()
    buf0 = {d.name: d.snmp().get("Udp", {}).get("RcvbufErrors", 0) for _, d in hosts}
    sinks = [
        d.start(
            _probe.udp_sink,
            d.ip,
            port + i,
            str(r),
            str(dn),
            count,
            0.3,
            timeout_s,
            standalone=True,
            label=f"sink-{s.name}-{d.name}-{port + i}",
        )
        for i, ((s, d), (r, dn)) in enumerate(zip(hosts, marks, strict=True))
    ]
    sources = [
        s.start(
            _probe.udp_source,
            d.ip,
            port + i,
            str(r),
            count,
            1000,
            rate_pps,
            standalone=True,
            label=f"source-{s.name}-{d.name}-{port + i}",
        )
        for i, ((s, d), (r, _)) in enumerate(zip(hosts, marks, strict=True))
    ]
    sent = [task.result(timeout_s) for task in sources]
    for _, done in marks:
        done.touch()
    got = [task.result(timeout_s) for task in sinks]
    after = tb.counters()
    out = []
    for (s, d), snt, gt in zip(hosts, sent, got, strict=True):
        p = _expected(tb, s, d)
        n = int(snt["sent"])
        low, high = binomial_bounds(n, p) if n else (0.0, 1.0)
        buf1 = d.snmp().get("Udp", {}).get("RcvbufErrors", 0)
        out.append(
            LossMeasurement(
                src=s.name,
                dst=d.name,
                expected_rate=p,
                sent=n,
                received=int(gt["distinct"]),
                low=low,
                high=high,
                switch_dropped=_drops(after, s, d) - _drops(before, s, d),
                rcvbuf_errors=buf1 - buf0[d.name],
            )
        )
    return out


def measure_throughput(
    tb: Testbed,
    src: int | str | Host,
    dst: int | str | Host,
    *,
    nbytes: int = 2_000_000,
    port: int = 9978,
    timeout_s: float = 30.0,
) -> float:
    """Goodput of one TCP transfer ``src`` -> ``dst`` in Mbit/s (to check a cap)."""
    s, d = tb.host(src), tb.host(dst)
    ready = tb.run_dir / f"tcp-{s.name}-{d.name}-{port}.ready"
    ready.unlink(missing_ok=True)
    sink = d.start(_probe.tcp_sink, d.ip, port, str(ready), timeout_s, standalone=True)
    src_task = s.start(_probe.tcp_source, d.ip, port, str(ready), nbytes, standalone=True)
    sent = src_task.result(timeout_s)
    sink.result(timeout_s)
    return float(nbytes * 8 / sent["seconds"] / 1e6)


@dataclass(frozen=True, slots=True)
class FrameCheck:
    """What the switch's loss rule saw of one TCP transfer from ``src``.

    Why: the kernel's random drop is per packet *as the rule sees it*.  If TCP
    handed the veth 64 KB GSO super-packets, one drop would take out ~45 wire
    frames (at MTU 1500) at once and TCP would suffer bursts no wire has;
    the testbed sets ``gso_max_segs 1`` so that every packet is one wire frame,
    and this check proves it: no packet longer than the MTU crossed the rule.
    """

    src: str
    mtu: int
    packets: int
    bytes: int
    oversize: int
    goodput_mbit: float

    @property
    def avg_bytes(self) -> float:
        return self.bytes / self.packets if self.packets else float("nan")

    @property
    def ok(self) -> bool:
        return self.packets > 0 and self.oversize == 0

    def __str__(self) -> str:
        verdict = "ok: one wire frame per packet" if self.ok else "OVERSIZE PACKETS (GSO on?)"
        return (
            f"{self.src} TCP as the loss rule sees it: {self.packets} packets, "
            f"avg {self.avg_bytes:.0f} B, {self.oversize} longer than MTU {self.mtu}; "
            f"{self.goodput_mbit:.0f} Mbit/s; {verdict}"
        )


def check_tcp_frames(
    tb: Testbed,
    src: int | str | Host,
    dst: int | str | Host,
    *,
    nbytes: int = 4_000_000,
    timeout_s: float = 30.0,
) -> FrameCheck:
    """Send ``nbytes`` over TCP ``src`` -> ``dst`` and count what the switch's rules saw."""
    s = tb.host(src)
    keys = (f"{s.name} seen-out", f"{s.name} oversize-out")
    p0, b0 = tb.counters(), tb.counters("bytes")
    mbit = measure_throughput(tb, s, dst, nbytes=nbytes, timeout_s=timeout_s)
    p1, b1 = tb.counters(), tb.counters("bytes")
    return FrameCheck(
        src=s.name,
        mtu=tb.config.mtu,
        packets=p1.get(keys[0], 0) - p0.get(keys[0], 0),
        bytes=b1.get(keys[0], 0) - b0.get(keys[0], 0),
        oversize=p1.get(keys[1], 0) - p0.get(keys[1], 0),
        goodput_mbit=mbit,
    )
