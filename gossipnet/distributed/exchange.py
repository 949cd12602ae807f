"""Exact collectives over gossipnet's reliable control channel (loop thread only).

DDP's start-up parameter broadcast and a framework's metric gathers must arrive
whole, so they do not take the lossy all-reduce: each rank's message is cut into
parts of one packet each, and every part goes through
:meth:`gossipnet.runtime.reliable.Reliable.send_reliable` (resent until the
receiver's ACK, acted on once).  A window of parts is in flight per destination,
so a long message streams instead of paying one round trip per part.

Messages are keyed by the collective's sequence number in the group (every rank
issues the same collectives in the same order, as ``torch.distributed`` requires)
and by the sender, so a rank that runs ahead only fills an inbox early.

A rank that the failure detector declares dead while we wait for it is either
*excused* (barrier and the exact all-reduce go on with the survivors) or an error
naming it (broadcast and allgather cannot fill its slot exactly).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gossipnet.distributed.kinds import DistKind
from gossipnet.errors import PeerUnreachable
from gossipnet.runtime.node import Node
from gossipnet.runtime.reliable import wait_future
from gossipnet.transport.wire import Packet

__all__ = ("Exchange",)

#: Parts of one message in flight (unacknowledged) toward one destination.
WINDOW = 32
#: How often a waiting collective looks at the failure detector's verdicts.
_POLL_S = 0.05


@dataclass(slots=True)
class _Inbox:
    """The parts of one (collective, sender) message received so far."""

    count: int
    parts: dict[int, bytes] = field(default_factory=dict)

    def complete(self) -> bool:
        return len(self.parts) == self.count

    def join(self) -> bytes:
        return b"".join(self.parts[i] for i in range(self.count))


class Exchange:
    """Sends and collects whole messages between the group's peers.

    Args:
        node: this peer's node (subscribed to :class:`DistKind.PART` here).
        part_bytes: payload bytes per part (one packet).
    """

    def __init__(self, node: Node, part_bytes: int) -> None:
        self.node = node
        self.part_bytes = max(256, part_bytes)
        self._inboxes: dict[tuple[int, str], _Inbox] = {}
        self._arrived = asyncio.Event()
        #: parts received / sent, malformed parts dropped
        self.counters = {"parts_in": 0, "parts_out": 0, "malformed": 0}
        node.subscribe(DistKind.PART, self._on_part)

    def _on_part(self, pkt: Packet) -> None:
        f = pkt.fields
        op, index, count = f.get("o"), f.get("i"), f.get("n")
        if not (
            type(op) is int
            and type(index) is int
            and type(count) is int
            and 0 <= index < count <= 1 << 31
            and op >= 0
        ):
            self.counters["malformed"] += 1
            return
        box = self._inboxes.get((op, pkt.src))
        if box is None:
            box = self._inboxes[(op, pkt.src)] = _Inbox(count)
        elif box.count != count:
            self.counters["malformed"] += 1
            return
        self.counters["parts_in"] += 1
        box.parts[index] = bytes(pkt.payload)
        if box.complete():
            self._arrived.set()

    async def _send(self, op: int, peer_id: str, data: memoryview, deadline: float) -> bool:
        """Deliver ``data`` to ``peer_id`` as acknowledged parts; False past ``deadline``."""
        size = self.part_bytes
        count = max(1, -(-len(data) // size))
        gate = asyncio.Semaphore(WINDOW)
        clock = self.node.clock

        async def one(i: int) -> bool:
            async with gate:
                remaining = deadline - clock.now()
                if remaining <= 0:
                    return False
                self.counters["parts_out"] += 1
                return await self.node.send_reliable(
                    peer_id,
                    DistKind.PART,
                    {"o": op, "i": i, "n": count},
                    data[i * size : (i + 1) * size],
                    timeout_s=remaining,
                )

        results = await asyncio.gather(*(one(i) for i in range(count)))
        return all(results)

    async def run(
        self,
        op: int,
        outgoing: dict[str, bytes],
        sources: Sequence[str],
        timeout_s: float,
        *,
        excuse_dead: bool,
    ) -> dict[str, bytes]:
        """Send ``outgoing[peer]`` to each peer and collect one message from each source.

        Returns:
            sender -> message for every source that was heard (all of them unless
            ``excuse_dead`` let a dead one go).

        Raises:
            PeerUnreachable: a source or destination died (and is not excused), or the
                deadline passed; the message names them.
        """
        clock = self.node.clock
        deadline = clock.now() + timeout_s
        sends = {
            peer: asyncio.ensure_future(self._send(op, peer, memoryview(data), deadline))
            for peer, data in outgoing.items()
        }
        try:
            got = await self._collect(op, sources, deadline, excuse_dead)
            await self._delivered(op, sends)
            return got
        finally:
            for task in sends.values():
                task.cancel()
            for key in [k for k in self._inboxes if k[0] <= op]:
                del self._inboxes[key]

    async def _delivered(self, op: int, sends: Mapping[str, asyncio.Future[bool]]) -> None:
        """Wait for every send's ACKs, or for its destination to die or leave.

        Why a dead destination is no error here: our own result depends only on what
        we received; a peer that left after taking its copy (its last ACK lost) must
        not fail us, and one that died without it fails on its side, not ours.
        """
        pending = dict(sends)
        while pending:
            for peer, task in list(pending.items()):
                if task.done():
                    if not task.result() and not self._dead(peer):
                        raise PeerUnreachable(
                            f"{peer} did not acknowledge collective #{op}'s message in time"
                        )
                    del pending[peer]
                elif self._dead(peer):
                    task.cancel()
                    del pending[peer]
            if pending:
                await asyncio.wait(pending.values(), timeout=_POLL_S)

    def _dead(self, peer: str) -> bool:
        return peer not in self.node.alive_peers()

    async def _collect(
        self, op: int, sources: Sequence[str], deadline: float, excuse_dead: bool
    ) -> dict[str, bytes]:
        clock = self.node.clock
        waiting = set(sources)
        got: dict[str, bytes] = {}
        while True:
            self._arrived.clear()  # before looking: a part arriving later wakes us
            for src in list(waiting):
                box = self._inboxes.get((op, src))
                if box is not None and box.complete():
                    got[src] = box.join()
                    waiting.discard(src)
            dead = sorted(p for p in waiting if self._dead(p))
            if dead and excuse_dead:
                waiting.difference_update(dead)
            elif dead:
                raise PeerUnreachable(
                    f"{', '.join(dead)} died before collective #{op} completed; an exact"
                    " collective cannot go on without them"
                )
            if not waiting:
                return got
            remaining = deadline - clock.now()
            if remaining <= 0:
                raise PeerUnreachable(
                    f"collective #{op}: no complete message from {', '.join(sorted(waiting))}"
                    " before the group's timeout"
                )
            waiter = asyncio.ensure_future(self._arrived.wait())
            with contextlib.suppress(TimeoutError):
                await wait_future(clock, waiter, min(_POLL_S, remaining))
            waiter.cancel()
