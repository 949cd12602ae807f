"""The state a compressor keeps across rounds for one layout: :class:`SessionState`.

Split from :mod:`.session` (which adds the round's entry points) so that
:mod:`.sparse`, whose functions read and update this state, needs no import of
the session that calls it.  What each field holds is said where it is set.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch

from gossipnet.collectives.compress import topk
from gossipnet.collectives.compress.accordion import AccordionState
from gossipnet.collectives.compress.spec import (
    DCT,
    Accordion,
    ArcTopK,
    Compression,
    Int8,
    Sparse,
    density_of,
)
from gossipnet.collectives.compress.staleness import Staleness

__all__ = ("Ledger", "SessionState")


@dataclass
class Ledger:
    """Where every unit of gradient went (tests and benchmarks; off by default).

    Sender side, per bucket: ``put_in`` (gradients given), ``confirmed`` (sent
    and counted by an owner, or our own share), ``unresolved`` (sent, the
    owner's answer never heard: assumed counted; ``unresolved_abs`` sums their
    magnitudes, a bound on what may have been lost).  Owner side: ``counted[src]``,
    what the owner added from ``src`` (its ground truth).  Conservation:
    ``put_in == confirmed + e + pending + unresolved`` (plain EF, ``eta == 1``),
    with any value codec: what is sent leaves ``e`` as its decoded value and the
    rounding error stays in ``e``.
    """

    put_in: list[torch.Tensor] = field(default_factory=list)
    confirmed: list[torch.Tensor] = field(default_factory=list)
    unresolved: list[torch.Tensor] = field(default_factory=list)
    unresolved_abs: list[torch.Tensor] = field(default_factory=list)
    counted: dict[str, list[torch.Tensor]] = field(default_factory=dict)


class SessionState:
    """One compressor's state for one layout (see :mod:`.session`).

    Args:
        spec: a resolved ``compress=`` value (not None).
    """

    def __init__(self, spec: Compression) -> None:
        self.spec = spec
        self.accordion: AccordionState | None = None
        sparse_spec: Sparse | None = None
        if isinstance(spec, Accordion):
            self.accordion = AccordionState(spec.interval, spec.threshold)
            sparse_spec = spec.low
        elif isinstance(spec, (ArcTopK, DCT)):
            sparse_spec = spec
        self.family = (
            "topk" if isinstance(sparse_spec, ArcTopK)
            else "dct" if isinstance(sparse_spec, DCT)
            else "int8" if isinstance(spec, Int8)
            else str(spec)
        )  # fmt: skip
        self.block = sparse_spec.block if isinstance(sparse_spec, ArcTopK) else 0
        self.eta = sparse_spec.eta if isinstance(sparse_spec, ArcTopK) else 1.0
        self.refresh_every = sparse_spec.refresh_every if isinstance(sparse_spec, DCT) else 1
        # how the sparse families' values travel (.quant.code_values)
        self.values = sparse_spec.values if sparse_spec is not None else "fp32"
        # ages of the values and the owner's selection weights (.staleness): ARC-Top-K
        # only (its sets agree across peers, so a value's age does; DCT's do not)
        self.catch_up = isinstance(sparse_spec, ArcTopK) and sparse_spec.catch_up
        self.stale: Staleness | None = None
        self.want_applied = False  # whole-bucket ages too (all_reduce(step=...))
        self.e: list[torch.Tensor] = []
        self.m: list[torch.Tensor] = []
        self.u: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.ann: dict[tuple[int, int], tuple[str, int, torch.Tensor]] = {}
        self.force: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self.bm_prev: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self.pending: dict[tuple[int, int, int], tuple[str, int, torch.Tensor, torch.Tensor]] = {}
        # per owned chunk, this round: the summed sketch (block energies) that chooses
        # its next set, made of our own and each sender's (its proposed blocks and
        # their energies), kept apart (sk_own, sk_in) so that the sum is taken in a
        # fixed order, never in arrival order (.sparse)
        self.sk: dict[tuple[int, int], torch.Tensor] = {}
        self.sk_own: dict[tuple[int, int], torch.Tensor] = {}
        self.sk_in: dict[tuple[int, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.sk_w: dict[tuple[int, int], float] = {}  # weight of the sketches summed
        # per bucket, this round: running count of our own whole-bucket sketch's top
        # blocks, which shares the bucket's budget out over the chunks (.budget.next_size)
        self.hot: dict[int, torch.Tensor] = {}
        self.tau2: dict[int, float | torch.Tensor] = {}  # per bucket, this round: our sketch's cut
        self.valueless: dict[tuple[int, int], set[str]] = collections.defaultdict(set)
        self.got: dict[tuple[int, int, str], torch.Tensor] = {}
        self.theta: list[float] = []
        self.theta_keep: dict[int, float] = {}  # the density each bucket's theta is for
        self.rounds = 0
        self.last_round = -1
        self._key: tuple[Any, ...] = ()
        self.param_mode = False
        self.base_chunk = 64 * 1024  # bytes of a dense chunk (the round's base size)
        self.weight = 1.0
        self.counters: collections.Counter[str] = collections.Counter()
        self.totals: collections.Counter[str] = collections.Counter()
        self.ledger: Ledger | None = None

    def sketch(self, b: int, off: int, x: torch.Tensor) -> torch.Tensor:
        """Block norms of ``x`` (bucket ``b`` from ``off``), weighted by the step each
        block would take where the optimizer gave us weights for it (``.staleness``)."""
        s = topk.sketch(x, self.block)
        w = None if self.stale is None else self.stale.sender_weights(b, off, x.numel(), self.block)
        return s if w is None else s.mul_(w.sqrt_())

    # ------------------------------------------------------------------ sizing
    def density(self, b: int) -> float:
        """The density in force for bucket ``b`` (Accordion: its layers' densities,
        weighted by their sizes)."""
        spec = self.spec
        if isinstance(spec, Accordion):
            lo, hi = density_of(spec.low), density_of(spec.high)
            if self.accordion is None or not self.e:
                return lo
            share = self.accordion.critical_share(b, int(self.e[b].numel()))
            return hi + share * (lo - hi)
        if isinstance(spec, (ArcTopK, DCT)):
            return density_of(spec)
        return 1.0

    def set_segments(self, starts: list[list[int]]) -> None:
        """Where each tensor (layer) starts in each bucket, so Accordion decides per
        layer; without it a bucket is one layer."""
        if self.accordion is not None:
            for b, st in enumerate(starts):
                self.accordion.set_segments(b, torch.tensor(st, dtype=torch.int64))

    def block_densities(self, b: int, nblocks: int) -> torch.Tensor | None:
        """ARC-Top-K under Accordion: the density in force for each block of bucket
        ``b`` (its layer's, by the layer of its first element); None otherwise."""
        spec = self.spec
        if not isinstance(spec, Accordion) or self.accordion is None or not self.block:
            return None
        held = self.accordion.layers(b)
        if held is None:
            return None  # before the first decision every layer is critical
        starts, crit = held
        first = torch.arange(nblocks, dtype=torch.int64) * self.block
        layer = torch.searchsorted(starts, first, right=True) - 1
        lo, hi = density_of(spec.low), density_of(spec.high)
        return torch.where(crit[layer.clamp_(min=0)], lo, hi)

    def max_density(self) -> float:
        spec = self.spec
        if isinstance(spec, Accordion):
            return density_of(spec.low)
        return density_of(spec) if isinstance(spec, (ArcTopK, DCT)) else 1.0
