"""The reduce-scatter's arithmetic: weighted sums per owned chunk, no I/O.

Why its own data structure: the averaging rule is the algorithm's whole claim
(Weintraub et al. 2025, ALGORITHMS.md 1.1) and must be checkable without a
network, a loop or a clock.  The protocol (:mod:`.scatter`) decides which packet
is a contribution; this module only adds parts up, counts who contributed to
each chunk, and divides.  The split follows hivemind's ``TensorPartReducer``
(parts in, ``on_sender_failed``), here one object per owned shard of a bucket.

The rule: chunk ``c`` of our shard averages, weighted by each sender's weight,
the contributions that arrived for it, our own always among them::

    avg[c] = (w_me * x_me[c] + sum_{j in R(c)} w_j * x_j[c]) / (w_me + sum_{j in R(c)} w_j)

Dividing by the weight that arrived, not by everyone's, keeps the estimate
unbiased when the delivered set ``R(c)`` does not depend on the values (random
loss); dividing by N would be biased low by about ``(1 - p)``.  A chunk whose
arrived weights sum to 0 keeps our own values (never 0/0).

Bounds, so that nothing a peer sends can overflow the sums: a weight is in
``[0, MAX_WEIGHT]`` and a contribution's values are finite with a norm of at most
the accumulator's :data:`VALUE_LIMIT`; then a chunk's weighted sum stays below
the dtype's largest value for any number of contributions a run can have, and
``add_``'s ``alpha`` always fits the accumulator.  A part outside them is refused
(``bad_weight``, ``non_finite``, ``value_range``), never added.

The order of the sum is fixed: our own part, then the senders' in the round's
order (``senders``), whatever order their packets arrive in.  Why: float addition
is not associative, so a sum taken in arrival order differs by an ulp or so
from one run to the next, and a lossless run would not replay (nor would
ARC-Top-K's near-tied block choices downstream).  So a part is not added when it arrives:
its values are kept in its sender's row of a store (a row per sender, each the
shard's length: together ``(N - 1) / N`` of the bucket, in the accumulator's dtype), and
:meth:`ShardReducer.average` adds the rows in order, one vector call per sender
(one per run of equal weight where parts are missing).  The sum then depends
only on which parts arrived, never on when: the same inputs give the same bits.

The per-packet work stays in vector operations: per chunk (:meth:`ShardReducer.accumulate`:
a norm reduction and a copy into the sender's row), or per batch of chunks
(:meth:`ShardReducer.accumulate_batch`: what one receive drain delivered, checked in one
norm reduction per row and copied with one row assignment), and the two store the
same values, so a batch gives bit-identical sums.
The per-chunk counters are numpy views of the ``weights``/``contributors`` tensors:
a scalar update of a tensor element costs ~4 us through the dispatcher, of a numpy
element ~0.15 us, and there is one per packet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from gossipnet.collectives.chunks import all_finite, worth_stacking

__all__ = ("MAX_WEIGHT", "VALUE_LIMIT", "OwnedShard", "Part", "ShardReducer", "valid_weight")

#: One contribution: ``(sender, chunk, values, weight)``, as :meth:`ShardReducer.accumulate`;
#: ``values`` None only for a part whose values are a row of ``accumulate_batch``'s ``stacked``.
Part = tuple[str, int, torch.Tensor | None, float]
#: The largest weight a contribution may carry.  Weights count what a peer's values
#: stand for (micro-batches, replicas, an island's peers: small integers); 2**24
#: keeps every integer weight exact in a float32 ``alpha`` and, with VALUE_LIMIT,
#: every weighted sum finite.
MAX_WEIGHT = float(1 << 24)
#: Per accumulator dtype, the largest norm of one contribution's chunk.  No gradient
#: or parameter comes near it, and ``2**24`` weight times it, summed over ``2**40``
#: contributions, stays finite (float32: ``2**124 < 2**128``).
VALUE_LIMIT = {torch.float32: 2.0**60, torch.float64: 2.0**500}


def valid_weight(w: object) -> bool:
    """Whether ``w`` is a weight a contribution may carry: a number in ``[0, MAX_WEIGHT]``
    (NaN and infinities fail)."""
    return isinstance(w, (int, float)) and 0 <= w <= MAX_WEIGHT


def _norms_ok(block: torch.Tensor, acc_dtype: torch.dtype) -> list[bool]:
    """Per row of ``block``, whether its values are finite with a norm of at most
    ``VALUE_LIMIT[acc_dtype]``: one reduction over the block.  NaN and +-inf give a
    norm that fails the comparison, and so does a norm that overflows the dtype of
    its computation (values past ~2**64 in float32), which is past the limit anyway."""
    if not block.is_floating_point():
        return [True] * block.shape[0]  # integers are finite and far below the limit
    wide = block.dtype in (torch.float32, torch.float64)  # half: computed in float32
    norms = torch.linalg.vector_norm(block, dim=1, dtype=None if wide else torch.float32)
    return (norms <= VALUE_LIMIT[acc_dtype]).tolist()


def _norm_ok(values: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    """:func:`_norms_ok` for one part's values (as few dispatches as a sum)."""
    if not values.is_floating_point():
        return True
    wide = values.dtype in (torch.float32, torch.float64)
    norm = torch.linalg.vector_norm(values, dtype=None if wide else torch.float32)
    return float(norm) <= VALUE_LIMIT[acc_dtype]


def _refusal(values: torch.Tensor) -> str:
    """Why values that failed :func:`_norms_ok` are refused (a rare path: one reduction)."""
    return "value_range" if all_finite(values) else "non_finite"


@dataclass(slots=True)
class OwnedShard:
    """This peer's shard of one bucket after the reduce-scatter."""

    bucket: int
    start: int  # element offset in the bucket
    average: torch.Tensor  # averaged values (float32/float64), length = shard size
    weights: torch.Tensor  # per owned chunk: sum of weights that arrived
    contributors: torch.Tensor  # per owned chunk: number of contributions that arrived


class ShardReducer:
    """Weighted sums of the chunks of one owned shard, and who added to each.

    Why parts are refused rather than raised on: every refusal is a network event
    (a duplicate copy, a packet after the cut, a corrupted value), which the
    caller counts by the reason returned.

    Args:
        acc: our own values of the shard (its first chunk at offset 0); the sums
            accumulate in it, in place (float32 or float64).
        chunks: the bucket's chunk indices this shard holds.
        chunk_elems: elements per full chunk (the last may be shorter).
        weight: our own weight, in ``[0, MAX_WEIGHT]``; ``acc`` is scaled by it here.
            Our own values are not checked against :data:`VALUE_LIMIT` (they are
            the caller's to keep finite).
        senders: who may contribute (not us), in the order their parts are added;
            a part from anyone else is refused (``not_participant``).
        store: scratch for the senders' parts, ``[len(senders), len(chunks) *
            chunk_elems]`` of ``acc``'s dtype, any contents (the caller's pool);
            None: allocated here.

    Raises:
        ValueError: ``weight`` outside ``[0, MAX_WEIGHT]``, ``acc`` shorter than
            ``chunks``, or a ``store`` of another shape or dtype.
    """

    __slots__ = (
        "_failed",
        "_grid",
        "_n",
        "_own_w",
        "_pw",
        "_pw_np",
        "_row",
        "_rows",
        "_seen",
        "_w",
        "_x",
        "acc",
        "chunk_elems",
        "chunks",
        "closed",
        "contributors",
        "senders",
        "weights",
    )

    def __init__(
        self,
        acc: torch.Tensor,
        chunks: range,
        chunk_elems: int,
        weight: float,
        senders: Sequence[str],
        *,
        store: torch.Tensor | None = None,
    ) -> None:
        if not valid_weight(weight):
            raise ValueError(f"weight must be a number in [0, {MAX_WEIGHT:.0f}], got {weight}")
        if chunk_elems < 1 or acc.numel() <= (len(chunks) - 1) * chunk_elems:
            raise ValueError(f"{acc.numel()} elements cannot hold {len(chunks)} chunks")
        n = len(chunks)
        shape = (len(senders), n * chunk_elems)
        if store is None:
            store = torch.empty(shape, dtype=acc.dtype)
        elif tuple(store.shape) != shape or store.dtype != acc.dtype:
            raise ValueError(f"store must be {shape} of {acc.dtype}, got {tuple(store.shape)}")
        if weight != 1.0:
            acc.mul_(weight)
        self.acc = acc
        self.chunks = chunks
        self.chunk_elems = chunk_elems
        self.senders = tuple(senders)
        self._row = {s: k for k, s in enumerate(self.senders)}
        # per sender, its parts' values (row k, chunk i at i * chunk_elems); only the
        # entries of parts that arrived are ever read
        self._x = store
        self._rows = store.unbind(0)
        # the same memory as numpy rows, one per (sender, chunk): batches are stored
        # with one row assignment (``_add_rows``)
        self._grid = store.view(len(senders) * n, chunk_elems).numpy()
        # per sender and chunk, the weight its part came with (0: none came)
        self._pw = torch.zeros(len(senders), n, dtype=torch.float64)
        self._pw_np = self._pw.numpy()  # the same memory: cheap scalar writes
        self._own_w = float(weight)
        self.weights = torch.full((n,), float(weight), dtype=torch.float64)
        self.contributors = torch.ones(n, dtype=torch.int32)  # us
        self._w = self.weights.numpy()  # the same memory: cheap scalar updates
        self._n = self.contributors.numpy()
        self.closed = False  # averaged: later parts are late
        self._seen: set[tuple[str, int]] = set()
        self._failed: set[str] = set()

    def has(self, sender: str, chunk: int) -> bool:
        """Whether ``sender``'s part for ``chunk`` was accumulated."""
        return (sender, chunk) in self._seen

    def accumulate(
        self, sender: str, chunk: int, values: torch.Tensor, weight: float, *, check: bool = True
    ) -> str | None:
        """Take ``weight * values`` into ``chunk``'s sum; None, or why it was refused.

        Args:
            sender: who sent the part; each sender counts once per chunk.
            chunk: the bucket's chunk index.
            values: the chunk's elements, as many as the chunk holds.
            weight: the sender's weight, in ``[0, MAX_WEIGHT]``.
            check: refuse values that are not finite or past :data:`VALUE_LIMIT`
                (False: the caller checked them).

        Returns:
            None when taken; else ``"late"`` (averaged already), ``"bad_weight"``,
            ``"not_owner"`` (a chunk outside the shard), ``"not_participant"``
            (a sender outside ``senders``), ``"failed_sender"``, ``"duplicate"``,
            ``"layout_mismatch"`` (wrong length), ``"non_finite"`` or
            ``"value_range"`` (finite, but its norm is past :data:`VALUE_LIMIT`).
        """
        reason = self._refuse(sender, chunk, values.numel(), weight)
        if reason is None and check and not _norm_ok(values, self.acc.dtype):
            reason = _refusal(values)
        if reason is not None:
            return reason
        self._take(sender, chunk, weight)
        self._add(sender, chunk - self.chunks.start, values, weight)
        return None

    def accumulate_batch(
        self,
        parts: Sequence[Part],
        *,
        check: bool = True,
        stacked: tuple[torch.Tensor, list[int]] | None = None,
    ) -> list[str | None]:
        """:meth:`accumulate` each of ``parts`` in order, in a few tensor operations.

        Why: one drain of the receive socket delivers tens of chunks; per chunk,
        a finiteness reduction and a copy cost ~2 us of dispatch each.  Here
        the full-length parts of small chunks (:func:`worth_stacking`; larger ones
        take one call each) are stacked once (one copy), checked with one row norm,
        and stored with one row assignment: the same values as the parts one by
        one, and every refusal rule (and its reason) is the same, decided in the
        same order.

        ``stacked``: ``(block, members)``, the caller's stack already made
        (:class:`.rows.ChunkRows`: the payloads joined once): row ``r`` of
        ``block`` is part ``members[r]``'s full-length values, and those parts
        may carry None as values.  Without it, parts are stacked here.

        Returns:
            Per part, None when taken, else the refusal reason (:meth:`accumulate`).
        """
        if stacked is not None:
            block: torch.Tensor | None = stacked[0]
            rows = {i: r for r, i in enumerate(stacked[1])}
        else:
            step, dtype = self.chunk_elems, self.acc.dtype
            full = [
                i for i, p in enumerate(parts)
                if p[2] is not None and p[2].numel() == step and worth_stacking(step, dtype)
            ]  # fmt: skip
            rows = {i: r for r, i in enumerate(full)}
            block = (
                torch.stack([cast(torch.Tensor, parts[i][2]) for i in full])
                if len(full) > 1
                else None
            )
            if block is None:
                rows = {}
        in_range: list[bool] | None = None
        if check and block is not None:
            in_range = _norms_ok(block, self.acc.dtype)
        if block is not None and block.dtype != self.acc.dtype:
            block = block.to(self.acc.dtype)  # exact (wider): the store's dtype
        reasons: list[str | None] = []
        taken: list[tuple[int, int, float]] = []  # (part, chunk row, weight)
        width = block.shape[1] if block is not None else 0
        for i, (sender, chunk, values, weight) in enumerate(parts):
            r = rows.get(i)  # rows is empty without a block
            numel = width if r is not None else cast(torch.Tensor, values).numel()
            reason = self._refuse(sender, chunk, numel, weight)
            if reason is None and check:
                if r is not None and block is not None and in_range is not None:
                    row, ok = block[r], in_range[r]
                else:  # one reduction: a lone part
                    row = cast(torch.Tensor, values)
                    ok = _norm_ok(row, self.acc.dtype)
                reason = None if ok else _refusal(row)
            reasons.append(reason)
            if reason is None:
                self._take(sender, chunk, weight)
                taken.append((i, chunk - self.chunks.start, weight))
        self._add_rows(parts, taken, rows, block)
        return reasons

    def _add_rows(
        self,
        parts: Sequence[Part],
        taken: list[tuple[int, int, float]],
        rows: dict[int, int],
        stacked: torch.Tensor | None,
    ) -> None:
        """Store the taken parts: the stacked rows with one row assignment."""
        n = len(self.chunks)
        src: list[int] = []  # stacked rows
        dst: list[int] = []  # their (sender, chunk) rows of the store
        for i, row, weight in taken:
            r = rows.get(i) if stacked is not None else None
            if r is None:  # not stacked: it has values
                self._add(parts[i][0], row, cast(torch.Tensor, parts[i][2]), weight)
                continue
            k = self._row[parts[i][0]]
            self._pw_np[k, row] = weight
            src.append(r)
            dst.append(k * n + row)
        if dst:
            block = cast(torch.Tensor, stacked).numpy()
            if src != list(range(len(block))):  # some refused, or not stacked in order
                block = block[src]
            # numpy's row assignment: faster than index_copy_ for rows of chunk size
            self._grid[dst] = block

    def _add(self, sender: str, row: int, values: torch.Tensor, weight: float) -> None:
        """Store one accepted part, the shard's chunk ``row``, in its sender's row."""
        k = self._row[sender]
        lo = row * self.chunk_elems
        self._rows[k][lo : lo + values.numel()].copy_(values)  # a 1-D view: one dispatch
        self._pw_np[k, row] = weight

    def _refuse(self, sender: str, chunk: int, numel: int, weight: float) -> str | None:
        """Why a part cannot be added, checked cheapest first; None if it can."""
        if self.closed:
            return "late"
        if not 0 <= weight <= MAX_WEIGHT:  # NaN fails too
            return "bad_weight"
        if chunk not in self.chunks:
            return "not_owner"
        if sender not in self._row:
            return "not_participant"
        if sender in self._failed:
            return "failed_sender"
        if (sender, chunk) in self._seen:
            return "duplicate"
        lo = (chunk - self.chunks.start) * self.chunk_elems
        if numel != min(self.chunk_elems, self.acc.numel() - lo):
            return "layout_mismatch"
        return None

    def _take(self, sender: str, chunk: int, weight: float) -> None:
        """Count one accepted part: seen, its weight and one contributor more."""
        self._seen.add((sender, chunk))
        i = chunk - self.chunks.start
        self._w[i] += weight
        self._n[i] += 1

    def on_sender_failed(self, sender: str) -> None:
        """Refuse ``sender``'s parts from now on (it was declared failed).

        Parts already added stay: each chunk divides by the weight that arrived
        for it, so a sender that delivered some chunks biases none of them, as
        in hivemind's reducer, which also excludes only the parts still to come.
        """
        self._failed.add(sender)

    def average(self, own: torch.Tensor) -> torch.Tensor:
        """Add the stored parts in ``senders`` order and divide each chunk's sum by
        the weight that arrived for it; closes the reducer.

        In place in ``acc`` (one pass per sender, no copy), which is returned.  A
        chunk whose arrived weights sum to 0 takes ``own`` (our unweighted values of
        the shard).  The weights are summed in the same order, so ``weights`` too
        depends only on which parts arrived.
        """
        self.closed = True
        acc, n_elems, step = self.acc, self.acc.numel(), self.chunk_elems
        if not len(self.chunks):
            return acc
        total = torch.full_like(self.weights, self._own_w)
        for k in range(len(self.senders)):
            pw = self._pw[k]
            if bool((pw > 0).any()):
                self._add_sender(k, pw)
                total += pw
        self.weights.copy_(total)
        safe = self.weights.to(acc.dtype).clamp_min(1e-30)
        n_full = min(len(self.chunks), n_elems // step)
        if n_full:
            acc[: n_full * step].view(n_full, step).div_(safe[:n_full, None])
        if n_elems > n_full * step:
            acc[n_full * step :].div_(safe[n_full])
        zero = self.weights <= 0
        if bool(zero.any()):  # no weight arrived: keep our own values, never 0/0
            for i in torch.nonzero(zero).flatten().tolist():
                lo = i * step
                hi = min(lo + step, n_elems)
                acc[lo:hi].copy_(own[lo:hi])
        return acc

    def _add_sender(self, k: int, pw: torch.Tensor) -> None:
        """``acc += w * x_k`` over the chunks sender ``k``'s parts arrived for (weight
        > 0): one ``add_`` per run of consecutive chunks that came with one weight
        (one in all for a sender whose every part arrived).  The calls depend only
        on which parts arrived.  (Not ``index_add_``: it starts the intra-op thread
        pool even for a few rows, which can stall a call on a busy machine.)"""
        acc, x, step = self.acc, self._x[k], self.chunk_elems
        n_elems, weights = acc.numel(), pw.tolist()
        cuts = torch.nonzero(pw[1:] != pw[:-1]).flatten().add_(1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, len(weights)], strict=True):
            w = weights[lo]
            if w > 0:
                a, b = lo * step, min(hi * step, n_elems)
                acc[a:b].add_(x[a:b], alpha=w)
