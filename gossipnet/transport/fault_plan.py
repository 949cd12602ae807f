"""The values of a fault plan: what the network does to packets, checked on construction.

Why apart from :mod:`gossipnet.transport.faults`: a plan is a frozen, picklable value
(the demo ships it to spawned peer processes; tests build many); the wrapper that
applies it to packets is a transport with state, timers and a per-packet hot path.
Here are only the types and their validation: :class:`FaultPlan` and its parts
(:class:`GilbertElliott`, :class:`Partition`, :class:`Crash`) and the counters
:class:`FaultStats`.  Import them from :mod:`gossipnet.transport.faults` (or
:mod:`gossipnet`); this module is internal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from gossipnet.errors import ConfigError

__all__ = ("Crash", "FaultPlan", "FaultStats", "GilbertElliott", "Link", "Partition")

#: A directed link ``(src, dst)`` by endpoint names.
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
