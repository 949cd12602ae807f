"""How many rounds each sparse value stands for, and the owner's selection weights.

Why: with error feedback an element that leaves in round ``t`` after it last
left in round ``t - k`` carries the sum of ``k`` rounds of gradient.  An
optimizer that takes that sum as one round's gradient (Adam, whose second
moment then sees one ``k``-fold value and ``k - 1`` zeros) moves the element
about ``sqrt(k)`` times less than the dense run would have.  Measured
(``bench/topk_sim.py``, demo task, density 0.1, AdamW): perplexity 12.70
against dense 8.66.  The optimizer can undo it only if it knows ``k``, per
element: :class:`Staleness` keeps, per bucket, the round in which each element
last travelled, and gives the owner the ages of the elements in this round's
set (``0`` for elements not in it).

Every peer marks the elements it sent (as a sender, at the set the owner
announced) and those of its own chunks' sets (as the owner), so a peer that
becomes a chunk's owner after a membership change already knows most ages;
an age it cannot know (never sent, another layout) counts from the session's
start, and :data:`MAX_AGE` bounds it.  The owner's broadcast carries its
blocks' ages (one byte each), so every peer that steps the whole model
(``all_reduce(..., step=opt)``) steps with the owner's ages: a peer that
missed an earlier broadcast does not drift.

Selection weights: ARC-Top-K's owner picks the next set by the summed block
energies of ``e + g``.  An Adam-type optimizer scales each element's step by
``1 / sqrt(v)``, so the blocks whose *step* would be largest are those of
largest ``sum(u^2 / v)``: weighting each block's energy by its mean ``1 / v``
lets small but steady gradients take their turn, as Adam would give it.
Elements never stepped have ``v = 0`` and the largest weight, so every block is
visited.  Measured without a network, sets chosen one step early as the owners
do (``bench/topk_sim.py --lag``, demo, density 0.1, seeds 0-2): perplexity with
the catch-up step alone 11.0-11.4, with the weighted choice too 10.2-10.3, dense
8.7-8.9.
"""

from __future__ import annotations

import torch

from gossipnet.collectives.compress import topk

__all__ = ("MAX_AGE", "STALE", "Staleness")

#: The age of an element whose chunk's broadcast did not arrive (it holds our own
#: value: the optimizer steps it as one round's gradient, as a dense round would).
STALE = -1.0

#: Rounds one value may stand for at most (a guard: a step scaled by a wrong,
#: huge age would throw the element far off; a real age this large is rare).
MAX_AGE = 255  # one byte in the owner's broadcast


class Staleness:
    """Per bucket, the round in which each element last travelled.

    Args:
        numels: elements per bucket.
    """

    def __init__(self, numels: list[int]) -> None:
        self.last = [torch.zeros(n, dtype=torch.int32) for n in numels]  # rounds count from 1
        self.ages: dict[int, tuple[int, torch.Tensor]] = {}
        self.weights: dict[int, tuple[int, torch.Tensor]] = {}
        self.everywhere = False  # see set_weights
        # the applied values' ages over whole buckets (``all_reduce(step=...)``: every
        # peer steps every element), as the owners' broadcasts say; on request
        self.applied: list[torch.Tensor] = []

    def numels(self) -> list[int]:
        return [int(t.numel()) for t in self.last]

    def begin(self) -> None:
        """A new round: the previous round's ages are spent."""
        self.ages.clear()
        for t in self.applied:
            t.fill_(STALE)

    def track_applied(self) -> None:
        """Also keep the ages of every applied value (whole buckets), from now on."""
        if not self.applied:
            self.applied = [torch.zeros(t.numel(), dtype=torch.float32) for t in self.last]

    def apply(self, b: int, off: int, n: int, at: torch.Tensor, ages: torch.Tensor) -> None:
        """The broadcast of chunk ``[off, off + n)`` arrived: ``ages`` (from its owner)
        at its set ``at`` (bucket offsets), 0 in the rest of the chunk.  A chunk
        whose broadcast never arrives keeps :data:`STALE`."""
        if self.applied:
            self.applied[b][off : off + n] = 0.0
            self.applied[b][at] = ages.to(torch.float32)

    def owned_ages(self, b: int, at: torch.Tensor) -> torch.Tensor:
        """The ages recorded by :meth:`own` this round at ``at`` (bucket offsets of
        our shard of ``b``); 1 where none was recorded."""
        held = self.ages.get(b)
        if held is None or not at.numel():
            return torch.ones(at.numel(), dtype=torch.float32)
        start, ages = held
        return ages[at - start].clamp(min=1.0)

    def mark(self, b: int, at: torch.Tensor, now: int) -> None:
        """Elements ``at`` (bucket offsets) travel in round ``now``."""
        if at.numel():
            self.last[b][at] = now

    def own(self, b: int, start: int, length: int, at: torch.Tensor, now: int) -> None:
        """Our chunk's set ``at`` (bucket offsets) in round ``now``: record its ages in
        the owned shard ``[start, start + length)``, then mark it."""
        held = self.ages.get(b)
        if held is None or held[0] != start or held[1].numel() != length:
            held = (start, torch.zeros(length, dtype=torch.float32))
            self.ages[b] = held
        if at.numel():
            age = (now - self.last[b][at]).clamp_(1, MAX_AGE)
            held[1][at - start] = age.to(torch.float32)
            self.last[b][at] = now

    def shard_ages(self, b: int, start: int, length: int) -> torch.Tensor | None:
        """Ages of the owned shard's elements this round (0: not in the set), or None
        when no set was recorded for it (a dense round, another shard map)."""
        held = self.ages.get(b)
        if held is None or held[0] != start or held[1].numel() != length:
            return None
        return held[1]

    def set_weights(self, b: int, start: int, weights: torch.Tensor, everywhere: bool) -> None:
        """Per-element selection weights of ``b`` from ``start`` (from the optimizer);
        ``everywhere``: every peer holds the same weights for the whole bucket (each
        steps every element), so senders weight their sketches; else only the owner
        holds them and weights the summed sketches of its chunks."""
        self.weights[b] = (start, weights)
        self.everywhere = everywhere

    def sender_weights(self, b: int, off: int, n: int, block: int) -> torch.Tensor | None:
        """Per-block weights for our sketch of ``[off, off + n)`` (senders), if any."""
        return self.block_weights(b, off, n, block) if self.everywhere else None

    def owner_weights(self, b: int, off: int, n: int, block: int) -> torch.Tensor | None:
        """Per-block weights for the owner's summed sketches, if the senders did not
        weight theirs."""
        return None if self.everywhere else self.block_weights(b, off, n, block)

    def block_weights(self, b: int, off: int, n: int, block: int) -> torch.Tensor | None:
        """The weights of ``[off, off + n)`` per block, or None if none cover it."""
        held = self.weights.get(b)
        if held is None:
            return None
        start, w = held
        if off < start or off + n > start + w.numel():
            return None
        return topk.block_mean(w[off - start : off - start + n], block)
