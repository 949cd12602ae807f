"""A compressor's state across rounds for one layout: :class:`CompressSession`.

One session per (compressor, tensor layout): the optimizer's strategy holds one
for its parameter buckets, a peer one per layout it all-reduces.  It satisfies
:class:`gossipnet.collectives.lossy.compressed.ChunkCodec`, the four per-chunk
points (and ``begin``/``finish``) where the lossy round calls a compressor; the
sparse families' arithmetic is in :mod:`.sparse`.

State: per bucket the error feedback ``e`` (and EF21M's momentum ``m``); for
ARC-Top-K the index sets announced to us (per chunk: owner, tag, blocks) and
those we announced for our own chunks; the contributions we sent whose fate
is not known yet (``pending``, resolved by the owners' contributor bitmaps);
per round the sketches summed for our chunks and who sent no usable values.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import torch

from gossipnet.collectives.chunks import all_finite
from gossipnet.collectives.compress import budget, sparse
from gossipnet.collectives.compress.payload import Bad, Reader, Z, join
from gossipnet.collectives.compress.quant import (
    HALF,
    dequantize_int8,
    from_half,
    quantize_int8,
    to_half,
)
from gossipnet.collectives.compress.staleness import Staleness
from gossipnet.collectives.compress.state import Ledger, SessionState
from gossipnet.collectives.lossy.compressed import Decoded

__all__ = ("CompressSession", "Ledger")

_QUANT = struct.Struct("<BI")
_QKIND = {"bf16": 0, "fp16": 1, "int8": 2}
#: Flag of a QUANT kind: the values are a parameter update, added to the receiver's
#: parameters (the optimizer's broadcast), not values to take as they are.
_UPDATE = 0x80


class CompressSession(SessionState):
    """One compressor's state for one layout, and its entry points for a round.

    Args:
        spec: a resolved ``compress=`` value (not None).
    """

    def setting(self) -> str:
        sparse = self.family in ("topk", "dct")
        name = f"topk{self.block}" if self.family == "topk" else self.family
        if sparse:
            name += f"/{self.values}" + ("/catch-up" if self.catch_up else "")
        return f"accordion({name})" if self.accordion is not None else name

    def chunk_bytes(
        self, base: int, numel: int, itemsize: int, participants: int, param_mode: bool
    ) -> int:
        self.base_chunk = base
        n = max(1, participants)
        if self.family in HALF:
            elems = (base - 8) // 2
        elif self.family == "int8":
            elems = base - 16
        else:
            elems = budget.chunk_elems(self, base, n)
        share = -(-numel // n)  # every owner keeps a share of the bucket
        elems = max(base // itemsize, min(elems, share))
        return elems * itemsize

    # ------------------------------------------------------------------ round
    def begin(self, rnd: Any, param_mode: bool) -> None:
        """Fold this round's inputs into the error feedback; compress our own shard."""
        self.param_mode = param_mode
        self.counters.clear()
        self.sk.clear()
        self.sk_own.clear()
        self.sk_in.clear()
        self.sk_w.clear()
        self.hot.clear()
        self.tau2.clear()
        self.valueless.clear()
        self.got.clear()
        key = (tuple((p.numel, p.chunk_elems) for p in rnd.plans), rnd.participants)
        if key != self._key:  # another chunking or view: announcements do not carry over
            self._key = key
            self.ann.clear()
            self.force.clear()
            self.bm_prev.clear()
        self._expire_pending()
        numels = [int(s.numel()) for s in rnd.src]
        if [int(t.numel()) for t in self.e] != numels:
            self.e = [torch.zeros(k, dtype=torch.float32) for k in numels]
            self.m = [torch.zeros(k, dtype=torch.float32) for k in numels]
            self.theta = [0.0] * len(numels)
            self.pending.clear()
            if self.ledger is not None:
                self.ledger = Ledger()
        if self.catch_up and (self.stale is None or self.stale.numels() != numels):
            self.stale = Staleness(numels)
        if self.stale is not None:
            if self.want_applied:
                self.stale.track_applied()
            self.stale.begin()
        self.src = list(rnd.src)
        self.weight = float(rnd.weight)
        ledger = self.ledger
        if ledger is not None and not ledger.put_in:
            zero = [torch.zeros(k, dtype=torch.float32) for k in numels]
            ledger.put_in = [z.clone() for z in zero]
            ledger.confirmed = [z.clone() for z in zero]
            ledger.unresolved = [z.clone() for z in zero]
            ledger.unresolved_abs = [z.clone() for z in zero]
        if self.family in ("topk", "dct"):
            self._fold(rnd)
            sparse.compress_own(self, rnd)

    def _fold(self, rnd: Any) -> None:
        """``m <- (1-eta) m + eta g``, ``u = e + m`` (DCT: ``u = e + g``); ``e`` starts
        as ``u`` and loses what is sent as it is sent."""
        refresh = self.rounds % self.refresh_every == 0
        self.u = []
        for b, g in enumerate(rnd.src):
            # weight 0 (non-finite or no work): nothing of this round enters e
            g32 = g.to(torch.float32) if self.weight > 0 else torch.zeros(g.numel())
            if self.ledger is not None:
                self.ledger.put_in[b].add_(g32)
            if self.accordion is not None:
                self.accordion.observe(b, g32)
            if self.family == "topk":
                self.m[b].mul_(1 - self.eta).add_(g32, alpha=self.eta)
                u = self.e[b] + self.m[b]
            else:
                u = self.e[b] + g32
                keep = self.density(b)
                if refresh or keep != self.theta_keep.get(b):  # Accordion switched it
                    self.theta[b] = sparse.dct_threshold(u, keep)
                    self.theta_keep[b] = keep
            self.u.append(u)
            self.e[b] = u.clone()
        self.rounds += 1

    def _expire_pending(self) -> None:
        """Contributions whose owner's answer missed two broadcasts: assumed counted
        (the mass leaves ``e``), counted in ``ef_unresolved`` and the ledger."""
        for key in [k for k in self.pending if k[2] < self.last_round]:
            _, b, idx, vals = self.pending.pop(key)
            self.totals["ef_unresolved"] += 1
            if self.ledger is not None:
                self.ledger.unresolved[b].index_add_(0, idx, vals)
                self.ledger.unresolved_abs[b].index_add_(0, idx, vals.abs())

    def finish(self, rnd: Any) -> dict[str, float]:
        """The round's extras; the session moves to the next round."""
        self.last_round = rnd.r
        extra = {k: float(v) for k, v in self.counters.items()}
        for k in ("index_mismatch", "missed_announcement", "sketch_only", "ef_unresolved"):
            extra.setdefault(k, 0.0)
        extra["ef_unresolved_total"] = float(self.totals["ef_unresolved"])
        if self.accordion is not None:
            crit = [self.accordion.critical_share(b, p.numel) for b, p in enumerate(rnd.plans)]
            extra["accordion_critical"] = sum(crit) / max(1, len(crit))
        self.totals.update(self.counters)
        self.src = []
        return extra

    def ages(self, b: int, start: int, length: int) -> torch.Tensor | None:
        """Rounds each value of our shard ``[start, start + length)`` of bucket ``b``
        stands for this round (0: not sent this round); None: not tracked
        (``catch_up`` off, a dense family, or no set recorded for this shard)."""
        if self.stale is None:
            return None
        return self.stale.shard_ages(b, start, length)

    def track_applied(self) -> None:
        """Keep the ages of every value applied (:meth:`applied_ages`), from the next
        round on; nothing when ages are not tracked."""
        self.want_applied = True

    def applied_ages(self) -> list[torch.Tensor] | None:
        """Per bucket, the rounds each value applied in the last round stands for
        (0: not sent); None when not tracked (see :meth:`track_applied`)."""
        if self.stale is None or not self.stale.applied:
            return None
        return self.stale.applied

    def selection_weights(
        self, b: int, start: int, weights: torch.Tensor, everywhere: bool = False
    ) -> None:
        """Per-element weights of ``b`` from ``start`` for choosing the next index sets
        (ARC-Top-K: the optimizer's ``1 / v``); ``everywhere``: every peer has the
        same weights for the whole bucket (see :meth:`.staleness.Staleness.set_weights`).
        Ignored when not tracked."""
        if self.stale is not None:
            self.stale.set_weights(b, start, weights, everywhere)

    # ------------------------------------------------------------------ chunks
    def encode_rs(self, rnd: Any, owner: str, b: int, c: int) -> tuple[int, bytes]:
        if self.family in ("topk", "dct"):
            return sparse.encode_rs(self, rnd, owner, b, c)
        off, n = rnd.plans[b].chunk(c)
        return Z.QUANT, self._quant(self.src[b][off : off + n])

    def decode_rs(
        self, rnd: Any, src: str, b: int, c: int, z: int, payload: memoryview, w: float
    ) -> Decoded:
        try:
            if self.family in ("topk", "dct"):
                return sparse.decode_rs(self, rnd, src, b, c, z, payload, w)
            if z != Z.QUANT:
                raise Bad("compressed_kind")
            return self._dequant(payload, rnd.plans[b].chunk(c)[1]), None
        except Bad as bad:
            self.counters[f"dropped_{bad}"] += 1  # in the round's report, by reason
            return str(bad)

    def encode_ag(
        self, rnd: Any, b: int, c: int, values: torch.Tensor, counted: Callable[[str], bool]
    ) -> tuple[int, bytes, torch.Tensor] | None:
        if self.family in ("topk", "dct"):
            return sparse.encode_ag(self, rnd, b, c, values, counted)
        if not self.param_mode:
            payload = self._quant(values)
            return Z.QUANT, payload, self._dequant(memoryview(payload), values.numel(), check=False)
        # parameters: the update from the chunk every replica holds, which each adds
        # (the owner's rounding error stays in its residual: training.allreduce)
        base = rnd.plans[b].view(rnd.dst[b], c).to(torch.float32)
        payload = self._quant(values.to(torch.float32) - base, update=True)
        update = self._dequant(memoryview(payload), values.numel(), check=False, update=True)
        return Z.QUANT, payload, base + update

    def decode_ag(
        self, rnd: Any, src: str, b: int, c: int, z: int, payload: memoryview
    ) -> torch.Tensor | str:
        try:
            if self.family in ("topk", "dct"):
                return sparse.decode_ag(self, rnd, src, b, c, z, payload)
            if z != Z.QUANT:
                raise Bad("compressed_kind")
            out = self._dequant(payload, rnd.plans[b].chunk(c)[1], update=self.param_mode)
            if self.param_mode:  # an update of the parameters we hold
                out += rnd.plans[b].view(rnd.dst[b], c).to(torch.float32)
                if not all_finite(out):
                    raise Bad("non_finite")
            return out
        except Bad as bad:
            self.counters[f"dropped_{bad}"] += 1  # in the round's report, by reason
            return str(bad)

    # ------------------------------------------------------------------ quantisers
    def _quant(self, x: torch.Tensor, *, update: bool = False) -> bytes:
        """A QUANT payload of ``x``; ``update``: a parameter update (its kind says so)."""
        x = x.detach().to("cpu", torch.float32)
        kind = _QKIND[self.family] | (_UPDATE if update else 0)
        if self.family == "int8":
            scale, q = quantize_int8(x)
            return join(_QUANT.pack(kind, x.numel()), scale.reshape(1), q)
        return join(_QUANT.pack(kind, x.numel()), to_half(x, self.family))

    def _dequant(
        self, payload: memoryview, count: int, *, check: bool = True, update: bool = False
    ) -> torch.Tensor:
        """A QUANT payload's ``count`` values as float32.

        ``check``: a payload from the network (every read checked, the scale in
        range, the values finite: else :class:`Bad`); False for our own payload
        (what our receivers will decode), which no peer's packet can reach.
        The payload's kind must be our family's, flagged as an update exactly when
        ``update`` (a parameter round's broadcast; contributions never are).
        """
        r = Reader(memoryview(payload).cast("B"))
        kind, n = r.struct(_QUANT)
        want = _QKIND.get(self.family, -1) | (_UPDATE if update else 0)
        if kind != want or n != count:
            raise Bad("compressed_kind" if n == count else "compressed_count")
        if self.family == "int8":
            scale = r.scale() if check else r.tensor(torch.float32, 1)
            out = dequantize_int8(scale[0], r.tensor(torch.int8, n))
        else:
            out = from_half(r.tensor(HALF[self.family], n))
        if check and not all_finite(out):  # int8: an int8 of -128 at the largest scale
            raise Bad("non_finite")
        r.done()
        return out
