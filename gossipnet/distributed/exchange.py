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

What is taken in, and why (the torch backend's object collectives,
``broadcast_object_list`` and ``all_gather_object``, unpickle what lands in these
messages, so a part taken from the wrong sender is code run in this process):

* only from a rank of the group: ``src`` is authenticated by the transport (the
  packet came from the peer it names), and it must be one of ``members``; a part
  from any other peer is dropped before its payload is looked at;
* only for a collective within ``window`` of the one running (or next): how far a
  rank can legitimately run ahead is bounded (see :meth:`Exchange.run`), and an
  older collective's part is a late copy;
* for the running collective, no more parts and bytes than it expects from each
  rank; for later ones, no more than ``max_buffered_bytes`` in all (payload plus
  :data:`PART_OVERHEAD` per part).

Every part refused is a counted drop by reason (:attr:`Exchange.counters`), and
the first of each reason is logged.  The guarantee is authentication plus
membership, not the content: an object collective carries arbitrary picklable
objects, as torch's own backends do, so a rank of the group (one holding the
secret and a rank's identity) can make the others run code, exactly as under gloo.

A rank that the failure detector declares dead while we wait for it is either
*excused* (barrier and the exact all-reduce go on with the survivors) or an error
naming it (broadcast and allgather cannot fill its slot exactly).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from gossipnet.distributed.kinds import DistKind
from gossipnet.errors import PeerUnreachable
from gossipnet.runtime.node import Node
from gossipnet.runtime.reliable import wait_future
from gossipnet.transport.wire import Packet

__all__ = ("Exchange", "rank_id")

log = logging.getLogger(__name__)

#: Parts of one message in flight (unacknowledged) toward one destination.
WINDOW = 32
#: How often a waiting collective looks at the failure detector's verdicts.
_POLL_S = 0.05
#: The number of a group's first collective (the process group counts from 1).
FIRST_OP = 1
#: Bytes buffered at most for collectives that are not running yet (sent by ranks that
#: run ahead); the running collective is bounded by its own size instead.
MAX_BUFFERED_BYTES = 512 << 20
#: The smallest part any rank cuts (the floor on ``part_bytes``): a message of ``n``
#: bytes has at most ``ceil(n / MIN_PART_BYTES)`` parts.
MIN_PART_BYTES = 256
#: Bookkeeping charged per buffered part on top of its payload, so that many tiny
#: parts cannot hold more memory than the cap says.
PART_OVERHEAD = 128
#: Why a part is refused (each a counter ``dropped_<reason>``).
DROP_REASONS = ("not_member", "stale", "ahead", "count", "size", "over_cap", "duplicate")


def rank_id(rank: int) -> str:
    """The peer id of rank ``rank`` of a process group (every rank names its peer so)."""
    return f"rank{rank}"


def _parts_for(nbytes: int) -> int:
    """The most parts a message of ``nbytes`` can legitimately be cut into."""
    return max(1, -(-nbytes // MIN_PART_BYTES))


@dataclass(slots=True)
class _Inbox:
    """The parts of one (collective, sender) message received so far."""

    count: int
    parts: dict[int, bytes] = field(default_factory=dict)
    #: payload bytes held
    nbytes: int = 0

    def complete(self) -> bool:
        return len(self.parts) == self.count

    def join(self) -> bytes:
        return b"".join(self.parts[i] for i in range(self.count))


class Exchange:
    """Sends and collects whole messages between the group's peers.

    Args:
        node: this peer's node (subscribed to :class:`DistKind.PART` here).
        part_bytes: payload bytes per part (one packet).
        members: the peer ids of the group's other ranks: the only senders taken in.
        window: collectives ahead of the running (or next) one whose parts are kept;
            default the group's size, the most a rank can run ahead (see :meth:`run`).
        max_buffered_bytes: the cap on bytes buffered for collectives not running yet.
    """

    def __init__(
        self,
        node: Node,
        part_bytes: int,
        members: Collection[str],
        *,
        window: int | None = None,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
    ) -> None:
        self.node = node
        self.part_bytes = max(MIN_PART_BYTES, part_bytes)
        self.members = frozenset(members)
        self.window = max(2, len(self.members) + 1) if window is None else max(1, window)
        self.max_buffered_bytes = max_buffered_bytes
        self._inboxes: dict[tuple[int, str], _Inbox] = {}
        self._arrived = asyncio.Event()
        #: the lowest collective still to come: the running one, or the next
        self._floor = FIRST_OP
        #: the running collective and the bytes it expects from each source
        self._running: int | None = None
        self._expect = 0
        #: sources whose message for the running collective is larger than expected
        self._oversized: set[str] = set()
        #: bytes held in inboxes, payload plus PART_OVERHEAD per part; of them, the
        #: running collective's (the rest is what the cap bounds)
        self._buffered = 0
        self._running_bytes = 0
        #: parts received / sent, malformed parts, parts refused (``dropped_<reason>``)
        self.counters = {"parts_in": 0, "parts_out": 0, "malformed": 0} | {
            f"dropped_{r}": 0 for r in DROP_REASONS
        }
        self._logged: set[str] = set()
        node.subscribe(DistKind.PART, self._on_part)

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for collectives (payload plus :data:`PART_OVERHEAD` per part)."""
        return self._buffered

    def _drop(self, reason: str, src: str, op: object) -> None:
        """Count a refused part; log the first of each reason (what, from whom)."""
        self.counters[reason if reason == "malformed" else f"dropped_{reason}"] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "%s: dropped a collective part from %r for collective #%r (%s); further"
                " drops of this kind are only counted",
                self.node.peer_id,
                src,
                op,
                reason,
            )

    def _on_part(self, pkt: Packet) -> None:
        src = pkt.src
        f = pkt.fields
        op = f.get("o")
        if src not in self.members:  # before anything else: not one of the group's ranks
            self._drop("not_member", src, op)
            return
        index, count = f.get("i"), f.get("n")
        if not (
            type(op) is int
            and type(index) is int
            and type(count) is int
            and 0 <= index < count <= 1 << 31
            and op >= 0
        ):
            self._drop("malformed", src, op)
            return
        if op < self._floor:
            self._drop("stale", src, op)
            return
        if op >= self._floor + self.window:
            self._drop("ahead", src, op)
            return
        box = self._inboxes.get((op, src))
        if box is not None and box.count != count:
            self._drop("malformed", src, op)
            return
        if box is not None and index in box.parts:
            self._drop("duplicate", src, op)
            return
        payload = pkt.payload
        size = len(payload)
        if op == self._running:  # bounded by what it needs: ``expect`` bytes per source
            held = box.nbytes if box is not None else 0
            if count > _parts_for(self._expect) or held + size > self._expect:
                self._drop("count" if count > _parts_for(self._expect) else "size", src, op)
                self._oversized.add(src)
                self._arrived.set()  # the collective raises at once, naming the sender
                return
        elif count > _parts_for(self.max_buffered_bytes):
            self._drop("count", src, op)  # a message that could never fit under the cap
            return
        elif self._buffered - self._running_bytes + size + PART_OVERHEAD > self.max_buffered_bytes:
            self._drop("over_cap", src, op)
            return
        if box is None:
            box = self._inboxes[(op, src)] = _Inbox(count)
        self.counters["parts_in"] += 1
        box.parts[index] = bytes(payload)
        box.nbytes += size
        self._buffered += size + PART_OVERHEAD
        if op == self._running:
            self._running_bytes += size + PART_OVERHEAD
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
        expect: int,
        excuse_dead: bool,
    ) -> dict[str, bytes]:
        """Send ``outgoing[peer]`` to each peer and collect one message from each source.

        Collectives run one at a time, in the order of ``op``.  Why the window's
        default is the group's size: every collective makes some rank wait until
        others have started it (all of them, or the broadcast's root), so while one
        rank is still in collective ``k``, each collective after it holds back a
        rank of its own, and no rank can be further ahead than ``k`` plus the
        group's size minus one.

        Args:
            op: the collective's number (increasing, from :data:`FIRST_OP`).
            outgoing: destination peer id -> our message to it.
            sources: the ranks (``members``) to hear one message from each.
            timeout_s: the deadline for the whole collective.
            expect: the bytes of each source's message (every rank passes the same
                shapes); a larger one is refused and raises here.
            excuse_dead: let a source that the failure detector declares dead go.

        Returns:
            sender -> message for every source that was heard (all of them unless
            ``excuse_dead`` let a dead one go).

        Raises:
            PeerUnreachable: a source or destination died (and is not excused), or the
                deadline passed; the message names them.
            ValueError: a source sent more than ``expect`` bytes (tensors of other
                shapes or dtypes than ours), naming it.
        """
        strangers = sorted(set(sources) - self.members)
        if strangers:
            raise ValueError(f"collective #{op}: {strangers} are not ranks of this group")
        clock = self.node.clock
        deadline = clock.now() + timeout_s
        self._start(op, expect)
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
            self._finish(op)

    def _start(self, op: int, expect: int) -> None:
        """Collective ``op`` runs now: parts that came early must fit what it expects."""
        self._floor = max(self._floor, op)
        self._running = op
        self._expect = expect
        self._oversized.clear()
        self._running_bytes = 0
        for (o, src), box in self._inboxes.items():
            if o != op:
                continue
            self._running_bytes += box.nbytes + PART_OVERHEAD * len(box.parts)
            if box.count > _parts_for(expect) or box.nbytes > expect:
                self._oversized.add(src)

    def _finish(self, op: int) -> None:
        """Collective ``op`` is over: free its inboxes (and any older), refuse its parts."""
        self._running = None
        self._running_bytes = 0
        self._oversized.clear()
        self._floor = max(self._floor, op + 1)
        for key in [k for k in self._inboxes if k[0] <= op]:
            box = self._inboxes.pop(key)
            self._buffered -= box.nbytes + PART_OVERHEAD * len(box.parts)

    def _drops_note(self) -> str:
        """The parts refused so far, for a timeout's message ("" when none)."""
        dropped = {
            r: n for r in ("ahead", "over_cap", "stale") if (n := self.counters[f"dropped_{r}"])
        }
        if not dropped:
            return ""
        listed = ", ".join(f"{n} {r}" for r, n in dropped.items())
        return (
            f" (parts refused so far: {listed}; 'over_cap' is the cap of"
            f" {self.max_buffered_bytes} bytes buffered for collectives not running yet)"
        )

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
            oversized = sorted(self._oversized & waiting)
            if oversized:
                raise ValueError(
                    f"collective #{op}: {', '.join(oversized)} sent more than the"
                    f" {self._expect} bytes this rank expects; every rank must pass tensors"
                    " of the same shapes and dtypes"
                )
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
                    f" before the group's timeout{self._drops_note()}"
                )
            waiter = asyncio.ensure_future(self._arrived.wait())
            with contextlib.suppress(TimeoutError):
                await wait_future(clock, waiter, min(_POLL_S, remaining))
            waiter.cancel()
