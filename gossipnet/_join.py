"""``gossipnet.join()``: arguments and environment in, a running :class:`~gossipnet.Peer` out.

Why apart from ``peer.py``: joining is resolution (``runtime/join.py``: addresses,
torchrun's variables, the secret), a warning for an exposed peer, the optional route
and the SIGTERM hook; a ``Peer`` is what exists after.  Keeping them apart keeps the
facade's two halves readable on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gossipnet.clock import Clock
from gossipnet.config import Config
from gossipnet.mobility.radio import RadioModel
from gossipnet.mobility.routes import Route
from gossipnet.peer import Peer
from gossipnet.runtime import signals as _signals
from gossipnet.runtime.join import resolve_join, warn_if_exposed

__all__ = ("join",)


def join(
    peers: Sequence[str] | None = None,
    listen: str | None = None,
    *,
    secret: bytes | str | None = None,
    faults: Any = None,
    config: Config | None = None,
    clock: Clock | None = None,
    network: Any = None,
    wait_for: int | None = None,
    handle_sigterm: bool = True,
    route: Route | None = None,
    radio: RadioModel | None = None,
    **overrides: Any,
) -> Peer:
    """Start a peer and join the others; raise if they cannot be found.

    Returns as soon as the expected peers are alive.  At ``Config.join_timeout_s``
    without them it raises :class:`~gossipnet.JoinError`, naming the addresses that
    never answered and those whose packets failed authentication (a different
    secret?), unless ``min_peers`` (a ``Config`` field, e.g. ``join(...,
    min_peers=3)``) are alive: then it goes on with a warning naming the absent.

    Args:
        peers: bootstrap addresses (``tcp://host:port``, ``udp://...``, ``mem://name``);
            may include our own; checked at once (scheme, host, port 1..65535, the
            listen address's backend).  ``[]``: a solo peer, on purpose.  ``None``
            reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``); outside torchrun it raises ``ConfigError``.
        listen: our address; port 0 binds a free port.  Its scheme picks the backend.
        secret: run secret keying the MAC of every packet (else ``GOSSIPNET_SECRET``;
            else a key derived from the run id only, which stops accidents, not
            attackers: a peer without one that listens beyond loopback logs a warning).
        faults: a :class:`gossipnet.FaultPlan` applied to everything this peer sends.
        config: base :class:`gossipnet.Config`; ``overrides`` replace its fields.
        clock: injected clock (tests); real monotonic time by default.
        network: the :class:`gossipnet.testing.MemoryNetwork` for ``mem://`` peers.
        wait_for: peers (self included) expected: ``join()`` returns once they are
            alive; default: the distinct bootstrap addresses plus us, or
            ``WORLD_SIZE`` under torchrun.
        handle_sigterm: on SIGTERM, announce our departure and leave (within about a
            second), then exit as SIGTERM would; installed only from the main thread.
        route, radio: this peer's route and the radio model for route-aware gossip
            (``method="route"``, ``strategy="route"``); see :meth:`Peer.set_route`.

    Returns:
        A running :class:`Peer` (also a context manager that leaves on exit).

    Raises:
        JoinError: fewer than ``min_peers`` (default: all expected) peers alive at
            ``Config.join_timeout_s``; the peer was closed.
        ConfigError: a bad peer address, override or ``wait_for``; no peers outside
            torchrun; a listen address that cannot be bound.
    """
    plan = resolve_join(
        peers, listen, secret=secret, config=config, wait_for=wait_for, overrides=overrides
    )
    warn_if_exposed(plan)
    peer = Peer(
        config=plan.config,
        listen=plan.listen,
        peer_id=plan.peer_id,
        bootstrap=plan.bootstrap,
        secret=plan.secret,
        faults=faults,
        clock=clock,
        network=network,
        expected_peers=plan.expected_peers,
    )
    if route is not None or radio is not None:
        try:
            peer.set_route(route, radio=radio)
        except BaseException:
            peer.close(announce=False)
            raise
    if handle_sigterm:
        _signals.install(peer)
    return peer
