"""The island control protocol, on the peer's event-loop thread (kinds 80-95).

Four small reliable messages, never tensor data (that goes through shared memory):

- ``ISLAND_INFO`` {h: host id, c: 1 for CUDA buffers, d: device, i: NVLink island
  label}: sent to every alive peer at the first island call and to peers that join
  later; a peer that receives one before it told the sender answers with its own.
- ``ISLAND_SHARE`` {key} + handles: a member gives its leader the shared buffers of one
  layout, once per (leader, layout).
- ``ISLAND_READY`` {r, key}: a member filled its buffer for its r-th island call.
- ``ISLAND_DONE`` {r, st, gr, ...}: the leader wrote the average into the member's
  buffer (``st`` = 0), or left it out of round r (``st`` > 0: keep your own values).

Every wait has a deadline on the node's clock and also ends when the peer waited for
is declared dead, so a member of a dead leader returns instead of hanging.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gossipnet.collectives.island.kinds import IslandKind
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("DONE_EXCLUDED", "DONE_OK", "IslandControl", "IslandInfo")

log = logging.getLogger(__name__)

DONE_OK = 0
DONE_EXCLUDED = 1  # late, unknown layout, unreadable buffers, or not our member
_MAX_SHARES = 256


@dataclass(frozen=True, slots=True)
class IslandInfo:
    """What a peer publishes: where its buffers live.

    ``label`` is the smallest GPU id of the NVLink component of the machine that holds
    ``device`` (-1: no island: no topology, no GPU, or GPUs this process cannot see);
    peers with equal (host, cuda, label) form one island.
    """

    host: str
    cuda: bool
    device: int
    label: int

    def fields(self) -> dict[str, Any]:
        return {"h": self.host, "c": int(self.cuda), "d": self.device, "i": self.label}

    @staticmethod
    def parse(f: Mapping[str, Any]) -> IslandInfo | None:
        h, c, d, i = f.get("h"), f.get("c"), f.get("d"), f.get("i")
        if not (isinstance(h, str) and len(h) <= 64 and c in (0, 1)):
            return None
        if not (isinstance(d, int) and isinstance(i, int) and -1 <= i < 4096 and d < 4096):
            return None
        return IslandInfo(h, bool(c), d, i)


class IslandControl:
    """Discovery and round signalling for one node; every method runs on the loop thread."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.me: IslandInfo | None = None
        self.infos: dict[str, IslandInfo] = {}
        self._told: set[str] = set()
        #: (member, layout key) -> its latest handle payload (leader side)
        self.shares: collections.OrderedDict[tuple[str, str], bytes] = collections.OrderedDict()
        self._ready: dict[str, tuple[int, str]] = {}  # member -> (its call number, key)
        self._done: dict[int, dict[str, Any]] = {}  # our call number -> the leader's DONE
        self._wake = asyncio.Event()
        node.subscribe(IslandKind.INFO, self._on_info)
        node.subscribe(IslandKind.SHARE, self._on_share)
        node.subscribe(IslandKind.READY, self._on_ready)
        node.subscribe(IslandKind.DONE, self._on_done)
        node.on_membership(self._on_membership)

    # ------------------------------------------------------------------ waiting
    async def _wait_until(self, done: Any, deadline: float) -> bool:
        """Wait until ``done()`` or the deadline; True when ``done()`` held."""
        clock = self.node.clock
        while not done():
            remaining = deadline - clock.now()
            if remaining <= 0 or self.node.closed:
                return False
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await self.node._wait_future(waiter, remaining)
            except TimeoutError:
                pass
            finally:
                waiter.cancel()
        return True

    def _alive(self, peer: str) -> bool:
        return peer in self.node.alive_peers()

    # ------------------------------------------------------------------ discovery
    async def discover(self, info: IslandInfo, wait_s: float) -> dict[str, IslandInfo]:
        """Publish ``info``; the infos of the alive peers (self included) known within
        ``wait_s``.  Peers not heard from by then are left out of the table."""
        if info != self.me:
            self.me = info
            self._told.clear()
        me = self.node.peer_id
        others = [p for p in self.node.alive_peers() if p != me]
        for p in others:
            self._tell(p)
        deadline = self.node.clock.now() + wait_s
        await self._wait_until(lambda: all(p in self.infos for p in others), deadline)
        table = {p: self.infos[p] for p in self.node.alive_peers() if p in self.infos}
        table[me] = info
        missing = [p for p in others if p not in table]
        if missing:
            log.warning("peer %s: no island info from %s; treated as absent", me, missing)
        return table

    def _tell(self, peer: str) -> None:
        if self.me is None or peer in self._told or self.node.closed:
            return
        self._told.add(peer)
        self.node.spawn(self._send_info(peer, self.me), "island-info")

    async def _send_info(self, peer: str, info: IslandInfo) -> None:
        if not await self.node.send_reliable(peer, IslandKind.INFO, info.fields()):
            self._told.discard(peer)

    def _on_info(self, pkt: Packet) -> None:
        info = IslandInfo.parse(pkt.fields)
        if info is None:
            self.node.codec.rejects["island_info"] += 1
            return
        self.infos[pkt.src] = info
        self._tell(pkt.src)  # answer a peer that announced before we told it
        self._wake.set()

    def _on_membership(self, event: str, peer: str) -> None:
        if event == "joined":
            self._told.discard(peer)
            self._tell(peer)
            return
        self.infos.pop(peer, None)
        self._told.discard(peer)
        self._ready.pop(peer, None)
        for key in [k for k in self.shares if k[0] == peer]:
            del self.shares[key]
        self._wake.set()

    # ------------------------------------------------------------------ member side
    async def share(self, leader: str, key: str, handles: bytes, timeout_s: float) -> bool:
        """Give ``leader`` our buffers of layout ``key``; True once it acknowledged."""
        fields = {"key": key}
        return await self.node.send_reliable(
            leader, IslandKind.SHARE, fields, handles, timeout_s=timeout_s
        )

    async def member_round(
        self, leader: str, key: str, r: int, deadline: float
    ) -> dict[str, Any] | None:
        """Signal READY for call ``r``; the leader's DONE fields, or None when the
        leader died or the deadline passed first."""
        for old in [k for k in self._done if k <= r]:
            del self._done[old]
        remaining = max(0.0, deadline - self.node.clock.now())
        fields = {"r": r, "key": key}
        self.node.spawn(
            self.node.send_reliable(leader, IslandKind.READY, fields, timeout_s=remaining),
            "island-ready",
        )
        await self._wait_until(lambda: r in self._done or not self._alive(leader), deadline)
        return self._done.pop(r, None)

    def _on_done(self, pkt: Packet) -> None:
        r = pkt.fields.get("r")
        if isinstance(r, int) and isinstance(pkt.fields.get("st"), int):
            self._done[r] = dict(pkt.fields, src=pkt.src)
            self._wake.set()

    # ------------------------------------------------------------------ leader side
    def _on_share(self, pkt: Packet) -> None:
        key = pkt.fields.get("key")
        if not isinstance(key, str) or len(key) > 64:
            self.node.codec.rejects["island_share"] += 1
            return
        self.shares[(pkt.src, key)] = bytes(pkt.payload)
        self.shares.move_to_end((pkt.src, key))
        while len(self.shares) > _MAX_SHARES:
            self.shares.popitem(last=False)

    def _on_ready(self, pkt: Packet) -> None:
        r, key = pkt.fields.get("r"), pkt.fields.get("key")
        if isinstance(r, int) and isinstance(key, str):
            self._ready[pkt.src] = (r, key)
            self._wake.set()

    async def collect(self, members: Iterable[str], key: str, deadline: float) -> dict[str, int]:
        """Wait for READY (layout ``key``) from ``members`` until the deadline or their
        death; member -> its call number.  READYs of others get an excluding DONE."""
        members = set(members)

        def ready() -> bool:
            return all(m in self._ready or not self._alive(m) for m in members)

        await self._wait_until(ready, deadline)
        got: dict[str, int] = {}
        for peer, (r, k) in list(self._ready.items()):
            del self._ready[peer]
            if peer in members and k == key:
                got[peer] = r
            else:
                self.release({peer: {"r": r, "st": DONE_EXCLUDED}})
        return got

    def release(self, done: Mapping[str, Mapping[str, Any]]) -> None:
        """Send each member its DONE (reliable, in the background)."""
        for peer, fields in done.items():
            self.node.spawn(
                self.node.send_reliable(peer, IslandKind.DONE, dict(fields)), "island-done"
            )

    async def release_acked(self, done: Mapping[str, Mapping[str, Any]], timeout_s: float) -> int:
        """Send each member its DONE and wait (bounded) for the acknowledgements, so a
        leader that exits right after a round still delivered it; how many acked."""
        sends = [
            self.node.send_reliable(p, IslandKind.DONE, dict(f), timeout_s=timeout_s)
            for p, f in done.items()
        ]
        return sum(await asyncio.gather(*sends))
