"""Peer addresses: ``scheme://host:port`` parsing and the checks a dial needs.

Every backend parses the same shape, so the helpers live in one module that
imports no backend (the backends import it).
"""

from __future__ import annotations

from gossipnet.errors import ConfigError

#: URL scheme -> backend, in the order error messages list them.
SCHEMES: tuple[str, ...] = ("tcp", "ipc", "inproc", "udp", "mem")
#: Listen hosts meaning "every interface": never advertised to peers as such.
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", ""})


def split_address(address: str) -> tuple[str, str]:
    """``"tcp://h:p"`` -> ``("tcp", "h:p")``.

    Raises:
        ConfigError: no ``scheme://`` prefix.
    """
    scheme, sep, rest = address.partition("://")
    if not sep or not scheme:
        raise ConfigError(
            f"address {address!r} has no scheme; use one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    return scheme.lower(), rest


def split_host_port(rest: str) -> tuple[str, str]:
    """``"h:p"`` or ``"[v6]:p"`` -> ``(host, port)`` with brackets removed.

    The port stays a string because ``"*"`` (any port) is legal in a listen address.

    Raises:
        ConfigError: no ``:port`` part.
    """
    host, sep, port = rest.rpartition(":")
    if not sep or not port:
        raise ConfigError(f"{rest!r} must be host:port (port 0 or * picks a free one)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


#: URL scheme -> the backend serving it; a peer is reachable only over its own backend.
BACKENDS: dict[str, str] = {
    "tcp": "zeromq",
    "ipc": "zeromq",
    "inproc": "zeromq",
    "udp": "udp",
    "mem": "memory",
}


def check_peer_address(address: object, *, listen: str | None = None) -> str:
    """``address`` if it can be dialled, else a :class:`ConfigError` saying why.

    Why: a peer address is only ever dialled, and a dial to a bad one fails
    silently (ZeroMQ retries forever), so a typo would cost a whole
    ``join_timeout_s`` and name nothing; ``listen`` is checked by its bind.
    A peer address needs a scheme, a host and a port in 1..65535 (``tcp``,
    ``udp``: no wildcard host or port, which name no one to dial) or a
    non-empty path or name (``ipc``, ``inproc``, ``mem``), and, given
    ``listen``, a scheme served by the same backend as ``listen``'s.
    """
    if not isinstance(address, str):
        raise ConfigError(
            f"peer address {address!r} is not a string; pass peers=['tcp://host:port', ...]"
        )
    if "://" not in address:
        raise ConfigError(
            f"peer address {address!r} has no scheme; write e.g. 'tcp://{address}' (schemes: "
            + ", ".join(f"{s}://" for s in SCHEMES)
            + ")"
        )
    scheme, rest = split_address(address)
    if scheme not in BACKENDS:
        raise ConfigError(
            f"unknown transport scheme {scheme!r} in peer address {address!r}; supported: "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    if scheme in ("tcp", "udp"):
        host, sep, port = rest.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep:
            raise ConfigError(f"peer address {address!r} must be {scheme}://host:port")
        if host in WILDCARD_HOSTS:
            raise ConfigError(
                f"peer address {address!r} has a wildcard host, which names no one to dial;"
                " use the peer's address (its listen address with a real host)"
            )
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(
                f"peer address {address!r} needs a port in 1..65535 (the peer's listen port)"
            )
    elif not rest or rest == "*":
        raise ConfigError(f"peer address {address!r} needs a path or name after {scheme}://")
    if listen is not None:
        own = BACKENDS.get(split_address(listen)[0])
        if own is not None and own != BACKENDS[scheme]:
            raise ConfigError(
                f"peer address {address!r} is served by the {BACKENDS[scheme]} backend but we"
                f" listen on {listen!r} ({own}); every peer of a run uses one backend"
            )
    return address


#: Longest address accepted from the network (a path of an ipc:// socket fits).
MAX_ADDRESS_CHARS = 256


def valid_address(address: object) -> bool:
    """Whether a peer announced ``address`` as one :func:`check_peer_address` accepts,
    at most :data:`MAX_ADDRESS_CHARS` long: what the runtime dials is bounded and
    well-formed, whatever a packet says."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS:
        return False
    try:
        check_peer_address(address)
    except ConfigError:
        return False
    return True


def join_host_port(host: str, port: int | str) -> str:
    """Inverse of :func:`split_host_port`: brackets an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
