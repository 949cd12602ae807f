"""The backend's settings: ``init_process_group(..., pg_options=...)`` and environment.

Why both: a script that already calls ``dist.init_process_group("gossipnet")`` must be
runnable with a secret, a fault plan or other ``Config`` values without editing it
(environment variables), while code that builds its own groups passes a
:class:`GossipnetOptions`.  Explicit options win over the environment, field by field.
A variable that does not parse is a :class:`~gossipnet.ConfigError` naming it: a typo
must never give a silently different run.

Variables (all optional):

``GOSSIPNET_SECRET``
    the run secret keying every packet's MAC (as for :func:`gossipnet.join`); unset,
    rank 0 draws a random key per job and the ranks share it through torch's store
    (:mod:`gossipnet.distributed.rendezvous`).
``GOSSIPNET_TRANSPORT``
    ``tcp`` (ZeroMQ, default) or ``udp``.
``GOSSIPNET_LISTEN_HOST``
    the address to bind (default: the interface toward ``MASTER_ADDR``, or 127.0.0.1).
``GOSSIPNET_LOSS``
    a fraction in [0, 1): drop that share of the packets this rank sends (fault injection).
``GOSSIPNET_FAULTS``
    a JSON object of :class:`gossipnet.FaultPlan` fields, e.g. ``{"loss": 0.1, "seed": 3}``.
``GOSSIPNET_CONFIG``
    a JSON object of :class:`gossipnet.Config` fields, e.g. ``{"collective_timeout_s": 5}``.
``GOSSIPNET_EXACT_MAX_BYTES``
    all-reduces of at most this many bytes take the exact path (default 4096).
``GOSSIPNET_REPAIR``
    ``1`` (default): a rank that missed a chunk's average asks its owner again, so
    every replica applies the same gradient; ``0``: keep its own value (replicas drift).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.transport.faults import FaultPlan

__all__ = ("ENV_VARS", "GossipnetOptions", "resolve_options")

#: Every variable the backend reads.
ENV_VARS = (
    "GOSSIPNET_SECRET",
    "GOSSIPNET_TRANSPORT",
    "GOSSIPNET_LISTEN_HOST",
    "GOSSIPNET_LOSS",
    "GOSSIPNET_FAULTS",
    "GOSSIPNET_CONFIG",
    "GOSSIPNET_EXACT_MAX_BYTES",
    "GOSSIPNET_REPAIR",
)
_TRANSPORTS = ("tcp", "udp")
#: Small all-reduces (metrics, counters) are exact by default; gradient buckets are larger.
DEFAULT_EXACT_MAX_BYTES = 4096


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GossipnetOptions:
    """What ``init_process_group("gossipnet", pg_options=GossipnetOptions(...))`` takes.

    Attributes:
        secret: the run secret (else ``GOSSIPNET_SECRET``; else, or when empty, a random
            per-job key that rank 0 draws and hands the others through torch's store).
        config: the peer's :class:`~gossipnet.Config` (else ``GOSSIPNET_CONFIG`` over
            the defaults).
        faults: a :class:`~gossipnet.FaultPlan` for this rank's sends (else
            ``GOSSIPNET_FAULTS`` / ``GOSSIPNET_LOSS``); its seed is offset by the rank
            so that ranks lose different packets.
        transport: ``"tcp"`` or ``"udp"`` (else ``GOSSIPNET_TRANSPORT``, else tcp).
        listen_host: the address to bind (else ``GOSSIPNET_LISTEN_HOST``, else the
            interface toward ``MASTER_ADDR``).
        exact_max_bytes: all-reduces of at most this many bytes go through the exact
            reliable path, larger float SUM/AVG ones through the lossy all-reduce.
        repair: after each lossy round, re-request the chunk averages this rank missed
            from their owners until the round's deadline (else ``GOSSIPNET_REPAIR``,
            else True).  Why on by default: DDP never re-syncs parameters, so a rank
            that kept its own gradient for a chunk would drift from the others for good.
        handle_sigterm: on SIGTERM announce our departure, so survivors drop us at once.
    """

    secret: bytes | str | None = None
    config: Config | None = None
    faults: FaultPlan | None = None
    transport: str | None = None
    listen_host: str | None = None
    exact_max_bytes: int | None = None
    repair: bool | None = None
    handle_sigterm: bool = True


def _json_object(name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{name} is not valid JSON ({err}): {text!r}") from err
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object of field names to values, got {text!r}")
    return value


def _env_config(env: Mapping[str, str]) -> Config | None:
    text = env.get("GOSSIPNET_CONFIG")
    if not text:
        return None
    fields = _json_object("GOSSIPNET_CONFIG", text)
    try:
        return Config().replace(**fields)
    except (TypeError, ConfigError) as err:
        raise ConfigError(f"GOSSIPNET_CONFIG: {err}") from err


def _env_faults(env: Mapping[str, str]) -> FaultPlan | None:
    fields: dict[str, Any] = {}
    if text := env.get("GOSSIPNET_FAULTS"):
        fields = _json_object("GOSSIPNET_FAULTS", text)
    if text := env.get("GOSSIPNET_LOSS"):
        try:
            loss = float(text)
        except ValueError as err:
            raise ConfigError(f"GOSSIPNET_LOSS must be a fraction in [0, 1), got {text!r}") from err
        if not (0.0 <= loss < 1.0 and math.isfinite(loss)):
            raise ConfigError(f"GOSSIPNET_LOSS must be a fraction in [0, 1), got {text!r}")
        fields["loss"] = loss
    if not fields:
        return None
    try:
        return FaultPlan(**fields)
    except (TypeError, ConfigError) as err:
        raise ConfigError(f"GOSSIPNET_FAULTS/GOSSIPNET_LOSS: {err}") from err


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError as err:
        raise ConfigError(f"{name} must be an integer >= 0, got {text!r}") from err
    if value < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {text!r}")
    return value


def resolve_options(
    given: Any, rank: int, env: Mapping[str, str] | None = None
) -> GossipnetOptions:
    """``pg_options`` over the environment: one complete :class:`GossipnetOptions`.

    Args:
        given: what ``init_process_group`` passed as ``pg_options`` (None or options).
        rank: this process's rank in the group (offsets the fault plan's seed).
        env: the environment (default ``os.environ``).

    Raises:
        ConfigError: ``given`` is another type, or a variable or field is invalid.
    """
    env = os.environ if env is None else env
    if given is not None and not isinstance(given, GossipnetOptions):
        raise ConfigError(
            "the gossipnet backend takes pg_options=gossipnet.distributed.GossipnetOptions(...),"
            f" got {type(given).__name__}"
        )
    opts = given or GossipnetOptions()
    transport = opts.transport or env.get("GOSSIPNET_TRANSPORT") or "tcp"
    if transport not in _TRANSPORTS:
        raise ConfigError(
            f"GOSSIPNET_TRANSPORT / transport must be one of {_TRANSPORTS}, got {transport!r}"
        )
    exact = opts.exact_max_bytes
    if exact is None:
        exact = _env_int(env, "GOSSIPNET_EXACT_MAX_BYTES")
    elif type(exact) is not int or exact < 0:
        raise ConfigError(f"exact_max_bytes must be an int >= 0, got {exact!r}")
    repair = opts.repair
    if repair is None:
        text = env.get("GOSSIPNET_REPAIR", "1")
        if text not in ("0", "1"):
            raise ConfigError(f"GOSSIPNET_REPAIR must be 0 or 1, got {text!r}")
        repair = text == "1"
    faults = opts.faults if opts.faults is not None else _env_faults(env)
    if faults is not None:
        faults = dataclasses.replace(faults, seed=faults.seed + 7919 * rank)
    return GossipnetOptions(
        secret=opts.secret if opts.secret is not None else env.get("GOSSIPNET_SECRET") or None,
        config=opts.config if opts.config is not None else _env_config(env),
        faults=faults,
        transport=transport,
        listen_host=opts.listen_host or env.get("GOSSIPNET_LISTEN_HOST") or None,
        exact_max_bytes=DEFAULT_EXACT_MAX_BYTES if exact is None else exact,
        repair=repair,
        handle_sigterm=opts.handle_sigterm,
    )
