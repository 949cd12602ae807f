"""The serving side of state transfer: snapshots, manifests and chunks on request.

Split from :mod:`.sync` (the protocol is described there): the trainer publishes
snapshots (``publish`` / ``install``); a peer's ``man`` request is answered with
the latest snapshot's manifest, or ``wait`` when it is older than the client
accepts (which raises :attr:`StateServer.wanted`, so the trainer publishes a
fresh one); a ``get`` request with a run of chunks, each in its own packet.
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

_KEEP_SNAPSHOTS = 2  # the current one and the one before, for transfers in flight


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
        node.subscribe(StateKind.REQ, self._on_req)

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
        large state there would stall heartbeats)."""
        self.snapshots = [*self.snapshots[-(_KEEP_SNAPSHOTS - 1) :], snap]
        self.wanted = False

    def _find(self, sid: object) -> Snapshot | None:
        return next((s for s in self.snapshots if s.sid == sid), None)

    def _on_req(self, pkt: Packet) -> None:
        op, xid = pkt.fields.get("op"), pkt.fields.get("x")
        if not isinstance(xid, str):
            return
        if op == "man":
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
            body = msgpack.packb({"d": snap.digests, "w": snap.whole, "m": snap.meta})
            fields = {"op": "man", "x": xid, "sid": snap.sid, "sz": len(snap.data)}
            fields["cb"] = snap.chunk_bytes
            self.node.send(pkt.src, StateKind.DATA, fields, body)
        elif op == "get":
            snap = self._find(pkt.fields.get("sid"))
            c, n = pkt.fields.get("c"), pkt.fields.get("n")
            if snap is None:
                self.node.send(pkt.src, StateKind.DATA, {"op": "gone", "x": xid})
            elif type(c) is int and type(n) is int and c >= 0 and 0 < n <= 4 * self.window:
                stop = min(c + n, snap.nchunks)
                self.node.spawn(self._serve(pkt.src, xid, snap, c, stop), "state-serve")

    async def _serve(self, dst: str, xid: str, snap: Snapshot, first: int, stop: int) -> None:
        for c in range(first, stop):
            chunk = snap.chunk(c)
            fields = {"op": "chunk", "x": xid, "sid": snap.sid, "c": c, "dt": "u8", "n": len(chunk)}
            self.node.send(dst, StateKind.DATA, fields, chunk)
            self.served_chunks += 1
            if c % 16 == 15:
                await asyncio.sleep(0)  # let heartbeats and other peers' packets through
