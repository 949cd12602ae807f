"""Deliberate, seeded, per-link network faults that wrap any transport backend.

Why a wrapper and not a backend feature: one :class:`FaultPlan` must mean the same
losses, delays and cuts on the memory hub, on ZeroMQ and on UDP, so that a failure
found in a unit test replays on real sockets (the trio ``FakeNet`` router and
Linux ``netem``/``tbf`` are the models).

Determinism: every directed link ``src -> dst`` owns one
``random.Random(f"{seed}:{src}->{dst}")`` (a string seed is stable across processes;
``hash()`` is not), created lazily, so adding a peer never changes another link's
fates.  Each packet draws the same seven values in the same order
whichever faults are switched on, so the i-th packet of a link is lost under
``loss=0.1`` whether or not jitter or duplication is also on.

Time: plan time is ``clock.now()`` minus the clock reading when the transport
started.  Delays are ``clock.call_later`` timers, never a task per packet, and the
hot path of an undelayed packet is a few draws and comparisons.

Dropped packets are lost "in the network": :meth:`FaultyTransport.send` still
returns True for them, as a real socket does for a datagram the network loses,
so the layers above cannot cheat; the counters in ``fault_stats`` say what happened.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar

from ..clock import Clock, TimerHandle
from ..errors import ClosedError, ConfigError
from .base import Buffer, PacketHandler, Transport, TransportStats

__all__ = ("Crash", "FaultPlan", "FaultStats", "FaultyTransport", "GilbertElliott", "Partition")

Link = tuple[str, str]


def _check_prob(owner: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ConfigError(f"{owner}.{name} must be a probability in [0, 1], got {value!r}")


def _check_time(owner: str, name: str, value: float) -> None:
    if not (value >= 0.0 and math.isfinite(value)):
        raise ConfigError(f"{owner}.{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class GilbertElliott:
    """Bursty loss: a two-state (good/bad) Markov chain stepped once per packet.

    Why: real loss comes in bursts (congestion, fading radio), and a loss-tolerant
    all-reduce that survives 10% independent loss may not survive 10% in runs of 8.
    In the bad state a packet is lost with ``loss_bad``, in the good one with
    ``loss_good``; with the defaults the mean burst is ``1 / p_bad_to_good`` packets
    and the mean loss is ``p_good_to_bad / (p_good_to_bad + p_bad_to_good)``.
    """

    p_good_to_bad: float
    p_bad_to_good: float
    loss_good: float = 0.0
    loss_bad: float = 1.0

    def __post_init__(self) -> None:
        for name in ("p_good_to_bad", "p_bad_to_good", "loss_good", "loss_bad"):
            _check_prob("GilbertElliott", name, getattr(self, name))
        if self.p_bad_to_good == 0.0:
            raise ConfigError("GilbertElliott.p_bad_to_good must be > 0, or a burst never ends")

    @classmethod
    def from_rate(cls, mean_loss: float, mean_burst_packets: float) -> GilbertElliott:
        """The chain with stationary loss ``mean_loss`` in bursts of ``mean_burst_packets``.

        Raises:
            ConfigError: ``mean_loss`` outside [0, 1), ``mean_burst_packets`` < 1, or a
                combination that needs a transition probability above 1.
        """
        if not 0.0 <= mean_loss < 1.0:
            raise ConfigError(f"mean_loss must be in [0, 1), got {mean_loss!r}")
        if not mean_burst_packets >= 1.0 or math.isinf(mean_burst_packets):
            raise ConfigError(f"mean_burst_packets must be finite, >= 1: {mean_burst_packets}")
        p_bad_to_good = 1.0 / mean_burst_packets
        p_good_to_bad = mean_loss * p_bad_to_good / (1.0 - mean_loss)
        if p_good_to_bad > 1.0:
            raise ConfigError(
                f"mean_loss={mean_loss} with bursts of {mean_burst_packets} packets needs "
                f"p_good_to_bad={p_good_to_bad:.3f} > 1; use longer bursts"
            )
        return cls(p_good_to_bad=p_good_to_bad, p_bad_to_good=p_bad_to_good)

    @property
    def mean_loss(self) -> float:
        """Long-run fraction of packets lost."""
        p_bad = self.p_good_to_bad / (self.p_good_to_bad + self.p_bad_to_good)
        return p_bad * self.loss_bad + (1.0 - p_bad) * self.loss_good


@dataclass(frozen=True, slots=True)
class Partition:
    """During ``[start_s, end_s)`` of plan time, cut links; it heals at ``end_s``.

    ``groups``: packets between endpoints in *different* groups are dropped; an
    endpoint named in no group is not cut off.  ``links``: directed ``(src, dst)``
    pairs that are dropped (one-way cuts).  Names are link names (a transport's
    ``name``, by default its bound address).  Both may be given.
    """

    start_s: float
    end_s: float
    groups: tuple[frozenset[str], ...] | None = None
    links: frozenset[Link] | None = None
    _group_of: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_time("Partition", "start_s", self.start_s)
        if not self.end_s > self.start_s:
            raise ConfigError(f"Partition.end_s ({self.end_s}) must be > start_s ({self.start_s})")
        if self.groups is None and self.links is None:
            raise ConfigError("Partition needs groups=... or links=... (or both)")
        group_of: dict[str, int] = {}
        if self.groups is not None:
            groups = tuple(frozenset(g) for g in self.groups)
            for index, group in enumerate(groups):
                for name in group:
                    if name in group_of:
                        raise ConfigError(f"Partition groups overlap: {name!r} is in two groups")
                    group_of[name] = index
            object.__setattr__(self, "groups", groups)
        if self.links is not None:
            links = frozenset(tuple(link) for link in self.links)
            if any(len(link) != 2 for link in links):
                raise ConfigError("Partition.links must hold (src, dst) pairs")
            object.__setattr__(self, "links", links)
        object.__setattr__(self, "_group_of", group_of)

    def cuts(self, src: str, dst: str, t: float) -> bool:
        """Whether a packet ``src -> dst`` sent at plan time ``t`` is dropped."""
        if not self.start_s <= t < self.end_s:
            return False
        if self.links is not None and (src, dst) in self.links:
            return True
        g_src = self._group_of.get(src)
        g_dst = self._group_of.get(dst)
        return g_src is not None and g_dst is not None and g_src != g_dst


@dataclass(frozen=True, slots=True)
class Crash:
    """Endpoint ``peer`` is a black hole from ``at_s`` (plan time) until ``until_s``.

    It neither sends nor receives; ``until_s=None`` means for good.  Its process keeps
    running, which is the point: the layers above must notice silence, not an error.
    """

    peer: str
    at_s: float
    until_s: float | None = None

    def __post_init__(self) -> None:
        _check_time("Crash", "at_s", self.at_s)
        if self.until_s is not None and not self.until_s > self.at_s:
            raise ConfigError(f"Crash.until_s ({self.until_s}) must be > at_s ({self.at_s})")

    def down(self, t: float) -> bool:
        """Whether the endpoint is crashed at plan time ``t``."""
        return self.at_s <= t and (self.until_s is None or t < self.until_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultPlan:
    """What the network does to packets; seeded, so a run replays exactly.

    Per packet, in this order: crashes and partitions (``dropped_crash``,
    ``dropped_partition``), Bernoulli ``loss``, bursty loss (``burst``), then the
    bandwidth shaper.  A packet that survives waits for the shaper, then
    ``delay_s + U(0, jitter_s)`` (+ ``reorder_delay_s`` with probability ``reorder``);
    with probability ``duplicate`` a copy follows with its own jitter.

    The shaper is a token bucket like ``tc tbf``: ``bucket_bytes`` of burst at most,
    refilled at ``bandwidth_bytes_per_s``; a packet waits for tokens behind the ones
    queued before it, and one that would wait longer than ``max_queue_delay_s`` is
    dropped (``dropped_bandwidth``).  ``links`` overrides the per-packet faults (all
    but ``seed``, ``partitions``, ``crash``) for given directed links; randomness
    always comes from this plan's ``seed``.

    ``link_loss(src, dst, t)``, if given, replaces ``loss`` with a probability that may
    change over plan time ``t`` (e.g. from a radio model at the peers' distance, see
    ``gossipnet.testing.radio_faults``); it is called once per packet, so keep it cheap.

    Raises:
        ConfigError: a value is out of range; each message names the field.
    """

    seed: int = 0
    loss: float = 0.0
    burst: GilbertElliott | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    reorder: float = 0.0
    reorder_delay_s: float = 0.005
    duplicate: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    bucket_bytes: int = 128 * 1024
    max_queue_delay_s: float = 0.05
    partitions: tuple[Partition, ...] = ()
    crash: tuple[Crash, ...] = ()
    links: Mapping[Link, FaultPlan] | None = field(default=None, hash=False)
    link_loss: Callable[[str, str, float], float] | None = field(
        default=None, hash=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"FaultPlan.seed must be an int, got {self.seed!r}")
        for name in ("loss", "reorder", "duplicate"):
            _check_prob("FaultPlan", name, getattr(self, name))
        for name in ("delay_s", "jitter_s", "reorder_delay_s", "max_queue_delay_s"):
            _check_time("FaultPlan", name, getattr(self, name))
        rate = self.bandwidth_bytes_per_s
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"FaultPlan.bandwidth_bytes_per_s must be > 0 or None, got {rate!r}")
        if not self.bucket_bytes > 0:
            raise ConfigError(f"FaultPlan.bucket_bytes must be > 0, got {self.bucket_bytes!r}")
        object.__setattr__(self, "partitions", tuple(self.partitions))
        object.__setattr__(self, "crash", tuple(self.crash))
        if self.links is not None:  # a private copy (a dict, so that plans pickle)
            object.__setattr__(self, "links", self._checked_links(self.links))
        if self.link_loss is not None and not callable(self.link_loss):
            raise ConfigError("FaultPlan.link_loss must be a callable (src, dst, t) -> loss")

    @staticmethod
    def _checked_links(links: Mapping[Link, FaultPlan]) -> dict[Link, FaultPlan]:
        checked: dict[Link, FaultPlan] = {}
        for key, plan in links.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ConfigError(f"FaultPlan.links keys must be (src, dst) tuples, got {key!r}")
            if not isinstance(plan, FaultPlan):
                raise ConfigError(f"FaultPlan.links[{key!r}] must be a FaultPlan")
            if plan.partitions or plan.crash or plan.links or plan.link_loss:
                raise ConfigError(
                    f"FaultPlan.links[{key!r}] may not have partitions, crash, links or "
                    "link_loss; "
                    "put those in the top-level plan"
                )
            checked[key] = plan
        return checked

    def for_link(self, src: str, dst: str) -> FaultPlan:
        """The plan whose per-packet faults apply to ``src -> dst``."""
        if self.links is not None:
            return self.links.get((src, dst), self)
        return self


@dataclass(slots=True)
class FaultStats:
    """What the fault layer did; totals in ``fault_stats``, per link in ``link_stats``."""

    dropped_loss: int = 0
    dropped_burst: int = 0
    dropped_partition: int = 0
    dropped_crash: int = 0
    dropped_bandwidth: int = 0
    delayed: int = 0
    reordered: int = 0
    duplicated: int = 0
    passed: int = 0

    @property
    def dropped(self) -> int:
        """All drops together."""
        return sum(v for k, v in self.as_dict().items() if k.startswith("dropped_"))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _LinkState:
    """Per directed link: its RNG, Gilbert-Elliott state, token bucket, counters."""

    __slots__ = ("bad", "last_refill_s", "plan", "rng", "stats", "tokens")

    def __init__(self, seed: int, src: str, dst: str, plan: FaultPlan, now_s: float) -> None:
        self.rng = random.Random(f"{seed}:{src}->{dst}")
        self.plan = plan
        self.bad = False
        self.tokens = float(plan.bucket_bytes)
        self.last_refill_s = now_s
        self.stats = FaultStats()

    def shape(self, nbytes: int, t: float) -> float | None:
        """Seconds the packet waits for tokens, or None if it would wait too long."""
        plan = self.plan
        rate = plan.bandwidth_bytes_per_s
        if rate is None:
            return 0.0
        # Tokens may go negative: that debt is the queue of packets already waiting.
        tokens = min(float(plan.bucket_bytes), self.tokens + (t - self.last_refill_s) * rate)
        self.last_refill_s = t
        wait = 0.0 if tokens >= nbytes else (nbytes - tokens) / rate
        if wait > plan.max_queue_delay_s:
            self.tokens = tokens
            return None
        self.tokens = tokens - nbytes
        return wait


def _frozen(frames: Sequence[Buffer]) -> list[Buffer]:
    # A delayed packet outlives send(): keep what was sent, as a network would, even of
    # frames the sender promised not to change (is_frozen) while a real queue holds them.
    return [f if type(f) is bytes else bytes(f) for f in frames]


class FaultyTransport(Transport):
    """A :class:`Transport` that applies a :class:`FaultPlan` around another one.

    Args:
        inner: the backend that really moves packets (memory, ZeroMQ, UDP).
        plan: the faults.
        clock: time source for plan time and delay timers.
        name: this endpoint's name in the plan (links, partitions, crashes); None
            means the inner transport's bound address.
    """

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, inner: Transport, plan: FaultPlan, clock: Clock, name: str | None = None
    ) -> None:
        # Not calling Transport.__init__: stats and address are the inner backend's.
        self._handler: PacketHandler | None = None
        self.inner = inner
        self.plan = plan
        self.clock = clock
        self.name = name
        self.fault_stats = FaultStats()
        self.link_stats: dict[Link, FaultStats] = {}
        self._links: dict[str, _LinkState] = {}
        self._timers: dict[int, TimerHandle] = {}
        self._timer_ids = itertools.count()
        self._t0 = 0.0
        self._closed = False
        self._crashes: dict[str, tuple[Crash, ...]] = {}
        for c in plan.crash:
            self._crashes[c.peer] = (*self._crashes.get(c.peer, ()), c)

    # -- forwarded to the inner transport ------------------------------------------
    @property
    def stats(self) -> TransportStats:
        return self.inner.stats

    @stats.setter
    def stats(self, value: TransportStats) -> None:
        self.inner.stats = value

    @property
    def address(self) -> str:
        return self.inner.address

    @address.setter
    def address(self, value: str) -> None:
        self.inner.address = value

    @property
    def default_chunk_bytes(self) -> int:  # type: ignore[override]  # per instance here
        return self.inner.default_chunk_bytes

    @property
    def max_packet_bytes(self) -> int:
        return self.inner.max_packet_bytes

    @property
    def max_chunk_bytes(self) -> int:
        return getattr(self.inner, "max_chunk_bytes", self.inner.default_chunk_bytes)

    def forget(self, dst: str) -> None:
        # The link's RNG and state stay: forgetting must not replay its fates.
        self.inner.forget(dst)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self, handler: PacketHandler) -> str:
        """Start the inner transport; plan time 0 is now."""
        if self._closed:
            raise ClosedError("this FaultyTransport was closed; create a new one")
        self._t0 = self.clock.now()
        self._handler = handler
        address = await self.inner.start(self._on_packet)
        if self.name is None:
            self.name = address
        return address

    async def close(self) -> None:
        """Cancel delayed packets (they are lost) and close the inner transport."""
        if not self._closed:
            self._closed = True
            for handle in self._timers.values():
                handle.cancel()
            self._timers.clear()
        await self.inner.close()

    @property
    def plan_time_s(self) -> float:
        """Seconds of plan time since :meth:`start`."""
        return self.clock.now() - self._t0

    @property
    def pending_delayed(self) -> int:
        """Delayed packets (and duplicates) not yet handed to the inner transport."""
        return len(self._timers)

    def is_crashed(self, peer: str, t: float | None = None) -> bool:
        """Whether ``peer`` is crashed at plan time ``t`` (default: now)."""
        crashes = self._crashes.get(peer)
        if not crashes:
            return False
        when = self.plan_time_s if t is None else t
        return any(c.down(when) for c in crashes)

    # -- data path ---------------------------------------------------------------
    def _on_packet(self, frames: list[memoryview]) -> None:
        if self._closed or self._handler is None:
            return
        if self._crashes and self.name is not None and self.is_crashed(self.name):
            self.fault_stats.dropped_crash += 1  # receive side: no per-link source known
            return
        self._handler(frames)

    def _link(self, dst: str) -> _LinkState:
        src = self.name or self.inner.address
        state = _LinkState(self.plan.seed, src, dst, self.plan.for_link(src, dst), self.plan_time_s)
        self._links[dst] = state
        self.link_stats[(src, dst)] = state.stats
        return state

    def _count(self, link: _LinkState, counter: str) -> None:
        setattr(link.stats, counter, getattr(link.stats, counter) + 1)
        setattr(self.fault_stats, counter, getattr(self.fault_stats, counter) + 1)

    def _drop(self, link: _LinkState, counter: str) -> bool:
        self._count(link, counter)
        return True  # lost in the network: the sender cannot tell

    def send(self, dst: str, frames: Sequence[Buffer], *, urgent: bool = False) -> bool:
        """Apply the plan to one packet for ``dst``; forward it now or on a timer.

        Returns True for packets the faults drop (as for network loss) or delay,
        otherwise the inner transport's verdict; False before start and once closed.
        """
        if self._closed or self._handler is None:
            return False
        link = self._links.get(dst) or self._link(dst)
        t = self.clock.now() - self._t0
        rnd = link.rng.random
        # Always seven draws in this order: fates do not depend on which faults are on.
        u_loss, u_state, u_burst, u_jit, u_reorder, u_dup, u_dup_jit = (
            rnd(), rnd(), rnd(), rnd(), rnd(), rnd(), rnd()
        )  # fmt: skip
        plan, burst = link.plan, link.plan.burst
        if burst is not None:  # step the chain on every packet, dropped or not
            link.bad = u_state >= burst.p_bad_to_good if link.bad else u_state < burst.p_good_to_bad
        src = self.name or self.inner.address
        if self._crashes and (self.is_crashed(src, t) or self.is_crashed(dst, t)):
            return self._drop(link, "dropped_crash")
        if self.plan.partitions and any(p.cuts(src, dst, t) for p in self.plan.partitions):
            return self._drop(link, "dropped_partition")
        loss = plan.loss if self.plan.link_loss is None else self.plan.link_loss(src, dst, t)
        if u_loss < loss:
            return self._drop(link, "dropped_loss")
        if burst is not None and u_burst < (burst.loss_bad if link.bad else burst.loss_good):
            return self._drop(link, "dropped_burst")
        base = plan.delay_s
        if plan.bandwidth_bytes_per_s is not None:
            wait = link.shape(
                sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames), t
            )
            if wait is None:
                return self._drop(link, "dropped_bandwidth")
            base += wait
        link.stats.passed += 1
        self.fault_stats.passed += 1
        delay = base + u_jit * plan.jitter_s
        if u_reorder < plan.reorder:
            delay += plan.reorder_delay_s
            self._count(link, "reordered")
        ok, frozen = True, None
        if delay > 0.0:
            self._count(link, "delayed")
            frozen = _frozen(frames)
            self._later(delay, dst, frozen)
        elif urgent:
            ok = self.inner.send(dst, frames, urgent=True)
        else:
            ok = self.inner.send(dst, frames)
        if u_dup < plan.duplicate:
            self._count(link, "duplicated")
            dup_delay = base + u_dup_jit * plan.jitter_s
            if dup_delay > 0.0:
                self._later(dup_delay, dst, frozen if frozen is not None else _frozen(frames))
            else:
                self.inner.send(dst, frames)
        return ok

    def _later(self, delay_s: float, dst: str, frames: list[Buffer]) -> None:
        token = next(self._timer_ids)
        callback = functools.partial(self._fire, token, dst, frames)
        self._timers[token] = self.clock.call_later(delay_s, callback)

    def _fire(self, token: int, dst: str, frames: list[Buffer]) -> None:
        if self._timers.pop(token, None) is not None and not self._closed:
            self.inner.send(dst, frames)
