"""In-process transport: a hub that moves packets between endpoints of one process.

Why it exists: unit tests and simulations with hundreds of peers need a network
without sockets, ports or kernel buffers, that still behaves like one where it
matters to the layers above.  So delivery is asynchronous (scheduled with
``loop.call_soon``, never a direct call from ``send``), FIFO per link, and the
frames are copied at ``send`` time because the sender may reuse its buffers
the moment ``send`` returns, as it may with a real socket.  Faults are not
modelled here: wrap a :class:`MemoryTransport` in
:class:`~gossipnet.transport.faults.FaultyTransport`, exactly as one wraps the
ZeroMQ or UDP backends, so one fault plan means the same thing everywhere.

Endpoints may live on different event loops (one loop thread per peer, as
``join()`` runs them): a packet for a peer on another loop is handed over with
``call_soon_threadsafe``.  The per-destination queue limit is then approximate
(its counter is updated from two threads without a lock), which is fine for a
test network.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from typing import ClassVar

from gossipnet.errors import ClosedError, ConfigError
from gossipnet.transport.base import Buffer, PacketHandler, Transport

__all__ = ("MemoryNetwork", "MemoryTransport")

_SCHEME = "mem://"


class MemoryNetwork:
    """The hub: maps ``mem://<name>`` addresses to live :class:`MemoryTransport` s.

    One network is one isolated world; endpoints of different networks cannot
    reach each other, so tests running side by side never interfere.
    """

    def __init__(self) -> None:
        self._endpoints: dict[str, MemoryTransport] = {}
        self._auto = itertools.count()
        # register/unregister may run on different loop threads (one per peer).
        self._lock = threading.Lock()

    @property
    def addresses(self) -> tuple[str, ...]:
        """Addresses of the endpoints currently started and not closed, sorted."""
        return tuple(sorted(self._endpoints))

    def lookup(self, address: str) -> MemoryTransport | None:
        """The live endpoint bound to ``address``, or None."""
        return self._endpoints.get(address)

    def _register(self, transport: MemoryTransport, listen: str) -> str:
        name = listen[len(_SCHEME) :]
        with self._lock:
            if name in ("", "0"):
                # Like binding port 0: pick a free name; skip ones taken by hand.
                while True:
                    address = f"{_SCHEME}auto-{next(self._auto)}"
                    if address not in self._endpoints:
                        break
            else:
                address = listen
                if address in self._endpoints:
                    raise ConfigError(
                        f"{address} is already bound on this MemoryNetwork; choose another "
                        "name or listen on 'mem://' to get a free one"
                    )
            self._endpoints[address] = transport
        return address

    def _unregister(self, address: str, transport: MemoryTransport) -> None:
        with self._lock:
            if self._endpoints.get(address) is transport:
                del self._endpoints[address]


class MemoryTransport(Transport):
    """One endpoint on a :class:`MemoryNetwork`.

    Args:
        network: the hub to register on at :meth:`start`.
        listen: ``mem://<name>`` binds that name; ``mem://`` or ``mem://0`` picks a
            free ``mem://auto-<n>``.
        queue_limit_packets: at most this many packets may wait undelivered for this
            endpoint; more are dropped at the sender and counted in its
            ``stats.dropped_queue_full``.  ``None`` means unbounded.

    Raises:
        ConfigError: ``listen`` is not a ``mem://`` URL, the name is taken (at
            :meth:`start`), or ``queue_limit_packets`` is not positive.
    """

    schemes: ClassVar[tuple[str, ...]] = ("mem",)
    default_chunk_bytes: ClassVar[int] = 64 * 1024
    #: Large on purpose: the memory hub has no MTU, only a sanity limit.
    MAX_PACKET_BYTES: ClassVar[int] = 64 * 1024 * 1024

    def __init__(
        self,
        network: MemoryNetwork,
        listen: str = _SCHEME,
        *,
        queue_limit_packets: int | None = None,
    ) -> None:
        super().__init__()
        if not listen.startswith(_SCHEME):
            raise ConfigError(f"MemoryTransport needs a 'mem://<name>' address, got {listen!r}")
        if queue_limit_packets is not None and queue_limit_packets <= 0:
            raise ConfigError(f"queue_limit_packets must be > 0 or None, got {queue_limit_packets}")
        self.network = network
        self._listen = listen
        self._queue_limit = queue_limit_packets
        self._pending = 0  # packets scheduled for this endpoint, not yet delivered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def max_packet_bytes(self) -> int:
        return self.MAX_PACKET_BYTES

    @property
    def pending_packets(self) -> int:
        """Packets scheduled for delivery to this endpoint and not yet delivered."""
        return self._pending

    async def start(self, handler: PacketHandler) -> str:
        """Register on the network and deliver packets to ``handler`` on this loop."""
        if self._closed:
            raise ClosedError("this MemoryTransport was closed; create a new one")
        if self._handler is not None:
            raise RuntimeError(f"{self.address} is already started")
        self._loop = asyncio.get_running_loop()
        self.address = self.network._register(self, self._listen)
        self._handler = handler
        return self.address

    def send(
        self,
        dst: str,
        frames: Sequence[Buffer],
        *,
        urgent: bool = False,
        group_bytes: int = 0,  # one channel: ignored
    ) -> bool:
        """Copy the frames and schedule their delivery to ``dst``; never blocks.

        Returns False (and counts why) when this endpoint is closed or not started
        (``send_errors``), ``dst`` is unknown or closed (``dropped_unreachable``),
        the packet has no frame (``dropped_malformed``), exceeds
        :attr:`max_packet_bytes` (``dropped_oversize``) or
        ``dst``'s queue limit is reached (``dropped_queue_full``).
        """
        stats = self.stats
        loop = self._loop
        if self._closed or loop is None:
            stats.send_errors += 1
            return False
        target = self.network._endpoints.get(dst)
        target_loop = target._loop if target is not None else None
        if target is None or target._closed or target_loop is None or target_loop.is_closed():
            stats.dropped_unreachable += 1
            return False
        if not frames:  # as on the socket backends: a packet has at least one frame
            stats.dropped_malformed += 1
            return False
        nbytes = 0
        for frame in frames:
            nbytes += frame.nbytes if isinstance(frame, memoryview) else len(frame)
        if nbytes > self.MAX_PACKET_BYTES:
            stats.dropped_oversize += 1
            return False
        limit = target._queue_limit
        if limit is not None and target._pending >= limit:
            stats.dropped_queue_full += 1
            return False
        # bytes(b) of a bytes object is the object itself: only mutable buffers copy.
        views = [memoryview(bytes(frame)) for frame in frames]
        target._pending += 1
        try:
            if target_loop is loop:
                loop.call_soon(target._deliver, views, nbytes)
            else:
                target_loop.call_soon_threadsafe(target._deliver, views, nbytes)
        except RuntimeError:  # the destination's loop closed under us
            target._pending -= 1
            stats.dropped_unreachable += 1
            return False
        stats.sent_packets += 1
        stats.sent_bytes += nbytes
        return True

    def _deliver(self, views: list[memoryview], nbytes: int) -> None:
        self._pending -= 1
        handler = self._handler
        if self._closed or handler is None:
            return  # closed while the packet was in flight: lost, like a closed socket
        self.stats.recv_packets += 1
        self.stats.recv_bytes += nbytes
        handler(views)

    async def close(self) -> None:
        """Unregister; packets still in flight to this endpoint are dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._handler = None
        if self.address:
            self.network._unregister(self.address, self)
