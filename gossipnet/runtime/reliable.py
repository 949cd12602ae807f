"""Reliable control messages over lossy packets: retries until an ACK, once per request.

Small control messages that must arrive (a LEAVE, a state request, a Moshpit
invitation) go through :meth:`Reliable.send_reliable`: each try is a fresh packet
carrying the same request id (``rq``), resent with exponential backoff until the
receiver's ACK (``ak``) or a deadline.  The receiver ACKs every copy but acts once per
(sender, epoch, request id), so a retry whose ACK was lost is not acted on twice.

Why apart from the packet I/O (:mod:`gossipnet.runtime.dispatch`): only packets that
carry a request id reach this code (the I/O calls :meth:`Reliable.accept` through a
hook), so the data path pays nothing for it, and it is tested alone over a
:class:`~gossipnet.runtime.dispatch.PacketIO`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Mapping
from typing import Any

from gossipnet.clock import Clock
from gossipnet.config import Config
from gossipnet.errors import ClosedError
from gossipnet.runtime.dispatch import PacketIO
from gossipnet.runtime.kinds import NodeKind
from gossipnet.transport.base import Buffer
from gossipnet.transport.wire import Packet

__all__ = ("Reliable", "wait_future")

#: Request ids remembered per node to drop retries; the oldest go first.
_SEEN_REQUESTS = 8192
_INT64_MAX = (1 << 63) - 1


async def wait_future(clock: Clock, fut: asyncio.Future[Any], timeout_s: float) -> None:
    """Wait for ``fut`` at most ``timeout_s`` on ``clock`` (a FakeClock jumps).

    Why not ``asyncio.wait_for``: its timeout runs on the loop's own time, which an
    injected clock does not move.

    Raises:
        TimeoutError: ``fut`` is not done at the deadline (it is left running).
    """
    if fut.done():
        return
    # one gate future opened by ``fut`` or the timer: no sleeper task, no asyncio.wait
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def open_gate(_: object = None) -> None:
        if not gate.done():
            gate.set_result(None)

    timer = clock.call_later(max(0.0, timeout_s), open_gate)
    fut.add_done_callback(open_gate)
    try:
        await gate
    finally:
        timer.cancel()
        fut.remove_done_callback(open_gate)
    if not fut.done():
        raise TimeoutError


class Reliable:
    """Retried, acknowledged, deduplicated control messages over ``io``.

    Construction wires it in: it subscribes to ``NodeKind.ACK`` and becomes
    ``io.accept_request``.

    Args:
        io: the packet I/O to send through and receive from.
        config: ``control_timeout_s`` (default deadline) and ``control_retry_s``
            (first backoff).
    """

    def __init__(self, io: PacketIO, config: Config) -> None:
        self.io = io
        self.config = config
        self.clock = io.clock
        #: request id -> (destination peer, its future); "" accepts an ACK from anyone
        self.pending: dict[int, tuple[str, asyncio.Future[None]]] = {}
        #: the next request id this node sends (ids are per incarnation)
        self.next_rid = 1
        self._seen: collections.OrderedDict[tuple[str, int, int], None] = collections.OrderedDict()
        io.subscribe(NodeKind.ACK, self.on_ack)
        io.accept_request = self.accept

    async def send_reliable(
        self,
        peer_id: str,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
        *,
        timeout_s: float | None = None,
        address: str | None = None,
    ) -> bool:
        """Send until acknowledged or ``timeout_s`` passes; True when acknowledged.

        Each try is a fresh packet (new sequence number) so the replay guard
        does not eat retries; the receiver acts once per request id.

        Args:
            peer_id: the destination ("" with ``address``: an id not known yet).
            timeout_s: deadline in seconds (default ``Config.control_timeout_s``).
            address: send there instead of the peer's known address.

        Raises:
            ClosedError: the node is closed.
        """
        io = self.io
        if io.closed:
            raise ClosedError("node is closed")
        timeout = self.config.control_timeout_s if timeout_s is None else timeout_s
        rid = self.next_rid
        self.next_rid += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending[rid] = (peer_id, fut)
        body = dict(fields or {})
        body["rq"] = rid
        deadline = self.clock.now() + timeout
        delay = self.config.control_retry_s
        try:
            while not io.closed:
                dst = address or (io.membership.address_of(peer_id) if io.membership else None)
                if dst is not None:
                    io.send_to_address(dst, kind, body, payload, dst=peer_id or None)
                remaining = deadline - self.clock.now()
                if remaining <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await wait_future(self.clock, fut, min(delay, remaining))
                if fut.done():
                    return not fut.cancelled()
                delay = min(delay * 2, 0.5)
            return False
        finally:
            self.pending.pop(rid, None)

    def accept(self, pkt: Packet, rid: Any) -> bool:
        """A packet with request id ``rid`` arrived: ACK it; False to drop it (a retry
        of a request already acted on, or an id that is not an int64)."""
        io = self.io
        if type(rid) is not int or not 0 <= rid <= _INT64_MAX:
            io.codec.rejects["request_id"] += 1
            return False
        # where the sender's own packets put it: never an address a packet names
        reply_to = io.membership.address_of(pkt.src) if io.membership else None
        if reply_to is not None:
            io.send_to_address(reply_to, NodeKind.ACK, {"ak": rid}, dst=pkt.src)
        key = (pkt.src, pkt.epoch, rid)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > _SEEN_REQUESTS:
            self._seen.popitem(last=False)
        return True

    def on_ack(self, pkt: Packet) -> None:
        """An ACK: complete the request it names, if it came from its destination."""
        rid = pkt.fields.get("ak")
        entry = self.pending.get(rid) if isinstance(rid, int) else None
        if entry is not None and entry[0] in (pkt.src, "") and not entry[1].done():
            entry[1].set_result(None)

    def cancel_all(self) -> None:
        """Cancel every request still waiting (the node is closing)."""
        for _, fut in self.pending.values():
            if not fut.done():
                fut.cancel()
        self.pending.clear()
