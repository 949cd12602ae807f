"""Which destinations take the loop-served stream (``local_stream.py``), and its sockets.

Why its own module: the choice is per destination and changes over time.  A
``tcp://127.0.0.1:<port>`` destination whose stream socket accepts a
connection takes the stream; any other destination, one whose socket refuses
(not up yet, a stale file, a peer without it) or one whose connection broke,
takes the ZeroMQ path (its alias or TCP), and a refused or broken one is
tried again after :data:`~.local_stream.RETRY_S`.  The ZeroMQ backend asks
:meth:`StreamRoutes.writer` on every send: a dictionary look-up once decided.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from collections.abc import Callable

from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.transport.address import split_address, split_host_port
from gossipnet.transport.base import TransportStats
from gossipnet.transport.zeromq import local_shm
from gossipnet.transport.zeromq.local_ipc import ALIASED_HOST, stream_path
from gossipnet.transport.zeromq.local_stream import RETRY_S, SNDBUF_BYTES, StreamWriter

__all__ = ("SHM_BREAKS_MAX", "StreamRoutes")

_log = logging.getLogger(__name__)

_NEVER = float("inf")
#: Streams with a shared-memory segment that may break to one destination before its
#: next streams carry every payload inline: a receiver that cannot map segments
#: (an address-space limit, a seccomp filter) closes each such stream at once, and
#: would otherwise cost a dropped queue and a second on ZeroMQ per attempt, forever.
SHM_BREAKS_MAX = 2


class StreamRoutes:
    """Connected stream writers by destination; see the module docstring.

    Args:
        config: ``send_queue_packets`` bounds each writer's queue.
        loop: the loop that writes (the transport's).
        stats: the transport's counters.
        now: monotonic seconds (the transport's clock), for retry windows.
    """

    def __init__(
        self,
        config: Config,
        loop: asyncio.AbstractEventLoop,
        stats: TransportStats,
        now: Callable[[], float],
    ) -> None:
        self._config = config
        self._loop = loop
        self._stats = stats
        self._now = now
        self.writers: dict[str, StreamWriter] = {}
        #: the segment new connections share (``local_shm.py``)
        self._shm: local_shm.ShmWriter | None = None
        #: streams with a segment that broke, per destination (:data:`SHM_BREAKS_MAX`)
        self._shm_breaks: collections.Counter[str] = collections.Counter()
        self._skip: dict[str, float] = {}  # dst -> when to try its stream again
        #: called with a destination whose stream broke (its receiver closed, most
        #: often because it left): the backend closes the alias it held open beside it
        self.on_broken: Callable[[str], None] | None = None

    def writer(self, dst: str) -> StreamWriter | None:
        """The stream to ``dst`` (connecting it if due), or None: use ZeroMQ."""
        w = self.writers.get(dst)
        if w is not None:
            return w
        until = self._skip.get(dst)
        if until is not None and self._now() < until:
            return None
        return self._open(dst)

    def _open(self, dst: str) -> StreamWriter | None:
        path = self._path(dst)
        if path is None:
            self._skip[dst] = _NEVER
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # best effort: capped by wmem_max
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
            sock.connect(path)  # a Unix connect completes at once or fails
        except OSError:  # no listener (yet), a stale file, a full backlog
            sock.close()
            self._skip[dst] = self._now() + RETRY_S
            return None
        self._skip.pop(dst, None)
        limit = self._config.send_queue_packets
        w = StreamWriter(sock, self._loop, self._stats, limit, self._broken)
        if (
            self._config.local_shm
            and local_shm.available()
            and self._shm_breaks[dst] < SHM_BREAKS_MAX
        ):
            self._offer_shm(w)
        self.writers[dst] = w
        return w

    def _offer_shm(self, w: StreamWriter) -> None:
        """Give ``w`` a column of our segment (a new segment once one has none left)."""
        shm = self._shm
        reader = shm.attach() if shm is not None else None
        if shm is None or reader is None:
            try:
                fresh = local_shm.ShmWriter()
            except OSError:  # no memfd (old kernel, seccomp): payloads stay inline
                return
            if shm is not None and shm.attached <= 0:
                shm.close()  # exhausted and unused: nobody can attach any more
            shm = self._shm = fresh
            reader = fresh.attach()
            if reader is None:  # a fresh segment has every column
                return
        w.offer_shm(shm, reader)

    def _path(self, dst: str) -> str | None:
        try:
            scheme, rest = split_address(dst)
            host, port = split_host_port(rest) if scheme == "tcp" else ("", "")
        except ConfigError:
            return None
        if host != ALIASED_HOST:
            return None
        return stream_path(port)

    def _broken(self, w: StreamWriter) -> None:
        for dst, have in list(self.writers.items()):
            if have is w:
                del self.writers[dst]
                self._skip[dst] = self._now() + RETRY_S
                if w.had_shm:
                    self._shm_breaks[dst] += 1
                    if self._shm_breaks[dst] == SHM_BREAKS_MAX:
                        _log.warning(
                            "same-host stream to %s broke %d times with shared memory;"
                            " its payloads now travel inline (slower, not lost)",
                            dst, SHM_BREAKS_MAX,
                        )  # fmt: skip
                if self.on_broken is not None:
                    self.on_broken(dst)

    def is_local(self, dst: str) -> bool:
        return dst in self.writers

    def forget(self, dst: str) -> None:
        """Close ``dst``'s stream (queued packets dropped, counted); a later send reopens."""
        self._skip.pop(dst, None)
        self._shm_breaks.pop(dst, None)  # a later peer at that address starts afresh
        w = self.writers.pop(dst, None)
        if w is not None:
            self._stats.dropped_unreachable += w.queued_packets
            w.close()

    def close(self) -> None:
        for dst in list(self.writers):
            self.forget(dst)
        self._skip.clear()
        if self._shm is not None:
            self._shm.close()  # every writer detached above
            self._shm = None
