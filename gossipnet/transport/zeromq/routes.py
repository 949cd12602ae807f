"""The ZeroMQ backend's send side: one PUSH socket per destination, and which path it takes.

Why its own module: choosing the path is more than a ``connect``.  A
destination on ``127.0.0.1`` is reached over its same-host alias when one
answers (``local_ipc``), else over TCP; a sender that dialed before its peer
was up moves to the alias later, without losing what it sends meanwhile; and
whether a destination is reached over its alias decides whether its packets
may go unsigned (:meth:`PushRoutes.is_local`).  ``zeromq.py`` keeps binding,
receiving and the send call itself.
"""

from __future__ import annotations

from typing import cast

import zmq

from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.transport.address import split_address, split_host_port
from gossipnet.transport.zeromq.local_ipc import ALIASED_HOST, live_alias

__all__ = ("PushRoutes",)


class PushRoutes:
    """Connected PUSH sockets by destination address; see the module docstring.

    Args:
        config: socket options (queue size, heartbeats) and ``local_ipc``.
        schemes: address schemes the backend serves.
        inproc: the backend listens on ``inproc://``, whose endpoints reach only
            each other (one shared context), never tcp/ipc ones.
    """

    def __init__(self, config: Config, schemes: tuple[str, ...], *, inproc: bool) -> None:
        self.config = config
        self._schemes = schemes
        self._inproc = inproc
        self.ctx: zmq.Context[zmq.Socket[bytes]] | None = None  # set by the backend's start
        #: dst -> the socket packets to it take now (read on every send)
        self.push: dict[str, zmq.Socket[bytes]] = {}
        #: dst -> its alias socket, connecting, that takes over once it accepts packets
        self.next: dict[str, zmq.Socket[bytes]] = {}
        #: 127.0.0.1 dst -> port, dialed over TCP while no alias answered
        self.unaliased: dict[str, str] = {}
        self._aliased: set[str] = set()  # dsts whose socket in ``push`` is their alias
        self._ready: set[str] = set()  # aliased dsts whose socket accepted packets once

    def open(self, dst: str) -> zmq.Socket[bytes] | None:
        """A connected PUSH socket for ``dst``, or None if ``dst`` is not ours to reach."""
        if self.ctx is None:
            return None
        try:
            scheme, rest = split_address(dst)
        except ConfigError:
            return None
        # inproc endpoints live in their own (shared) context: unreachable across.
        if scheme not in self._schemes or (scheme == "inproc") != self._inproc:
            return None
        endpoint = dst
        port = self._aliased_port(scheme, rest)
        if port is not None:
            alias = live_alias(port)
            if alias is None:
                self.unaliased[dst] = port  # not up yet, or no alias: look again later
            else:
                endpoint = f"ipc://{alias}"
                self._aliased.add(dst)
        sock = self._dial(endpoint, ipv6=scheme == "tcp" and rest.startswith("["))
        if sock is None:
            self.unaliased.pop(dst, None)
            self._aliased.discard(dst)
        else:
            self.push[dst] = sock
        return sock

    def _dial(self, endpoint: str, *, ipv6: bool) -> zmq.Socket[bytes] | None:
        """A PUSH socket connecting to ``endpoint``, or None if ZeroMQ refuses it."""
        assert self.ctx is not None
        heartbeat_ms = max(1, round(self.config.heartbeat_interval_s * 1000))
        timeout_ms = max(1, round(self.config.failure_timeout_s * 1000))
        sock = self.ctx.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.config.send_queue_packets)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            # ZMTP heartbeats drop a connection whose peer vanished without a FIN
            # (power loss, partition): its queue is freed and sends fail fast again.
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
            if ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            return None
        return sock

    def _aliased_port(self, scheme: str, rest: str) -> str | None:
        """The port of a destination that may have a same-host alias, else None."""
        if scheme != "tcp" or not self.config.local_ipc:
            return None
        try:
            host, port = split_host_port(rest)
        except ConfigError:
            return None
        return port if host == ALIASED_HOST else None

    def look_for_alias(self, dst: str) -> None:
        """After ``dst``'s first packet over TCP, move it to its alias if it has one.

        Why then: a peer binds its alias right after its TCP port, so a sender
        that dialed before the peer was up reaches it over TCP first, and once
        one packet got through the alias exists too.  The alias socket takes
        over when connected (:meth:`take_over`); until then packets keep
        going over TCP.
        """
        port = self.unaliased.pop(dst)
        alias = live_alias(port)
        if alias is not None and self.ctx is not None:
            sock = self._dial(f"ipc://{alias}", ipv6=False)
            if sock is not None:
                self.next[dst] = sock

    def take_over(self, dst: str, sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        """The alias socket for ``dst`` once it accepts packets, else ``sock``."""
        nxt = self.next[dst]
        if not cast(int, nxt.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            return sock
        del self.next[dst]
        self.push[dst] = nxt
        self._aliased.add(dst)
        # Packets still queued on the TCP socket are lost with it: they are this
        # peer's first few (membership traffic, which is acknowledged or periodic).
        sock.close(linger=0)
        return nxt

    def ready_alias(self, dst: str) -> zmq.Socket[bytes] | None:
        """``dst``'s alias socket once it accepts packets, else None (opening it if need be).

        For a destination that also has a loop-served stream: large groups go
        over the alias (``ZmqTransport.send``), and only once it is connected,
        since ``IMMEDIATE=1`` drops what is sent before.  Called on the first
        packet to ``dst`` to start connecting; once it answered, a dictionary
        look-up and a set test.
        """
        sock = self.push.get(dst)
        if sock is not None and dst in self._ready:
            return sock
        if sock is None:
            sock = self.open(dst)
            if sock is None:
                return None
        if dst in self.unaliased:  # dialed TCP: its alias may exist by now
            self.look_for_alias(dst)
        if dst in self.next:
            sock = self.take_over(dst, sock)
        if dst not in self._aliased or not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            return None
        self._ready.add(dst)
        return sock

    def is_local(self, dst: str) -> bool:
        """True once ``dst``'s packets go over its alias (they arrive as ``LocalFrames``)."""
        return dst in self._aliased

    def forget(self, dst: str) -> None:
        """Close ``dst``'s sockets (queued packets are discarded); a later send reopens."""
        self.unaliased.pop(dst, None)
        self._aliased.discard(dst)
        self._ready.discard(dst)
        for sock in (self.push.pop(dst, None), self.next.pop(dst, None)):
            if sock is not None:
                sock.close(linger=0)

    def close(self) -> None:
        """Close every socket with zero linger."""
        for sock in (*self.push.values(), *self.next.values()):
            sock.close(linger=0)
        self.push.clear()
        self.next.clear()
        self.unaliased.clear()
        self._aliased.clear()
        self._ready.clear()
