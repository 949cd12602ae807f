"""The optimizer strategies' options: one frozen value per strategy.

``net.optimizer(base, strategy=...)`` takes a strategy's name plus keywords (the
historical form) or one of these values.  Why values instead of ``**kwargs``:
a typo is caught where it is made (an unknown keyword names the accepted
ones), every knob has a unit in its name and is checked once, in
``__post_init__``, and a strategy's settings can be built, compared and logged
before any peer exists.

Every check raises :class:`gossipnet.ConfigError`, a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gossipnet.collectives.compress import Compression
from gossipnet.collectives.compress import resolve as resolve_compress
from gossipnet.collectives.moshpit.averager import BEHIND_SWEEPS
from gossipnet.collectives.sparq.config import SparQ
from gossipnet.errors import ConfigError

__all__ = ("AllReduceOptions", "MoshpitOptions", "RouteOptions", "StrategyOptions", "resolve")


@dataclass(frozen=True, kw_only=True, slots=True)
class AllReduceOptions:
    """``strategy="allreduce"``: loss-tolerant reduce-scatter, sharded step, broadcast.

    Attributes:
        resync_every_steps: steps between resyncs, which average the parameters with
            repair so that replicas become identical again (None:
            ``Config.resync_every_steps``; 0: only step 0).
        timeout_s: bound of one step's collective in seconds (None:
            ``Config.collective_timeout_s``).
        compress: the gradients' compressor (``"bf16"``, ``"fp16"``,
            :class:`gossipnet.Int8`, :class:`gossipnet.ArcTopK`, :class:`gossipnet.DCT`,
            :class:`gossipnet.Accordion`; None: dense).  Only the reduce-scatter of
            gradients is compressed: the parameter broadcast stays float32 (with
            ARC-Top-K and DCT it also carries the index sets and contributor
            bitmaps), and resyncs are dense.  Error feedback lives with the strategy.
    """

    name: ClassVar[str] = "allreduce"
    #: historical keyword -> field (``net.optimizer(base, timeout=5.0)``)
    aliases: ClassVar[Mapping[str, str]] = {"timeout": "timeout_s"}
    #: historical keywords that never applied to this strategy: accepted, ignored
    ignored: ClassVar[frozenset[str]] = frozenset({"average_every"})

    resync_every_steps: int | None = None
    timeout_s: float | None = None
    compress: Compression | None = None

    def __post_init__(self) -> None:
        if self.resync_every_steps is not None and self.resync_every_steps < 0:
            raise ConfigError("resync_every_steps must be >= 0")
        _positive("timeout_s", self.timeout_s)
        object.__setattr__(self, "compress", resolve_compress(self.compress))


@dataclass(frozen=True, kw_only=True, slots=True)
class MoshpitOptions:
    """``strategy="moshpit"``: local steps, Moshpit averaging every few steps.

    Attributes:
        average_every: local steps between averagings (k), >= 1.
        average_state: also average floating optimizer state shaped like the
            parameters (Adam's moments, momentum buffers).
        sync_state: download the current state from live peers on construction.
        group_size: largest Moshpit group, >= 2 (None: the averager's, 32).
        rounds: Moshpit rounds per averaging, >= 1 (None: the grid's d).
        checkpoint_path: an optional local checkpoint, loaded when no live peer has
            state and written atomically every ``checkpoint_every_steps`` steps.
        checkpoint_every_steps: steps between checkpoints (0: only on request).
        sync_timeout_s: bound of a state download in seconds.
        catch_up_sweeps: download the others' state instead of averaging when this
            many sweeps behind the most advanced peer (the others no longer plan us in).
        timeout_s: bound of each group all-reduce in seconds (None:
            ``Config.collective_timeout_s``).
        compress: ``gossipnet.SparQ(...)``: SPARQ-SGD gossip in the Moshpit groups
            instead of the dense group all-reduce (:mod:`gossipnet.training.sparq`);
            None: dense.
    """

    name: ClassVar[str] = "moshpit"
    aliases: ClassVar[Mapping[str, str]] = {
        "timeout": "timeout_s",
        "checkpoint": "checkpoint_path",
        "checkpoint_every": "checkpoint_every_steps",
        "sync_timeout": "sync_timeout_s",
    }
    ignored: ClassVar[frozenset[str]] = frozenset({"resync_every_steps"})

    average_every: int = 1
    average_state: bool = False
    sync_state: bool = True
    group_size: int | None = None
    rounds: int | None = None
    checkpoint_path: str | None = None
    checkpoint_every_steps: int = 0
    sync_timeout_s: float = 30.0
    catch_up_sweeps: int = BEHIND_SWEEPS
    timeout_s: float | None = None
    compress: SparQ | None = None

    def __post_init__(self) -> None:
        if (
            self.average_every < 1
            or self.checkpoint_every_steps < 0
            or (self.rounds is not None and self.rounds < 1)
        ):
            raise ConfigError("average_every >= 1, rounds >= 1 and checkpoint_every >= 0 required")
        if self.group_size is not None and self.group_size < 2:
            raise ConfigError(f"group_size must be >= 2, got {self.group_size}")
        if self.catch_up_sweeps < 1:
            raise ConfigError(f"catch_up_sweeps must be >= 1, got {self.catch_up_sweeps}")
        _positive("sync_timeout_s", self.sync_timeout_s)
        _positive("timeout_s", self.timeout_s)
        _check_sparq(self.name, self.compress, self.average_state)


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteOptions:
    """``strategy="route"``: local steps, route-aware gossip every few steps.

    Attributes:
        average_every: local steps between gossip rounds (k), >= 1.
        rounds: gossip rounds per averaging, >= 1 (each plans afresh on the routes).
        average_state: also gossip floating optimizer state shaped like the
            parameters (momentum buffers, Adam's moments).
        compress: ``gossipnet.SparQ(...)``: SPARQ-SGD on the plan's links instead of
            dense gossip (:mod:`gossipnet.training.sparq`); None: dense.
    """

    name: ClassVar[str] = "route"
    aliases: ClassVar[Mapping[str, str]] = {}
    # a gossip round is bounded by its plan, and route peers never resync
    ignored: ClassVar[frozenset[str]] = frozenset({"resync_every_steps", "timeout"})

    average_every: int = 1
    rounds: int = 1
    average_state: bool = False
    compress: SparQ | None = None

    def __post_init__(self) -> None:
        if self.average_every < 1 or self.rounds < 1:
            raise ConfigError("average_every >= 1 and rounds >= 1 required")
        _check_sparq(self.name, self.compress, self.average_state)


#: Any strategy's options.
StrategyOptions = AllReduceOptions | MoshpitOptions | RouteOptions

_BY_NAME: dict[str, type[StrategyOptions]] = {
    cls.name: cls for cls in (AllReduceOptions, MoshpitOptions, RouteOptions)
}


def resolve(strategy: str | StrategyOptions, kwargs: Mapping[str, Any]) -> StrategyOptions:
    """The options of ``net.optimizer(base, strategy, **kwargs)``.

    ``strategy`` is a name (``"allreduce"``, ``"moshpit"``, ``"route"``) whose
    options are built from ``kwargs``, or an options value (then ``kwargs`` must be
    empty).  Keywords are the fields or their historical names (``timeout``,
    ``checkpoint``, ``checkpoint_every``, ``sync_timeout``); a historical keyword that
    never applied to the strategy (``average_every`` for the all-reduce,
    ``resync_every_steps`` for the local-step strategies) is still accepted and,
    as before, has no effect.

    Raises:
        ConfigError: an unknown strategy, a keyword the strategy does not accept
            (the message names those it accepts), keywords beside an options value,
            or a value its options reject.
    """
    if isinstance(strategy, (AllReduceOptions, MoshpitOptions, RouteOptions)):
        if kwargs:
            raise ConfigError(
                f"options {sorted(kwargs)} given beside a {type(strategy).__name__}; set them"
                " on it instead"
            )
        return strategy
    cls = _BY_NAME.get(strategy) if isinstance(strategy, str) else None
    if cls is AllReduceOptions and isinstance(kwargs.get("compress"), SparQ):
        raise ConfigError(
            "gossipnet.SparQ works with the gossip strategies only: strategy='moshpit' or"
            " 'route'; the all-reduce takes the all-reduce compressors"
        )
    if cls is None:
        raise ConfigError(
            f"strategy {strategy!r} is not available; choose one of {tuple(_BY_NAME)}"
            " or pass gossipnet.AllReduceOptions, MoshpitOptions or RouteOptions"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(kwargs) - fields - set(cls.aliases) - cls.ignored)
    if bad:
        accepted = sorted(fields | set(cls.aliases))
        raise ConfigError(
            f"options {bad} do not apply to strategy={cls.name!r}; it accepts {accepted}"
        )
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in cls.ignored:
            continue
        field = cls.aliases.get(key, key)
        if field in values:
            raise ConfigError(f"{field} given twice (as {field!r} and its old name)")
        values[field] = value
    return cls(**values)


def _check_sparq(strategy: str, compress: object, average_state: bool) -> None:
    """``compress`` of a gossip strategy: None or a :class:`SparQ` (parameters only)."""
    if compress is None:
        return
    if not isinstance(compress, SparQ):
        raise ConfigError(
            f"strategy={strategy!r} accepts compress=gossipnet.SparQ(...) or None, got"
            f" {compress!r} (the all-reduce compressors need strategy='allreduce')"
        )
    if average_state:
        raise ConfigError("SparQ gossips parameters only: set average_state=False with it")


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {value}")
