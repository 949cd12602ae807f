"""SPARQ-SGD's network part: send C(x - x_hat), keep neighbours' estimates, repair them.

One :class:`SparqExchange` per peer and model layout, on the node's loop thread.  A
round (:meth:`SparqExchange.round`):

1. if the caller's event trigger fired, compress ``x - x_hat_i`` (:mod:`.codec`), add
   it to our own estimate and send its DELTAs to this round's neighbours;
2. send END (twice: it is small) with our version of every block, triggered or not,
   and the latest round of the receiver's END we hold;
3. wait for every neighbour's END of this round (deadline: ``timeout_s``), sending
   ours again every ``control_retry_s`` to those not heard, and at once to one whose
   END says it lacks ours (it was lost, or arrived before it listened); a holder
   whose copy differs from an END's versions asks for those blocks (NACK); the
   sender replays the DELTAs it still keeps or refreshes the block exactly;
   then wait up to ``repair_wait_s`` for the copies to match;
4. return ``sum_j w_ij (x_hat_j - x_hat_i)`` over the neighbours whose copy is usable,
   computed here on the loop thread; DELTAs and ENDs of a later round that arrive
   before we mixed wait until we did (:meth:`SparqExchange._park`), so every peer
   mixes what the round's ENDs list and a lossless run replays exactly.

Resync under loss, the rule: a holder never guesses.  A copy's block moves only by a
DELTA computed from exactly the version it holds, or by an exact refresh; every END
lists the sender's versions, so a holder sees any gap at the next END it receives
(from any later round) and asks.  Hence a copy converges back to the sender's
x_hat_i one round-trip after loss stops (or after the neighbours meet again).
Packets of forged or malformed content are dropped and counted in :attr:`drops`,
never raised; authentication is the wire codec's, as for every packet.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gossipnet.collectives.sparq import codec
from gossipnet.collectives.sparq.config import SparQ
from gossipnet.collectives.sparq.estimates import HeldEstimate, OwnEstimate
from gossipnet.collectives.sparq.kinds import SparqKind
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("RoundOutcome", "SparqExchange")

log = logging.getLogger(__name__)

_NONE = -2  # "no END heard": below the introduction round (-1)


@dataclass(slots=True)
class RoundOutcome:
    """What one round did: the mixing term and the counts the report carries."""

    mix: torch.Tensor
    triggered: bool
    bytes_sent: int = 0
    delta_packets: int = 0
    heard: tuple[str, ...] = ()
    mixed: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()
    timed_out: bool = False
    counters: dict[str, float] = field(default_factory=dict)


class SparqExchange:
    """SPARQ gossip of one flat float32 vector of ``layout.numel`` elements.

    Args:
        node: the started node (loop thread only).
        layout: the vector's blocks (the same on every peer: a peer whose END
            describes another vector is dropped as ``layout``).
        settings: the user's :class:`SparQ`.
        start: our starting x (1-D float32): our estimate starts as it, and holders
            get it by an exact refresh on first contact.
    """

    def __init__(self, node: Node, layout: codec.Layout, settings: SparQ, start: torch.Tensor):
        self.node = node
        self.layout = layout
        self.settings = settings
        self.own = OwnEstimate(start, layout, settings.history)
        self.held: dict[str, HeldEstimate] = {}
        #: per neighbour: (latest round whose END arrived, its block versions)
        self.ends: dict[str, tuple[int, np.ndarray]] = {}
        #: malformed or unusable packets, by reason (never raised)
        self.drops: collections.Counter[str] = collections.Counter()
        #: resync work: gaps seen, NACKs sent/answered, blocks replayed/refreshed
        self.resync: collections.Counter[str] = collections.Counter()
        self.bytes_sent = 0  # every SparQ packet this exchange sent, frames included
        self._epochs: dict[str, int] = {}  # the wire epoch of each copy's sender
        self._round_now: int | None = None  # the round being mixed (None: between rounds)
        self._last_end: tuple[int, int] | None = None  # (round, triggered) of our latest END
        self._parked: list[Packet] = []  # later rounds' DELTAs and ENDs, until we mixed
        self._wake = asyncio.Event()
        handlers = {
            SparqKind.DELTA: self._on_delta,
            SparqKind.END: self._on_end,
            SparqKind.NACK: self._on_nack,
            SparqKind.REFRESH: self._on_refresh,
        }
        for kind, handler in handlers.items():
            node.subscribe(kind, handler)

    def close(self) -> None:
        for kind in SparqKind:
            self.node.unsubscribe(kind)

    # ------------------------------------------------------------------ sending
    def _send(
        self, peers: Sequence[str], kind: SparqKind, fields: dict[str, Any], payload: bytes
    ) -> int:
        if not peers:
            return 0
        frames = self.node.encode_for(list(peers), kind, fields, payload)
        sent = self.node.send_frames(list(peers), frames)
        nbytes = sent * sum(len(f) for f in frames)
        self.bytes_sent += nbytes
        return nbytes

    async def round(
        self,
        rnd: int,
        x: torch.Tensor,
        weights: Mapping[str, float],
        *,
        trigger: bool,
        timeout_s: float,
    ) -> RoundOutcome:
        """One SPARQ round with the neighbours in ``weights`` (peer -> w_ij); see module."""
        peers = sorted(p for p in weights if p != self.node.peer_id)
        sent0 = self.bytes_sent
        n_delta = 0
        if trigger:
            comp = codec.compress(x - self.own.vec, self.layout)
            for _, fields, payload in codec.delta_packets(
                comp, self.layout, self.own.versions, rnd
            ):
                self.own.apply(fields, payload)
                self._send(peers, SparqKind.DELTA, fields, payload)
                n_delta += 1
        self._last_end = (rnd, int(trigger))
        self._round_now = rnd  # a faster neighbour's next round waits until we mixed
        try:
            for _ in range(2):
                self._send_end(peers)
            timed_out = not await self._await_ends(peers, rnd, timeout_s)
            await self._await_repairs(peers, rnd)
            mix, mixed, stale = self._mix(peers, weights)
            heard = tuple(p for p in peers if self.ends.get(p, (_NONE,))[0] >= rnd)
        finally:
            self._round_now = None
            self._unpark()
        return RoundOutcome(
            mix=mix,
            triggered=trigger,
            bytes_sent=self.bytes_sent - sent0,
            delta_packets=n_delta,
            heard=heard,
            mixed=mixed,
            stale=stale,
            timed_out=timed_out,
            counters={**{f"drop_{k}": float(v) for k, v in self.drops.items()},
                      **{f"resync_{k}": float(v) for k, v in self.resync.items()}},
        )  # fmt: skip

    def _mix(
        self, peers: Sequence[str], weights: Mapping[str, float]
    ) -> tuple[torch.Tensor, tuple[str, ...], tuple[str, ...]]:
        """``sum_j w_ij (x_hat_j - x_hat_i)`` over the usable copies; those used, and
        those of them still behind the neighbour's latest END."""
        mix = torch.zeros(self.layout.numel, dtype=torch.float32)
        mixed, stale = [], []
        for p in peers:
            held = self.held.get(p)
            if held is None or not held.known:
                continue  # nothing usable yet: its weight stays with us this round
            mix.add_(held.vec - self.own.vec, alpha=float(weights[p]))
            mixed.append(p)
            if not self._current([p]):
                stale.append(p)
        return mix, tuple(mixed), tuple(stale)

    def _park(self, pkt: Packet) -> bool:
        """Hold a DELTA or END of a round after the one we are mixing (True: held).

        Why: a neighbour that finished the round first may already send the next
        one; applied now, it would enter this round's mix on some peers and not on
        others, by timing.  Held, every peer mixes exactly what the round's ENDs
        list, and lossless runs replay bit for bit.  The payload is copied (the
        transport's buffer is not ours to keep); past a bound, packets are dropped
        and counted (the next END's versions get them repaired).
        """
        r = pkt.fields.get("r")
        if self._round_now is None or type(r) is not int or r <= self._round_now:
            return False
        if len(self._parked) >= 4 * self.layout.nblocks + 16:
            self.drops["parked_overflow"] += 1
            return True
        self._parked.append(dataclasses.replace(pkt, payload=memoryview(bytes(pkt.payload))))
        return True

    def _unpark(self) -> None:
        parked, self._parked = self._parked, []
        for pkt in parked:
            (self._on_delta if pkt.kind == SparqKind.DELTA else self._on_end)(pkt)

    def _send_end(self, peers: Sequence[str]) -> None:
        """Our latest END to each of ``peers``, each told which of its ENDs we hold."""
        if self._last_end is None:
            return
        rnd, trig = self._last_end
        payload = codec.end_payload(self.own.versions)
        for p in peers:
            heard = self.ends.get(p, (_NONE,))[0]
            fields = {"r": rnd, "t": trig, "h": heard, "d": self.layout.numel}
            self._send([p], SparqKind.END, fields, payload)

    async def _await_ends(self, peers: Sequence[str], rnd: int, timeout_s: float) -> bool:
        """Wait for every neighbour's END of ``rnd``; every ``Config.control_retry_s``
        send ours again to those not heard (their copies were lost, or they were not
        listening yet).  False at the deadline."""
        clock = self.node.clock
        deadline = clock.now() + timeout_s
        retry = self.node.config.control_retry_s
        while True:
            left = deadline - clock.now()
            if await self._wait(lambda: self._ended(peers, rnd), min(retry, max(left, 0.0))):
                return True
            if left <= retry:
                return False
            self._send_end([p for p in peers if self.ends.get(p, (_NONE,))[0] < rnd])

    async def _await_repairs(self, peers: Sequence[str], rnd: int) -> None:
        """Wait up to ``repair_wait_s`` for our copies to match the neighbours' ENDs,
        asking again every ``Config.control_retry_s`` (a NACK or a repair can be lost
        too; a duplicate answer is dropped by version)."""
        clock = self.node.clock
        deadline = clock.now() + self.settings.repair_wait_s
        retry = self.node.config.control_retry_s
        heard = [p for p in peers if self.ends.get(p, (_NONE,))[0] >= rnd]
        while not self._current(heard):
            left = deadline - clock.now()
            if left <= 0 or await self._wait(lambda: self._current(heard), min(retry, left)):
                return
            for p in heard:
                self._nack(p, rnd, retry=True)

    def _nack(self, src: str, rnd: int, *, retry: bool = False) -> None:
        """Ask ``src`` for the blocks our copy lacks against its latest END."""
        end, held = self.ends.get(src), self.held.get(src)
        if end is None or held is None:
            return
        behind = held.behind(end[1])
        if behind.size:
            self.resync["nacks_resent" if retry else "nacks_sent"] += 1
            payload = codec.nack_payload(behind, held.versions[behind])
            self._send([src], SparqKind.NACK, {"r": rnd}, payload)

    def _ended(self, peers: Sequence[str], rnd: int) -> bool:
        return all(self.ends.get(p, (_NONE,))[0] >= rnd for p in peers)

    def _current(self, peers: Sequence[str]) -> bool:
        """Our copies of ``peers`` match the versions their latest END listed."""
        for p in peers:
            end, held = self.ends.get(p), self.held.get(p)
            if end is None or held is None or held.behind(end[1]).size:
                return False
        return True

    async def _wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (on the node's clock) until ``done()``; False at the deadline."""
        clock = self.node.clock
        deadline = clock.now() + timeout_s
        while not done():
            left = deadline - clock.now()
            if left <= 0 or self.node.closed:
                return False
            self._wake.clear()
            sleeper = asyncio.ensure_future(clock.sleep(left))
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waker.cancel()
        return True

    # ------------------------------------------------------------------ receiving
    def _copy_of(self, pkt: Packet) -> HeldEstimate:
        """Our copy of ``pkt.src``'s estimate; a fresh one if the sender restarted
        (a new wire epoch: its versions began again at 0, ours would never match)."""
        held, src = self.held.get(pkt.src), pkt.src
        if held is None or self._epochs.get(src) != pkt.epoch:
            if held is not None:
                self.resync["restarts"] += 1
                self.ends.pop(src, None)
            held = self.held[src] = HeldEstimate(self.layout)
            self._epochs[src] = pkt.epoch
        return held

    def _on_delta(self, pkt: Packet) -> None:
        if self._park(pkt):
            return
        parsed = codec.parse_delta(pkt.fields, pkt.payload, self.layout)
        if parsed is None:
            self.drops["delta"] += 1
            return
        outcome = self._copy_of(pkt).apply_delta(*parsed)
        if outcome != "applied":
            self.resync[outcome] += 1
        self._wake.set()

    def _on_refresh(self, pkt: Packet) -> None:
        parsed = codec.parse_refresh(pkt.fields, pkt.payload, self.layout)
        if parsed is None:
            self.drops["refresh"] += 1
            return
        if self._copy_of(pkt).apply_refresh(*parsed):
            self.resync["blocks_refreshed_in"] += 1
        self._wake.set()

    def _on_end(self, pkt: Packet) -> None:
        if self._park(pkt):
            return
        parsed = codec.parse_end(pkt.fields, pkt.payload, self.layout)
        if parsed is None:
            self.drops["end"] += 1
            return
        rnd, _, heard, versions = parsed
        self._copy_of(pkt)  # a restarted sender: a fresh copy
        if rnd < self.ends.get(pkt.src, (_NONE,))[0]:
            self.drops["end_old"] += 1  # an END overtaken by a later one: nothing new
            return
        first = rnd > self.ends.get(pkt.src, (_NONE,))[0]
        self.ends[pkt.src] = (rnd, versions)
        if first:  # ask once per END (the second copy); the round's wait asks again
            self._nack(pkt.src, rnd)
        if self._last_end is not None and heard < min(rnd, self._last_end[0]):
            self.resync["ends_resent"] += 1  # it waits for an END of ours it never got
            self._send_end([pkt.src])
        self._wake.set()

    def _on_nack(self, pkt: Packet) -> None:
        asked = codec.parse_nack(pkt.payload, self.layout)
        upto = pkt.fields.get("r")
        if asked is None or type(upto) is not int or upto < -1:
            self.drops["nack"] += 1
            return
        self.resync["nacks_answered"] += 1
        for b, held in asked:
            how, packets = self.own.repair(b, held, upto)
            if how == "none":
                continue
            self.resync[f"blocks_{how}"] += 1
            kind = SparqKind.DELTA if how == "replay" else SparqKind.REFRESH
            for fields, payload in packets:
                self._send([pkt.src], kind, fields, payload)
