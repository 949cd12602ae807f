"""Where a ``udp://`` address points: IP literals at once, names in the background.

Why in the background: ``send`` is synchronous and must never block on DNS, so
the first packets to a host *name* are dropped (``dropped_unreachable``) while
``getaddrinfo`` runs on the loop's executor, as on a LAN before ARP answers;
a failed lookup is retried after :data:`RESOLVE_RETRY_S`.  IP literals never wait.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import cast

from gossipnet.clock import Clock
from gossipnet.errors import ConfigError
from gossipnet.transport.address import split_address, split_host_port

__all__ = ("RESOLVE_RETRY_S", "Resolver", "SockAddr")

_log = logging.getLogger(__name__)

#: Seconds before a failed name resolution is tried again.
RESOLVE_RETRY_S = 1.0

SockAddr = tuple[str, int] | tuple[str, int, int, int]


class Resolver:
    """A UDP socket's address book.

    Args:
        clock: times the retry of failed lookups.

    ``loop`` and ``v6`` (the socket's family: IPv4 addresses become v4-mapped)
    are set when the socket is bound.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.loop: asyncio.AbstractEventLoop | None = None
        self.v6 = False
        self.addrs: dict[str, SockAddr] = {}  # dst URL -> resolved socket address
        self._failed: dict[str, float] = {}  # dst URL -> clock time its lookup failed
        self.resolving: dict[str, asyncio.Task[SockAddr | None]] = {}

    def resolve(self, dst: str) -> SockAddr | None:
        """Socket address of ``dst`` now, or None (and start a background lookup for names)."""
        try:
            scheme, rest = split_address(dst)
            host, port_s = split_host_port(rest)
            port = int(port_s)
        except (ConfigError, ValueError):
            return None
        if scheme != "udp" or not 0 < port < 65536:
            return None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            self._resolve_name(dst, host, port)  # resolves in the background
            return None
        addr = self._sockaddr(ip, port)
        if addr is not None:
            self.addrs[dst] = addr
        return addr

    def _sockaddr(
        self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int
    ) -> SockAddr | None:
        if self.v6:
            text = f"::ffff:{ip}" if ip.version == 4 else str(ip)
            return (text, port, 0, 0)
        return (str(ip), port) if ip.version == 4 else None

    def _resolve_name(self, dst: str, host: str, port: int) -> None:
        failed_at = self._failed.get(dst)
        if failed_at is not None and self.clock.now() - failed_at < RESOLVE_RETRY_S:
            return None
        if dst not in self.resolving and self.loop is not None:
            task = self.loop.create_task(self._lookup(self.loop, dst, host, port))
            self.resolving[dst] = task
        return None

    async def _lookup(
        self, loop: asyncio.AbstractEventLoop, dst: str, host: str, port: int
    ) -> SockAddr | None:
        family = socket.AF_INET6 if self.v6 else socket.AF_INET
        flags = socket.AI_V4MAPPED if self.v6 else 0
        try:
            infos = await loop.getaddrinfo(
                host, port, family=family, type=socket.SOCK_DGRAM, flags=flags
            )
        except (OSError, UnicodeError) as err:
            _log.warning("cannot resolve %s (%s); packets to it are dropped", dst, err)
            infos = []
        finally:
            self.resolving.pop(dst, None)
        if not infos:
            self._failed[dst] = self.clock.now()
            return None
        addr = cast(SockAddr, infos[0][4])  # AF_INET/AF_INET6 only (family above)
        self._failed.pop(dst, None)
        self.addrs[dst] = addr
        return addr

    def forget(self, dst: str) -> None:
        """Drop ``dst``'s cached address (a departed peer's name may move)."""
        self.addrs.pop(dst, None)
        self._failed.pop(dst, None)

    def cancel(self) -> None:
        """Cancel pending lookups (the socket is closing)."""
        for task in self.resolving.values():
            task.cancel()
        self.resolving.clear()
