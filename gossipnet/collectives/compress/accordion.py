"""Accordion's switch rule (Agarwal et al. 2021; ALGORITHMS.md section 6), per layer.

Every ``interval`` rounds each layer (each tensor of a bucket, as the caller's
layout says; the whole bucket without one) compares the norm of its
gradient accumulated over the interval with the previous interval's:
``|prev - cur| / prev >= threshold`` is a critical regime, which uses the light
setting for the next interval; otherwise the heavy one.  The first interval is
critical (no previous norm).  Who decides: for ARC-Top-K the owner of each
chunk (it announces the set, so its decision is the one in force and peers
never need to agree); for DCT each sender for its own packets.
"""

from __future__ import annotations

import torch

__all__ = ("AccordionState", "critical_layers", "layer_norms")


class AccordionState:
    """Per-bucket accumulated gradients and the decision per layer (True = critical).

    ``set_segments(b, starts)`` tells where each tensor (layer) of bucket ``b``
    starts; without it the bucket is one layer.  ``observe(b, g)`` adds a round's
    gradient of bucket ``b``; after ``interval`` observations the decision for
    each of its layers is taken anew from that layer's accumulated norm.
    """

    def __init__(self, interval: int, threshold: float) -> None:
        self.interval = interval
        self.threshold = threshold
        self._acc: dict[int, torch.Tensor] = {}
        self._count: dict[int, int] = {}
        self._prev: dict[int, torch.Tensor] = {}
        self._starts: dict[int, torch.Tensor] = {}
        self.is_critical: dict[int, torch.Tensor] = {}  # per layer of the bucket
        self.switches = 0

    def set_segments(self, b: int, starts: torch.Tensor) -> None:
        """Layer ``i`` of bucket ``b`` is ``[starts[i], starts[i + 1])`` (int64, from 0)."""
        held = self._starts.get(b)
        if held is None or not torch.equal(held, starts):
            self._starts[b] = starts
            self._prev.pop(b, None)
            self.is_critical.pop(b, None)

    def layers(self, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(layer starts, critical per layer) of bucket ``b``; None before a decision."""
        crit = self.is_critical.get(b)
        if crit is None:
            return None
        return self._starts.get(b, torch.zeros(1, dtype=torch.int64)), crit

    def critical_share(self, b: int, n: int) -> float:
        """The share of bucket ``b``'s ``n`` elements in critical layers."""
        held = self.layers(b)
        if held is None:
            return 1.0
        starts, crit = held
        sizes = torch.diff(starts, append=torch.tensor([n], dtype=torch.int64))
        return float((sizes * crit).sum()) / max(1, n)

    def observe(self, b: int, g: torch.Tensor) -> None:
        acc = self._acc.get(b)
        if acc is None or acc.shape != g.shape:
            acc = self._acc[b] = torch.zeros_like(g, dtype=torch.float32)
            self._count[b] = 0
        acc.add_(g)
        self._count[b] += 1
        if self._count[b] >= self.interval:
            starts = self._starts.get(b, torch.zeros(1, dtype=torch.int64))
            cur = layer_norms(acc, starts)
            prev = self._prev.get(b)
            now = (
                torch.ones(cur.numel(), dtype=torch.bool)
                if prev is None or prev.numel() != cur.numel()
                else critical_layers(prev, cur, self.threshold)
            )
            old = self.is_critical.get(b)
            if old is None or old.numel() != now.numel():
                old = torch.ones(now.numel(), dtype=torch.bool)
            self.switches += int((old != now).sum())
            self.is_critical[b] = now
            self._prev[b] = cur
            acc.zero_()
            self._count[b] = 0


def layer_norms(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each layer ``[starts[i], starts[i + 1])`` of ``x``."""
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), x.double().square().cumsum(0)])
    ends = torch.cat([starts[1:], torch.tensor([x.numel()], dtype=torch.int64)])
    return (csum[ends] - csum[starts]).clamp_(min=0).sqrt_().float()


def critical_layers(prev: torch.Tensor, cur: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per layer whose interval norm went ``prev -> cur``: ``|prev - cur| / prev >=
    threshold`` is a critical regime (a layer with no previous norm is critical)."""
    safe = torch.where(prev > 0, prev, torch.ones_like(prev))
    return (prev <= 0) | ((prev - cur).abs() / safe >= threshold)
