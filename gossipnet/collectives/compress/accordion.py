"""Accordion's switch rule (Agarwal et al. 2021; ALGORITHMS.md section 6), per layer.

Every ``interval`` rounds each layer (bucket) compares the norm of its
gradient accumulated over the interval with the previous interval's:
``|prev - cur| / prev >= threshold`` is a critical regime, which uses the light
setting for the next interval; otherwise the heavy one.  The first interval is
critical (no previous norm).  Who decides: for ARC-Top-K the owner of each
chunk (it announces the set, so its decision is the one in force and peers
never need to agree); for DCT each sender for its own packets.
"""

from __future__ import annotations

import torch

__all__ = ("AccordionState", "critical")


def critical(prev: float | None, cur: float, threshold: float) -> bool:
    """Whether a layer whose interval norm went ``prev -> cur`` is in a critical regime."""
    if prev is None or prev <= 0:
        return True
    return abs(prev - cur) / prev >= threshold


class AccordionState:
    """Per-bucket accumulated gradients and the current decision (True = critical).

    ``observe(b, g)`` adds a round's gradient of bucket ``b``; after ``interval``
    observations of a bucket the decision for it is taken anew.
    """

    def __init__(self, interval: int, threshold: float) -> None:
        self.interval = interval
        self.threshold = threshold
        self._acc: dict[int, torch.Tensor] = {}
        self._count: dict[int, int] = {}
        self._prev: dict[int, float] = {}
        self.is_critical: dict[int, bool] = {}
        self.switches = 0

    def critical_now(self, b: int) -> bool:
        """The decision in force for bucket ``b`` (critical until a first interval ends)."""
        return self.is_critical.get(b, True)

    def observe(self, b: int, g: torch.Tensor) -> None:
        acc = self._acc.get(b)
        if acc is None or acc.shape != g.shape:
            acc = self._acc[b] = torch.zeros_like(g, dtype=torch.float32)
            self._count[b] = 0
        acc.add_(g)
        self._count[b] += 1
        if self._count[b] >= self.interval:
            cur = float(acc.norm())
            now = critical(self._prev.get(b), cur, self.threshold)
            if now != self.critical_now(b):
                self.switches += 1
            self.is_critical[b] = now
            self._prev[b] = cur
            acc.zero_()
            self._count[b] = 0
