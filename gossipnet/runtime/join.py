"""What :func:`gossipnet.join` resolves before it starts a :class:`~gossipnet.Peer`.

Why a module of its own: the environment is read in one place (STYLE), and
the rules that turn ``join()``'s arguments, torchrun's variables and
``GOSSIPNET_SECRET`` into one peer's settings are pure enough to read (and
test) apart from the sockets and threads that the facade starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets as _secrets
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.transport import check_peer_address, split_address

__all__ = ("JoinPlan", "advertise_host", "resolve_join", "torchrun_settings", "warn_if_exposed")

#: The facade's records keep its logger name, whichever module emits them.
log = logging.getLogger("gossipnet.peer")

_LOOPBACK = ("127.", "localhost", "::1")
_NO_PEERS = (
    "join() got no peers and is not under torchrun (RANK and WORLD_SIZE are unset): pass"
    " peers=['tcp://host:port', ...] (the other peers' addresses; our own may be among"
    " them), run under torchrun, or pass peers=[] to train alone on purpose"
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JoinPlan:
    """The settings one :func:`gossipnet.join` call starts its peer with.

    Attributes:
        config: the base config with ``join()``'s overrides applied.
        listen: our address (port 0: a free port).
        peer_id: our name among the peers.
        bootstrap: addresses to say hello to (may include our own).
        secret: the MAC key, or None for the run-id-derived one.
        expected_peers: peers (self included) to wait for; None: the bootstrap's.
    """

    config: Config
    listen: str
    peer_id: str
    bootstrap: list[str]
    secret: bytes | None
    expected_peers: int | None


def torchrun_settings() -> tuple[list[str], str, str, int] | None:
    """(bootstrap, listen, peer_id, world_size) from torchrun's variables, if set.

    Rank 0 listens on ``MASTER_PORT + 1`` of ``MASTER_ADDR``; every rank
    bootstraps from it and listens on a free port of its own.  The peer id is
    ``rank<N>``, so a restarted rank (``--max-restarts``) comes back under the
    same name with a newer epoch.
    """
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"])
        port = int(env.get("MASTER_PORT", "29500")) + 1
    except ValueError as err:
        raise ConfigError(f"torchrun variables are not integers: {err}") from err
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if master in ("localhost",):
        master = "127.0.0.1"
    rank0 = f"tcp://{master}:{port}"
    listen = f"tcp://0.0.0.0:{port}" if rank == 0 else "tcp://0.0.0.0:0"
    return [rank0], listen, f"rank{rank}", world


def advertise_host(bootstrap: Sequence[str]) -> str | None:
    """The host to advertise when listening on a wildcard address.

    Loopback peers get ``127.0.0.1``; otherwise the kernel's source address
    toward the first bootstrap peer (a connected UDP socket sends nothing).
    Why not ``gethostbyname(gethostname())``: inside containers and network
    namespaces it often resolves to 127.0.0.1, which peers cannot dial.
    """
    hosts = [b.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]") for b in bootstrap]
    if not hosts or all(h.startswith(_LOOPBACK) for h in hosts):
        return "127.0.0.1"
    for host in hosts:
        if host.startswith(_LOOPBACK):
            continue
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))
                return str(probe.getsockname()[0])
        except OSError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def resolve_join(
    peers: Sequence[str] | None,
    listen: str | None,
    *,
    secret: bytes | str | None,
    config: Config | None,
    wait_for: int | None,
    overrides: Mapping[str, Any],
) -> JoinPlan:
    """Resolve ``join()``'s arguments; see :func:`gossipnet.join` for their meaning.

    Explicit arguments win over torchrun's variables, which are read only when
    ``peers`` is None; ``GOSSIPNET_SECRET`` is read only when ``secret`` is None.

    Raises:
        ConfigError: an unknown or invalid override, an invalid peer address or
            ``wait_for``, non-integer torchrun variables, or no peers at all outside
            torchrun (``peers=[]`` asks for a solo peer).
    """
    cfg = (config or Config()).replace(**overrides) if overrides else (config or Config())
    if isinstance(peers, str | bytes):
        raise ConfigError(f"peers must be a list of addresses, got {peers!r}; write peers=[...]")
    if wait_for is not None and (type(wait_for) is not int or wait_for < 1):
        raise ConfigError(f"wait_for must be an int >= 1 (peers, us included), got {wait_for!r}")
    bootstrap = list(peers) if peers is not None else []
    peer_id = cfg.peer_id
    expected = wait_for
    if peers is None:
        tr = torchrun_settings()
        if tr is None:
            raise ConfigError(_NO_PEERS)
        bootstrap, tr_listen, tr_id, world = tr
        listen = listen or tr_listen
        peer_id = peer_id or tr_id
        expected = expected if expected is not None else world
    if listen is None:
        first = bootstrap[0] if bootstrap and isinstance(bootstrap[0], str) else "tcp://"
        scheme = first.split("://", 1)[0]  # a bad address is named by the check below
        listen = "mem://" if scheme == "mem" else f"{scheme}://127.0.0.1:0"
    for address in bootstrap:
        check_peer_address(address, listen=listen)
    if peer_id is None:
        peer_id = f"{socket.gethostname()[:16]}-{os.getpid()}-{_secrets.token_hex(3)}"
    if secret is None:
        env_secret = os.environ.get("GOSSIPNET_SECRET")
        secret = env_secret.encode() if env_secret else None
    key = secret.encode() if isinstance(secret, str) else secret
    return JoinPlan(
        config=cfg,
        listen=listen,
        peer_id=peer_id,
        bootstrap=bootstrap,
        secret=key,
        expected_peers=expected,
    )


def warn_if_exposed(plan: JoinPlan) -> None:
    """Warn loudly when a peer without a secret listens where others can reach it.

    Why: without a secret the MAC key derives from the run id alone, which keeps
    another run's packets out but not a person: anyone who reaches the port can
    send this peer gradients, parameters and membership messages.  On loopback,
    ``ipc``, ``inproc`` and ``mem`` only this machine (or process) can.
    """
    if plan.secret:
        return
    scheme, rest = split_address(plan.listen)
    host = rest.rpartition(":")[0].strip("[]")
    if scheme not in ("tcp", "udp") or host.startswith(_LOOPBACK):
        return
    log.warning(
        "peer %s listens on %s without a secret: anyone who can reach that port can send it"
        " gradients, parameters and membership messages (the default key comes from the run"
        " id, which stops accidents, not attackers); give every peer the same secret:"
        " join(secret=...) or GOSSIPNET_SECRET",
        plan.peer_id,
        plan.listen,
    )
