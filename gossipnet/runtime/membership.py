"""Who is alive: heartbeats, failure detection, departures.

A peer is *alive* once a packet under its own key arrived and no longer than
``failure_timeout_s`` ago.  Peers named only by someone else's view (or only
introduced, not yet heard under their key) are *known* (their address is
probed with HELLO) but not alive, so a stale view can never resurrect a dead
peer.  A LEAVE removes a peer at once; a newer epoch from the same id is a
restart and replaces the old incarnation.

Bounded: at most ``max_peers`` entries, of which at most :data:`MAX_UNVERIFIED`
were never heard under their own key; those are forgotten after
``2 x failure_timeout_s`` without an answer.  A member sending views full of
made-up ids costs a bounded number of probes, never a socket per id.

This module is pure bookkeeping over an injected clock: the node feeds it
arrivals and asks it who is dead, so it is tested without sockets.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ("Membership", "PeerInfo")

log = logging.getLogger(__name__)

MembershipCallback = Callable[[str, str], None]  # (event, peer_id); event in joined|left|died

#: Entries never heard under their own key (learned from views, probed) at most.
MAX_UNVERIFIED = 64


@dataclass(slots=True)
class PeerInfo:
    peer_id: str
    address: str
    epoch: int = 0
    last_seen: float = float("-inf")
    alive: bool = False
    verified: bool = False  # heard under its own key at least once


class Membership:
    """Alive view of one peer; every method runs on the loop thread."""

    def __init__(
        self, self_id: str, self_address: str, failure_timeout_s: float, max_peers: int = 512
    ) -> None:
        self.self_id = self_id
        self.self_address = self_address
        self.failure_timeout_s = failure_timeout_s
        self.max_peers = max_peers
        #: view entries not taken, by reason (``learned_full``: the bounds above)
        self.refused: collections.Counter[str] = collections.Counter()
        self._peers: dict[str, PeerInfo] = {}
        self._unverified: set[str] = set()  # ids of entries never heard under their key
        self._left: dict[str, int] = {}  # peer_id -> epoch that announced LEAVE
        self._callbacks: list[MembershipCallback] = []
        self._version = 0  # bumps on every change of the alive set

    @property
    def version(self) -> int:
        return self._version

    def on_change(self, callback: MembershipCallback) -> None:
        self._callbacks.append(callback)

    def off_change(self, callback: MembershipCallback) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def _emit(self, event: str, peer_id: str) -> None:
        self._version += 1
        log.info("peer %s: %s %s", self.self_id, event, peer_id)
        for cb in list(self._callbacks):
            try:
                cb(event, peer_id)
            except Exception:
                log.exception("membership callback failed for %s %s", event, peer_id)

    def heard_from(self, peer_id: str, epoch: int, address: str | None, now: float) -> None:
        """A packet from ``peer_id`` arrived directly (authenticated)."""
        if peer_id == self.self_id:
            return
        if self._left.get(peer_id, -1) >= epoch:
            return  # late packets of an incarnation that said goodbye
        info = self._peers.get(peer_id)
        if info is None:
            if address is None:
                return  # cannot talk back yet; its HELLO or heartbeat will carry the address
            info = PeerInfo(peer_id, address)
            self._peers[peer_id] = info
        if epoch < info.epoch:
            return
        if not info.verified:
            info.verified = True
            self._unverified.discard(peer_id)
        if address:
            info.address = address
        restarted = info.alive and epoch > info.epoch
        info.epoch = epoch
        info.last_seen = now
        if restarted:
            self._emit("died", peer_id)
            self._emit("joined", peer_id)
        elif not info.alive:
            info.alive = True
            self._emit("joined", peer_id)

    def learned(self, peer_id: str, address: str, now: float) -> bool:
        """Someone's view (or an undirected HELLO) names ``peer_id``; True if it is new
        to us (probe it).  Not alive until it answers; ``now`` counts as its last sign,
        so :meth:`prune` keeps probing it for a while instead of forgetting it (and
        closing the socket just opened to it) at the next heartbeat."""
        if peer_id == self.self_id or peer_id in self._left:
            return False
        if peer_id in self._peers:
            return False
        if (
            len(self._peers) + 1 >= self.max_peers
            or len(self._unverified) >= MAX_UNVERIFIED
        ):
            self.refused["learned_full"] += 1
            return False
        self._peers[peer_id] = PeerInfo(peer_id, address, last_seen=now)
        self._unverified.add(peer_id)
        return True

    def bound(self, peer_id: str, epoch: int, address: str, now: float) -> None:
        """``peer_id`` was just bound to the key of incarnation ``epoch`` (its
        introduction, from ``address``).

        A peer not alive is (re)probed there; an alive one keeps the address its
        own packets gave (an introduction is anyone's claim).  The admission that
        bound it already bounded the count.
        """
        if peer_id == self.self_id:
            return
        info = self._peers.get(peer_id)
        if info is None:
            self._peers[peer_id] = PeerInfo(peer_id, address, epoch, last_seen=now)
            self._unverified.add(peer_id)
        elif not info.alive:
            info.address = address
            info.epoch = max(info.epoch, epoch)
            info.last_seen = max(info.last_seen, now)

    def left_epoch(self, peer_id: str) -> int:
        """The incarnation of ``peer_id`` that announced LEAVE, or -1."""
        return self._left.get(peer_id, -1)

    def left(self, peer_id: str, epoch: int) -> None:
        """``peer_id`` announced its departure."""
        self._left[peer_id] = max(epoch, self._left.get(peer_id, -1))
        info = self._peers.pop(peer_id, None)
        self._unverified.discard(peer_id)
        if info is not None and info.alive:
            self._emit("left", peer_id)

    def expire(self, now: float) -> list[str]:
        """Declare peers silent for longer than the timeout dead; return them."""
        dead = [
            p.peer_id
            for p in self._peers.values()
            if p.alive and now - p.last_seen > self.failure_timeout_s
        ]
        for peer_id in dead:
            info = self._peers[peer_id]
            info.alive = False
            log.warning(
                "peer %s: nothing from %s for %.1f s (failure timeout %.1f s): declared"
                " dead", self.self_id, peer_id, now - info.last_seen, self.failure_timeout_s,
            )  # fmt: skip
            self._emit("died", peer_id)
        return dead

    def excuse(self, seconds: float, now: float) -> None:
        """Our own loop did not run for ``seconds`` (the process was stopped, swapped
        out or starved of CPU): that much of every alive peer's silence is ours.

        Why: packets that arrived meanwhile wait unread in the sockets, so measured
        silence would declare every peer dead at our first heartbeat after the stall,
        before those packets are read; we would then run rounds alone for a moment and
        carry what we learned alone back into the others' model.
        """
        for p in self._peers.values():
            if p.alive:
                p.last_seen = min(now, p.last_seen + seconds)

    def prune(self, now: float, forget_after_s: float) -> list[PeerInfo]:
        """Forget peers dead for longer than ``forget_after_s`` (never heard under their
        key: ``2 x failure_timeout_s``); return them.

        Until then a dead peer's address is still probed with HELLO, so a peer that
        restarts on the same address is found again; after it, its resources go.
        """
        unheard = 2 * self.failure_timeout_s
        gone = [
            p
            for p in self._peers.values()
            if not p.alive and now - p.last_seen > (forget_after_s if p.verified else unheard)
        ]
        for p in gone:
            del self._peers[p.peer_id]
            self._unverified.discard(p.peer_id)
        return gone

    def alive(self) -> list[str]:
        """Alive peers, sorted, this peer included."""
        ids = [p.peer_id for p in self._peers.values() if p.alive]
        ids.append(self.self_id)
        return sorted(ids)

    def address_of(self, peer_id: str) -> str | None:
        if peer_id == self.self_id:
            return self.self_address
        info = self._peers.get(peer_id)
        return info.address if info else None

    def known(self) -> list[PeerInfo]:
        return list(self._peers.values())

    def view(self) -> list[tuple[str, str]]:
        """(id, address) of alive peers and self, to share with others."""
        out = [(p.peer_id, p.address) for p in self._peers.values() if p.alive]
        out.append((self.self_id, self.self_address))
        return out

    def is_alive(self, peer_id: str) -> bool:
        if peer_id == self.self_id:
            return True
        info = self._peers.get(peer_id)
        return bool(info and info.alive)
