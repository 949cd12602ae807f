"""Estimate bookkeeping of SPARQ-SGD: the sender's public estimate and the copies others hold.

Pure data structures (no I/O), as hivemind's ``TensorPartReducer``; the exchange
(:mod:`.exchange`) feeds them packets.

Why versions per block: a difference C(x_i - x_hat_i) spans several packets, one
per block, and loss takes single packets.  Each block of x_hat_i has a version
that every DELTA moves by one (``u -> u + 1``); a holder applies a DELTA only to
the version it was computed from, so a lost packet can never be half-applied or
applied twice: the block just stays behind, visibly (its version differs from the
one the sender's END lists).  The sender's :class:`OwnEstimate` is the canonical
x_hat_i, what every holder has once repaired: it keeps its last ``history``
DELTAs per block to replay to a holder a few versions behind, and refreshes the
block exactly (float32 segments) to one further behind or that never held it.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from gossipnet.collectives.sparq.codec import Layout, parse_delta, refresh_packets

__all__ = ("HeldEstimate", "OwnEstimate")

Packet = tuple[dict[str, Any], bytes]


class OwnEstimate:
    """The sender's x_hat_i: what its holders hold once every packet arrived.

    Args:
        start: the starting estimate (1-D float32, copied).
        layout: the vector's blocks.
        history: DELTAs kept per block for replay.
    """

    def __init__(self, start: torch.Tensor, layout: Layout, history: int) -> None:
        self.layout = layout
        self.vec = start.detach().to(torch.float32).clone()
        self.versions = np.zeros(layout.nblocks, dtype=np.int64)
        self._history: list[collections.deque[tuple[int, Packet]]] = [
            collections.deque(maxlen=history) for _ in range(layout.nblocks)
        ]

    def apply(self, fields: dict[str, Any], payload: bytes) -> None:
        """Add one of our own DELTA packets to x_hat_i, exactly as a holder does, and
        keep it for replay.  Why decode our own packet: the holders' float32
        arithmetic is then ours, bit for bit."""
        parsed = parse_delta(fields, payload, self.layout)
        if parsed is None:  # our own encoder made it: a bug, not a network fault
            raise RuntimeError(f"SparQ encoded an undecodable packet {fields}")
        b, u, offs, values = parsed
        lo, _ = self.layout.bounds(b)
        self.vec.index_add_(0, offs + lo, values)
        self._history[b].append((u, (fields, payload)))
        self.versions[b] = u + 1

    def repair(self, b: int, held: int, upto_round: int | None = None) -> tuple[str, list[Packet]]:
        """What brings a holder's block ``b`` from version ``held`` (-1: none) to ours.

        ``upto_round``: replay only DELTAs of rounds up to it (the round whose END the
        holder compared with): a newer DELTA is on its way already, and sent now it
        would enter the holder's mix of that round early.

        Returns:
            ``("replay", DELTAs)`` if our history reaches back to ``held``,
            ``("refresh", REFRESH segments)`` otherwise, ``("none", [])`` if it is current.
        """
        now = int(self.versions[b])
        if held == now:
            return "none", []
        kept = {u: pkt for u, pkt in self._history[b]}
        if 0 <= held < now and all(u in kept for u in range(held, now)):
            pkts = [kept[u] for u in range(held, now)]
            if upto_round is not None:
                pkts = [p for p in pkts if p[0]["r"] <= upto_round]
            return ("replay", pkts) if pkts else ("none", [])
        return "refresh", refresh_packets(self.vec, self.layout, b, now)


class HeldEstimate:
    """A holder's copy of a neighbour's x_hat_j, block by block.

    A block's version is -1 until a refresh made it whole (a copy starts unknown:
    nothing is assumed about a neighbour's start).
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.vec = torch.zeros(layout.numel, dtype=torch.float32)
        self.versions = np.full(layout.nblocks, -1, dtype=np.int64)
        # block -> (version being refreshed, segment offsets received)
        self._pending: dict[int, tuple[int, set[int]]] = {}

    @property
    def known(self) -> bool:
        """Every block was refreshed at least once (the copy is usable)."""
        return bool((self.versions >= 0).all())

    def apply_delta(self, b: int, base: int, offs: torch.Tensor, values: torch.Tensor) -> str:
        """Apply a parsed DELTA; ``"applied"``, ``"duplicate"`` (already past it) or
        ``"gap"`` (we are behind: the block waits for a repair)."""
        held = int(self.versions[b])
        if held == base:
            lo, _ = self.layout.bounds(b)
            self.vec.index_add_(0, offs + lo, values)
            self.versions[b] = base + 1
            return "applied"
        return "duplicate" if held > base else "gap"

    def apply_refresh(self, b: int, version: int, o: int, values: torch.Tensor) -> bool:
        """Write one REFRESH segment; True once block ``b`` is whole at ``version``."""
        if int(self.versions[b]) >= version:
            return False  # already there (a copy, or a refresh overtaken by deltas)
        pend = self._pending.get(b)
        if pend is None or pend[0] != version:
            if pend is not None and pend[0] > version:
                return False  # an older refresh arriving late
            pend = (version, set())
            self._pending[b] = pend
        lo, hi = self.layout.bounds(b)
        self.vec[lo + o : lo + o + values.numel()] = values
        self.versions[b] = -1  # partly overwritten: unusable for deltas until whole
        pend[1].add(o)
        if len(pend[1]) * self.layout.segment >= hi - lo:
            self.versions[b] = version
            del self._pending[b]
            return True
        return False

    def behind(self, remote: np.ndarray) -> np.ndarray:
        """Blocks whose version is not the sender's (``remote``: its END's list)."""
        return np.flatnonzero(self.versions != remote)
