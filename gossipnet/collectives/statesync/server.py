"""The serving side of state transfer: snapshots, manifests and chunks on request.

Split from :mod:`.sync` (the protocol is described there): the trainer publishes
snapshots (``publish`` / ``install``); a peer's ``man`` request is answered with
the latest snapshot's manifest, or ``wait`` when it is older than the client
accepts (which raises :attr:`StateServer.wanted`, so the trainer publishes a
fresh one); a ``get`` request with a run of chunks, each in its own packet.

A ``man`` request may instead name a *target* ``t = [kind, step]``: the latest
snapshot whose meta has that kind (``k``) and a ``step`` of at least ``step``; until
one exists the answer is ``wait`` and the target is kept (:meth:`StateServer.wanted_at`),
so the trainer publishes one when it gets there.  Why: peers asked for their state
at the same step publish identical parameters, which is what lets a downloader
compare their claims before adopting one (``training._evidence``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack

from gossipnet.collectives.statesync.kinds import StateKind
from gossipnet.collectives.statesync.snapshot import Snapshot
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("StateServer",)

_KEEP_SNAPSHOTS = 2  # of each kind: the current one and the one before, for transfers in flight
#: Targets kept per kind (the lowest are served first; more are dropped).
MAX_TARGETS = 16
#: Snapshot kinds a target may name (``training._evidence.LIVE`` / ``ANCHORED``).
TARGET_KINDS = (0, 1)
_MAX_STEP = (1 << 53) - 1


class StateServer:
    """Serves this peer's published state to other peers; loop thread only.

    Args:
        node: the started node.
        window_chunks: the most chunks a client may ask for at once is 4x this.
    """

    def __init__(self, node: Node, *, window_chunks: int) -> None:
        self.node = node
        self.window = window_chunks
        self.snapshots: list[Snapshot] = []
        #: a peer asked for state we do not have fresh: the trainer should publish
        self.wanted = False
        #: called (on the loop thread, must not block) whenever a peer asks for state
        #: we do not have fresh, so a trainer that is between steps, or done, can
        #: publish without waiting for its next step
        self.on_wanted: Callable[[], None] | None = None
        self.served_chunks = 0
        self._asked: dict[str, float] = {}  # transfer id -> its first manifest request
        self._targets: dict[int, set[int]] = {k: set() for k in TARGET_KINDS}
        node.subscribe(StateKind.REQ, self._on_req)

    def wanted_at(self, kind: int) -> int | None:
        """The lowest step a peer asked a snapshot of ``kind`` for that we have not
        published yet (None: no such request)."""
        targets = self._targets.get(kind)
        return min(targets) if targets else None

    @property
    def chunk_bytes(self) -> int:
        cfg = self.node.config
        transport = self.node.transport
        return cfg.chunk_bytes or (transport.default_chunk_bytes if transport else 64 * 1024)

    def publish(self, data: bytes, meta: dict[str, Any] | None = None) -> Snapshot:
        """Make ``data`` (e.g. :func:`pack_state`) the state served to others."""
        snap = Snapshot.of(bytes(data), self.chunk_bytes, meta or {}, self.node.clock.now())
        self.install(snap)
        return snap

    def install(self, snap: Snapshot) -> None:
        """Serve ``snap`` (built with :meth:`Snapshot.of` off the loop thread: hashing a
        large state there would stall heartbeats).  Keeps the latest
        ``_KEEP_SNAPSHOTS`` of each kind (meta ``k``; none for plain snapshots)."""
        kind = snap.meta.get("k")
        same = [s for s in self.snapshots if s.meta.get("k") == kind]
        drop = {id(s) for s in same[: max(0, len(same) - (_KEEP_SNAPSHOTS - 1))]}
        self.snapshots = [s for s in self.snapshots if id(s) not in drop] + [snap]
        self.wanted = False
        step = snap.meta.get("step")
        targets = self._targets.get(kind) if type(kind) is int else None
        if targets and type(step) is int:
            targets.difference_update([t for t in targets if t <= step])

    def _find(self, sid: object) -> Snapshot | None:
        return next((s for s in self.snapshots if s.sid == sid), None)

    def _on_req(self, pkt: Packet) -> None:
        op, xid = pkt.fields.get("op"), pkt.fields.get("x")
        if not isinstance(xid, str):
            return
        if op == "man" and "t" in pkt.fields:
            self._on_target(pkt, xid, pkt.fields["t"])
        elif op == "man":
            max_age = pkt.fields.get("a", -1.0)
            snap = self.snapshots[-1] if self.snapshots else None
            # age counts back from the client's first request, so max_age 0 means
            # "published after I asked" (at most one training step old)
            asked = self._asked.setdefault(xid, self.node.clock.now())
            while len(self._asked) > 256:
                del self._asked[next(iter(self._asked))]
            fresh = snap is not None and (
                not isinstance(max_age, int | float)
                or max_age < 0
                or snap.created >= asked - max_age
            )
            if snap is None or not fresh:
                self.wanted = True
                if self.on_wanted is not None:  # at every ask: it may have been busy
                    self.on_wanted()
                self.node.send(pkt.src, StateKind.DATA, {"op": "wait", "x": xid})
                return
            self._send_manifest(pkt.src, xid, snap)
        elif op == "get":
            snap = self._find(pkt.fields.get("sid"))
            c, n = pkt.fields.get("c"), pkt.fields.get("n")
            if snap is None:
                self.node.send(pkt.src, StateKind.DATA, {"op": "gone", "x": xid})
            elif type(c) is int and type(n) is int and c >= 0 and 0 < n <= 4 * self.window:
                stop = min(c + n, snap.nchunks)
                self.node.spawn(self._serve(pkt.src, xid, snap, c, stop), "state-serve")

    def _on_target(self, pkt: Packet, xid: str, target: object) -> None:
        """A ``man`` request for a snapshot of a kind at a step (see the module doc)."""
        if not (
            isinstance(target, list)
            and len(target) == 2
            and target[0] in TARGET_KINDS
            and type(target[0]) is int
            and type(target[1]) is int
            and 0 <= target[1] <= _MAX_STEP
        ):
            return  # malformed: no answer, the client's stall timeout leaves us
        kind, step = target
        snap = next(
            (
                s
                for s in reversed(self.snapshots)
                if s.meta.get("k") == kind
                and type(s.meta.get("step")) is int
                and s.meta["step"] >= step
            ),
            None,
        )
        if snap is not None:
            self._send_manifest(pkt.src, xid, snap)
            return
        targets = self._targets[kind]
        targets.add(step)
        while len(targets) > MAX_TARGETS:
            targets.discard(max(targets))
        if self.on_wanted is not None:
            self.on_wanted()
        self.node.send(pkt.src, StateKind.DATA, {"op": "wait", "x": xid})

    def _send_manifest(self, dst: str, xid: str, snap: Snapshot) -> None:
        body = msgpack.packb({"d": snap.digests, "w": snap.whole, "m": snap.meta})
        fields = {"op": "man", "x": xid, "sid": snap.sid, "sz": len(snap.data)}
        fields["cb"] = snap.chunk_bytes
        self.node.send(dst, StateKind.DATA, fields, body)

    async def _serve(self, dst: str, xid: str, snap: Snapshot, first: int, stop: int) -> None:
        for c in range(first, stop):
            chunk = snap.chunk(c)
            fields = {"op": "chunk", "x": xid, "sid": snap.sid, "c": c, "dt": "u8", "n": len(chunk)}
            self.node.send(dst, StateKind.DATA, fields, chunk)
            self.served_chunks += 1
            if c % 16 == 15:
                await asyncio.sleep(0)  # let heartbeats and other peers' packets through
