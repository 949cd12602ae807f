"""Route-aware gossip for training peers: ``strategy="route"`` without the peer wiring.

What a peer needs to train with RoADTrain-style gossip (a reconstruction, ALGORITHMS.md
section 4; the paper was not available):

1. :func:`plan_round`: from the routes every peer shares, the round's phases.  A pure
   function of shared inputs, so every peer derives the same schedule without talking.
2. :func:`partner_of` / :func:`round_mixing_matrix` / :func:`peer_mixing_row`: who a peer
   talks to in each phase, and the weights it applies (pairwise averages per phase, or
   Metropolis-Hastings over the round's union).  A failed exchange is skipped by *both*
   ends, so the weights stay doubly stochastic and the mean of the models is kept.
3. :class:`RouteGossip`: one peer's side of a round over a node (``send``,
   ``send_reliable``, ``subscribe``, ``clock``: the node contract of docs/INTERNALS.md,
   typed here as a protocol so this package never imports the transport).  Per phase
   the pair swaps chunks, then swaps *receipts* (bitmaps of the chunks that arrived,
   sent reliably) and averages exactly the chunks both ends got: the "skip at both
   ends" rule, chunk by chunk.
4. :func:`radio_link_faults`: per directed link, the loss and bandwidth the radio
   model predicts, as keyword arguments for a ``FaultPlan`` (built by the caller).

Packet kinds 64 and 65 (``KIND_DATA``, ``KIND_RECEIPT``) are the start of the wire
route protocol's 64-79 range (``gossipnet.collectives.route.kinds.RouteKind``).

Each phase is a matching, so its pairwise average is exactly one Metropolis-Hastings
step on that matching (every degree is 1: ``W_ij = 1/(1 + max(1, 1)) = 1/2``,
:func:`.mixing.matching_matrix`); a round applies the phases' MH steps in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from gossipnet.mobility.mixing import matching_matrix, metropolis_weights
from gossipnet.mobility.radio import RadioModel, link_table
from gossipnet.mobility.routes import Route, positions
from gossipnet.mobility.schedule import Schedule, ScheduleConfig, plan_schedule
from gossipnet.reports import CollectiveReport

__all__ = (
    "KIND_DATA",
    "KIND_RECEIPT",
    "GossipNode",
    "RouteGossip",
    "partner_of",
    "peer_mixing_row",
    "plan_round",
    "radio_link_faults",
    "round_mixing_matrix",
)

log = logging.getLogger(__name__)

KIND_DATA = 64
KIND_RECEIPT = 65
_MAX_NUMEL = 1 << 31  # elements a partner's packet may announce (float32: 8 GiB)

FloatArray = np.ndarray
BoolArray = np.ndarray


def plan_round(
    routes: Sequence[Route],
    t0_s: float,
    model_bytes: float,
    *,
    radio: RadioModel | None = None,
    schedule: ScheduleConfig | None = None,
    dt_s: float = 0.25,
) -> Schedule:
    """The phases of the round that starts at ``t0_s`` (shared time), peers by route index.

    Args:
        routes: every peer's announced route, in peer order (the same on all peers).
        t0_s: round start on the routes' time axis.
        model_bytes: bytes of one model on the air; an exchange moves it both ways.
        radio, schedule: the radio model and the per-round budget (defaults if None).
        dt_s: sampling step of the look-ahead.
    """
    radio = radio or RadioModel()
    schedule = schedule or ScheduleConfig()
    grid = t0_s + dt_s * np.arange(int(np.ceil(schedule.budget_s / dt_s)) + 1)
    table = link_table(positions(list(routes), grid), radio, 2.0 * model_bytes, dt_s)
    return plan_schedule(table, schedule)


def partner_of(schedule: Schedule, peer: int) -> list[int | None]:
    """Per phase, the peer that ``peer`` exchanges with (None: it sits that phase out)."""
    out: list[int | None] = []
    for phase in schedule.phases:
        row = np.flatnonzero((phase.edges == peer).any(axis=1))
        out.append(int(phase.edges[row[0]].sum() - peer) if row.size else None)
    return out


def round_mixing_matrix(
    schedule: Schedule, delivered: Sequence[BoolArray], *, mode: str = "sequential"
) -> FloatArray:
    """The round's mixing matrix W (x_new = W x) given each phase's delivered links.

    ``mode="sequential"``: the phases' pairwise averages one after another (what
    :class:`RouteGossip` does).  ``mode="metropolis"``: one Metropolis-Hastings step
    on the union of the planned phases, failed links skipped at both ends.  Either
    way W is doubly stochastic, whatever failed.
    """
    n = schedule.n
    if len(delivered) != len(schedule.phases):
        raise ValueError(f"need one delivered mask per phase ({len(schedule.phases)})")
    if mode == "metropolis":
        if not schedule.phases:
            return np.eye(n)
        edges = np.concatenate([p.edges for p in schedule.phases])
        return metropolis_weights(n, edges, np.concatenate([np.asarray(d) for d in delivered]))
    if mode != "sequential":
        raise ValueError(f"mode must be 'sequential' or 'metropolis', got {mode!r}")
    mix = np.eye(n)
    for phase, ok in zip(schedule.phases, delivered, strict=True):
        mix = matching_matrix(n, phase.edges, ok) @ mix
    return mix


def peer_mixing_row(
    schedule: Schedule, peer: int, delivered: Sequence[BoolArray], *, mode: str = "metropolis"
) -> dict[int, float]:
    """The weights ``peer`` applies to round-start models: ``{peer_index: weight}``.

    Nonzero entries only; they sum to 1.  With ``mode="metropolis"`` a peer needs only
    its own links' outcomes (and the planned degrees, known from the schedule).
    """
    row = round_mixing_matrix(schedule, delivered, mode=mode)[peer]
    return {int(j): float(row[j]) for j in np.flatnonzero(row)}


def radio_link_faults(
    names: Sequence[str], where_m: FloatArray, radio: RadioModel | None = None
) -> dict[tuple[str, str], dict[str, float]]:
    """Per directed link, ``FaultPlan`` keyword arguments from the radio model.

    ``loss`` is the per-packet loss at the link's distance (1 beyond range) and
    ``bandwidth_bytes_per_s`` its Shannon rate (omitted beyond range).  A caller does
    ``FaultPlan(seed=s, links={k: FaultPlan(**v) for k, v in faults.items()})``.

    Args:
        names: link names (transport addresses) in peer order.
        where_m: (n, 2) positions in metres at the moment the plan stands for.
    """
    radio = radio or RadioModel()
    pos = np.asarray(where_m, dtype=np.float64)
    dist = np.linalg.norm(pos[:, None, :] - pos[None, :, :], axis=-1)
    loss = 1.0 - radio.delivery(dist)
    rate = radio.rate_bytes_per_s(dist)
    out: dict[tuple[str, str], dict[str, float]] = {}
    for i, src in enumerate(names):
        for j, dst in enumerate(names):
            if i != j:
                kw = {"loss": float(np.clip(loss[i, j], 0.0, 1.0))}
                if rate[i, j] > 0:
                    kw["bandwidth_bytes_per_s"] = float(rate[i, j])
                out[(src, dst)] = kw
    return out


class GossipNode(Protocol):
    """The part of ``gossipnet.runtime.node.Node`` that route gossip uses (docs/INTERNALS.md)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def clock(self) -> Any: ...

    def send(
        self, peer_id: str, kind: int, fields: Mapping[str, Any] | None = None, payload: Any = b""
    ) -> bool: ...

    def send_reliable(
        self,
        peer_id: str,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Any = b"",
        *,
        timeout_s: float | None = None,
    ) -> Awaitable[bool]: ...

    def subscribe(self, kind: int, handler: Callable[[Any], None]) -> None: ...

    def unsubscribe(self, kind: int) -> None: ...


@dataclass(slots=True)
class _Inbox:
    """What arrived from the partner in one (round, phase)."""

    data: np.ndarray
    got: np.ndarray
    receipt: np.ndarray | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class RouteGossip:
    """One peer's side of route-aware gossip rounds over a node.

    Args:
        node: a started node (loop thread only; every method runs on it).
        names: peer ids in schedule order; ``names.index(node.peer_id)`` is this peer.
        numel: elements of the flat model, if known now.  Otherwise it is learned from
            the first data packet (each carries the model's length), so packets of a
            partner that starts a round before this peer does are kept, not dropped.
        chunk_bytes: payload bytes per data packet (a multiple of 4).
        phase_slack: a phase may wait this fraction past its planned duration for the
            partner's data, and never past the planned timeline stretched as much
            (``(start_s + duration_s) * (1 + phase_slack)`` after the round started
            here), so a peer that fell behind catches up instead of cascading.
        receipt_timeout_s: how long the reliable receipt exchange may take beyond the
            partner's longest data wait (``duration_s * (1 + phase_slack)``).
        kinds: the packet kinds for (data, receipts); the wire module may assign its own.
    """

    def __init__(
        self,
        node: GossipNode,
        names: Sequence[str],
        *,
        numel: int = 0,
        chunk_bytes: int = 1024,
        phase_slack: float = 0.5,
        receipt_timeout_s: float = 1.0,
        kinds: tuple[int, int] = (KIND_DATA, KIND_RECEIPT),
    ) -> None:
        if chunk_bytes < 4 or chunk_bytes % 4:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4, got {chunk_bytes}")
        self.node, self.names = node, list(names)
        self.me = self.names.index(node.peer_id)
        self.chunk = chunk_bytes // 4
        self.phase_slack, self.receipt_timeout_s = phase_slack, receipt_timeout_s
        self._inbox: dict[tuple[int, int, str], _Inbox] = {}
        self._numel = int(numel)
        self.kind_data, self.kind_receipt = kinds
        node.subscribe(self.kind_data, self._on_data)
        node.subscribe(self.kind_receipt, self._on_receipt)

    def set_names(self, names: Sequence[str]) -> None:
        """Peer ids in schedule order for the next rounds (participants change)."""
        self.names = list(names)
        self.me = self.names.index(self.node.peer_id)

    def close(self) -> None:
        self.node.unsubscribe(self.kind_data)
        self.node.unsubscribe(self.kind_receipt)

    def _box(self, rnd: int, phase: int, src: str) -> _Inbox:
        key = (rnd, phase, src)
        if key not in self._inbox:
            nchunks = -(-self._numel // self.chunk)
            self._inbox[key] = _Inbox(np.zeros(self._numel, np.float32), np.zeros(nchunks, bool))
        return self._inbox[key]

    def _on_data(self, pkt: Any) -> None:
        f = pkt.fields
        rnd, phase, k, numel = f.get("r"), f.get("p"), f.get("c"), f.get("N")
        if not all(isinstance(v, int) for v in (rnd, phase, k, numel)):
            return
        if self._numel == 0 and 0 < numel <= _MAX_NUMEL:
            self._numel = numel  # a partner started first: keep its packets
        if numel != self._numel:
            return  # a different model size (misuse) or nothing known yet
        box = self._box(rnd, phase, pkt.src)
        lo = k * self.chunk
        part = np.frombuffer(pkt.payload, dtype=np.float32)
        if 0 <= k < len(box.got) and len(part) == min(self.chunk, self._numel - lo):
            box.data[lo : lo + len(part)] = part
            box.got[k] = True
            if box.got.all():
                box.wake.set()

    def _on_receipt(self, pkt: Any) -> None:
        rnd, phase = pkt.fields.get("r"), pkt.fields.get("p")
        if isinstance(rnd, int) and isinstance(phase, int) and self._numel:
            box = self._box(rnd, phase, pkt.src)
            bits = np.unpackbits(np.frombuffer(pkt.payload, np.uint8))[: len(box.got)]
            box.receipt = bits.astype(bool)
            box.wake.set()

    async def _wait(self, box: _Inbox, done: Callable[[], bool], timeout_s: float) -> None:
        """Wait until ``done()`` or ``timeout_s`` on the node's clock."""
        clock, deadline = self.node.clock, self.node.clock.now() + timeout_s
        while not done() and clock.now() < deadline:
            box.wake.clear()
            sleeper = asyncio.ensure_future(clock.sleep(deadline - clock.now()))
            waker = asyncio.ensure_future(box.wake.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waker.cancel()

    async def run_round(self, rnd: int, flat: torch.Tensor, schedule: Schedule) -> CollectiveReport:
        """Exchange and average ``flat`` (1-D float32, in place) along ``schedule``.

        Every peer calls this with the same ``rnd`` and schedule.  Network failure is
        reported, never raised: a chunk that did not arrive at both ends is kept.
        """
        if flat.dtype != torch.float32 or flat.dim() != 1:
            raise ValueError("route gossip needs a 1-D float32 tensor")
        x = flat.detach().numpy()
        self._numel = x.size
        for key in [k for k, b in self._inbox.items() if b.data.size != x.size]:
            del self._inbox[key]  # made for another model size
        nchunks = -(-x.size // self.chunk)
        clock, start = self.node.clock, self.node.clock.now()
        rep = CollectiveReport(round=rnd, method="route", chunks_total=nchunks)
        partners, heard = [], []
        for p, (phase, peer) in enumerate(
            zip(schedule.phases, partner_of(schedule, self.me), strict=True)
        ):
            if peer is None:
                continue
            other = self.names[peer]
            partners.append(other)
            stretch = 1.0 + self.phase_slack
            until = start + (phase.start_s + phase.duration_s) * stretch
            limit = min(until - clock.now(), phase.duration_s * stretch)
            mine, receipt = await self._exchange(rnd, p, other, x, limit, phase.duration_s)
            both = mine & receipt if receipt is not None else np.zeros_like(mine)
            for k in np.flatnonzero(both):
                sl = slice(k * self.chunk, (k + 1) * self.chunk)
                x[sl] = 0.5 * (x[sl] + self._inbox[(rnd, p, other)].data[sl])
            del self._inbox[(rnd, p, other)]
            if mine.any():
                heard.append(other)
            rep.timed_out |= not mine.all()
            rep.packets_sent += nchunks
            rep.packets_received += int(mine.sum())
            rep.packets_lost += int(nchunks - mine.sum())
            rep.chunks_stale += int(nchunks - both.sum())
            if receipt is None:
                rep.extra["receipts_lost"] = rep.extra.get("receipts_lost", 0.0) + 1.0
        for key in [k for k in self._inbox if k[0] <= rnd]:
            del self._inbox[key]  # stragglers of this or older rounds
        rep.participants = tuple(sorted({self.node.peer_id, *partners}))
        rep.contributors = tuple(sorted({self.node.peer_id, *heard}))
        rep.missing = tuple(sorted(set(partners) - set(heard)))
        expected = rep.packets_received + rep.packets_lost
        rep.delivered_fraction = rep.packets_received / expected if expected else 1.0
        rep.elapsed_s = clock.now() - start
        log.debug("peer %s round %d: route gossip %s", self.node.peer_id, rnd, rep)
        return rep

    def round_bound_s(self, schedule: Schedule) -> float:
        """Longest a :meth:`run_round` on ``schedule`` can take here (seconds)."""
        stretch = 1.0 + self.phase_slack
        mine = [
            schedule.phases[p].duration_s
            for p, peer in enumerate(partner_of(schedule, self.me))
            if peer is not None
        ]
        return sum(2.0 * d * stretch + self.receipt_timeout_s for d in mine)

    async def _exchange(
        self, rnd: int, p: int, other: str, x: np.ndarray, limit_s: float, duration_s: float
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One phase with ``other``: swap chunks (wait at most ``limit_s``), then receipts.

        Our receipt wait covers the partner's longest data wait (it may have entered
        the phase later, or be waiting for chunks that were lost): giving up sooner
        would let it average what we then do not, and the mean would drift.

        Returns (chunks of ``other`` that arrived, as reported in our receipt;
        ``other``'s receipt of ours, or None if it never came).
        """
        box = self._box(rnd, p, other)
        nchunks = len(box.got)
        for k in range(nchunks):  # the whole model, chunk by chunk
            payload = x[k * self.chunk : (k + 1) * self.chunk].tobytes()
            fields = {"r": rnd, "p": p, "c": k, "N": x.size}
            self.node.send(other, self.kind_data, fields, payload)
        await self._wait(box, lambda: bool(box.got.all()), max(limit_s, 0.0))
        mine = box.got.copy()  # what our receipt says; later arrivals must not count
        sent = asyncio.ensure_future(
            self.node.send_reliable(
                other,
                self.kind_receipt,
                {"r": rnd, "p": p},
                np.packbits(mine).tobytes(),
                timeout_s=self.receipt_timeout_s,
            )
        )
        patience = self.receipt_timeout_s + duration_s * (1.0 + self.phase_slack)
        await self._wait(box, lambda: box.receipt is not None, patience)
        await sent
        return mine, box.receipt
