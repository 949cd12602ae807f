"""ARC-Top-K and DCT at the round's four per-chunk points (functions over a session).

ARC-Top-K index agreement: the *owner* of a chunk picks the chunk's next index
set from the sketches that arrived (plus its own), puts it in its broadcast of
the chunk, tagged with the round id, and uses it as the set in force next
round.  A sender uses a set only if it came from the chunk's current owner in
the previous round of the session; it sends values at it and the tag.  The
owner adds values only when the tag equals the set it has in force, so values
at two different sets are never added (a mismatch is counted,
``index_mismatch``, and the packet counts as arrived with weight 0).  A sender
that missed the announcement sends only its sketch (``missed_announcement``);
its error feedback keeps the mass.  Bootstrap (round 0, a new owner, another
chunking or view): with no set announced, the set in force is drawn from a seed
of ``(round, bucket, chunk)`` (:func:`.topk.bootstrap_blocks`), which every
peer derives alike, tagged ``NONE``.

Error feedback under loss: a sender cannot see what was lost, so each owner's
broadcast of a chunk carries a bitmap of the participants whose values it
*counted* (arrived, weight > 0, right set) this round and the previous one's.
The sender keeps each contribution it sent as ``pending`` until a bitmap
answers: counted, it is gone from ``e`` for good; not counted, it goes back
into ``e`` (sent again later).  Never counted twice, never dropped unseen: a
contribution whose two answers were both lost (about p^2) is assumed counted
and counted in ``ef_unresolved``.

Ages (``ArcTopK.catch_up``, :mod:`.staleness`): the owner's broadcast also carries,
per block of the set, the rounds its values stand for (u8, 1..255; 0 is a counted
drop, ``compressed_age``), so every peer that steps the whole model takes the
owner's ages.  The owner's choice of the next set weights the block energies by
the optimizer's ``1 / v`` where it has it.

Value codecs (``values=``, :func:`.quant.code_values`): a contribution's values
travel rounded (bf16, or int8 with one scale per packet and a step per 16
values, :func:`.quant.quantize_grouped_int8`); the sender keeps the
rounding error in ``e`` (``e <- u - decoded`` at the set) and its ``pending``
entry holds the *decoded* values, what the owner adds, so the ledger's
conservation holds exactly (an owner's own share of its chunks takes no packet
and goes unrounded).  The owner's broadcast of the averages is rounded
once more and not error-fed (int8: at most half the step of the value's
group); the owner applies the decoded values itself, so every
replica holds the same bits.

Parameters (the optimizer's broadcast, ``param_mode``): the owner sends the
*update* of its chunk, ``d = values - base`` where ``values`` are its new
parameters and ``base`` the chunk as every replica holds it (``rnd.dst``), at the
blocks (ARC-Top-K: as many as the set in force; DCT: ``density`` of the entries)
where ``|d|`` is largest, in the value codec; every replica, the owner's too,
adds the decoded update to ``base``, so all hold the same bits.  What was not
sent, and the rounding, stays in the owner's parameters as the caller keeps them
(``training.allreduce``: its residual), so it is sent later: error feedback on the
parameters (EF21-P, Gruntkowska et al. 2023).  With Adam's catch-up step the
update lies on the set in force (only its elements move), so these are the
same blocks.  A lost update stays missing on that receiver until the next
resync (the loss rule of ``all_reduce(..., step=opt)``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import torch

from gossipnet.collectives.chunks import all_finite
from gossipnet.collectives.compress import budget, dct, topk
from gossipnet.collectives.compress.payload import (
    NONE,
    Bad,
    Reader,
    Z,
    bitmap,
    in_bitmap,
    join,
    uvarint,
)
from gossipnet.collectives.compress.quant import CODEC_IDS, code_values
from gossipnet.collectives.compress.state import SessionState as CompressSession

__all__ = ("compress_own", "decode_ag", "decode_rs", "dct_threshold", "encode_ag", "encode_rs")

# the per-round fields first (a bundle's records share them, .payload); counts follow
_TOPK_RS = struct.Struct("<BQ")
_TOPK_AG = struct.Struct("<BBHQQ")
_DCT_RS = struct.Struct("<B")
_DCT_AG = struct.Struct("<BBHQ")
_EMPTY = torch.zeros(0, dtype=torch.int64)

dct_threshold = dct.threshold


def _set_in_force(
    sess: CompressSession, rnd: Any, b: int, c: int, n: int
) -> tuple[int, torch.Tensor]:
    """(tag, blocks) of the set the owner of ``(b, c)`` has in force: ours as owner."""
    held = sess.force.get((b, c))
    return held if held is not None else (NONE, _bootstrap(sess, rnd, b, c, n))


def compress_own(sess: CompressSession, rnd: Any) -> None:
    """Our contribution to our own chunks: ``C(u)`` into the reducers (times our weight).

    Always counted (no packet to lose): it leaves ``e`` at once.
    """
    w, ledger = sess.weight, sess.ledger
    for b, red in enumerate(rnd.reducers):
        plan, owned = rnd.plans[b], rnd.owned[b]
        if not len(owned):
            continue
        start = plan.chunk(owned.start)[0]
        span = len(rnd.maps[b].owned_range(rnd.me))
        for c in owned:
            off, n = plan.chunk(c)
            u_c, e_c = sess.u[b][off : off + n], sess.e[b][off : off + n]
            if sess.family == "topk":
                idx = topk.block_indices(_set_in_force(sess, rnd, b, c, n)[1], sess.block, n)
            else:
                idx = dct.select(u_c, sess.theta[b], budget.dct_cap(sess, n))
            acc = red.acc[off - start : off - start + n]
            if sess.stale is not None:  # ARC-Top-K's agreed sets only (.state)
                sess.stale.own(b, start, span, idx + off, sess.rounds)
            acc.zero_()
            if w > 0:
                vals = u_c[idx]
                acc[idx] = vals * w
                e_c[idx] = 0
                if ledger is not None:
                    ledger.confirmed[b].index_add_(0, idx + off, vals)
                    _counted(sess, rnd.me, b).index_add_(0, idx + off, vals)
            if sess.family == "topk":
                energy = sess.sketch(b, off, e_c + sess.m[b][off : off + n]).square_()
                sess.sk_own[(b, c)] = energy.mul_(w)
                sess.sk[(b, c)] = energy.clone()
                sess.sk_w[(b, c)] = w


def _counted(sess: CompressSession, who: str, b: int) -> torch.Tensor:
    """The ledger's owner-side total of what was counted from ``who`` in bucket ``b``."""
    assert sess.ledger is not None
    per = sess.ledger.counted.setdefault(
        who, [torch.zeros(t.numel(), dtype=torch.float32) for t in sess.e]
    )
    return per[b]


def encode_rs(sess: CompressSession, rnd: Any, owner: str, b: int, c: int) -> tuple[int, bytes]:
    """Our contribution to ``owner``'s chunk ``c``: values leave ``e`` as ``pending``."""
    off, n = rnd.plans[b].chunk(c)
    u_c, e_c = sess.u[b][off : off + n], sess.e[b][off : off + n]
    if sess.family == "dct":
        idx = dct.select(u_c, sess.theta[b], budget.dct_cap(sess, n)) if sess.weight > 0 else _EMPTY
        parts = _send(sess, rnd, owner, b, c, idx, off)
        head = _DCT_RS.pack(CODEC_IDS[sess.values]) + uvarint(idx.numel())
        return Z.DCT_RS, join(head, idx.to(torch.int32), *parts)
    blk = sess.block
    held = sess.ann.get((b, c))
    tag, blocks = NONE, None
    if sess.weight <= 0:
        pass  # weight 0 counts nothing: keep the mass, send the sketch
    elif held is None or held[0] != owner:  # no set from this owner: the bootstrap set
        tag, blocks = NONE, _bootstrap(sess, rnd, b, c, n)
    elif held[1] == sess.last_round:
        tag, blocks = held[1], held[2]
    else:
        sess.counters["missed_announcement"] += 1
    idx = _EMPTY
    if blocks is not None:
        idx = topk.block_indices(blocks, blk, n)
    else:
        tag = NONE
    parts = _send(sess, rnd, owner, b, c, idx, off)
    ids, props = budget.proposals(
        sess, b, off, sess.sketch(b, off, e_c + sess.m[b][off : off + n]), idx.numel()
    )
    head = _TOPK_RS.pack(CODEC_IDS[sess.values], tag) + uvarint(ids.numel()) + uvarint(idx.numel())
    return Z.TOPK_RS, join(head, ids.to(torch.int32), props.to(torch.bfloat16), *parts)


def _send(
    sess: CompressSession, rnd: Any, owner: str, b: int, c: int, idx: torch.Tensor, off: int
) -> list[torch.Tensor]:
    """The coded values of ``u`` at ``idx`` (chunk-relative) for ``owner``: they leave
    ``e`` as ``pending`` (what the owner will decode); ``e`` keeps the rounding error."""
    at = idx + off
    if sess.stale is not None:
        sess.stale.mark(b, at, sess.rounds)
    vals = sess.u[b][at]
    parts, decoded = code_values(vals, sess.values)
    _pending(sess, rnd, owner, b, c, at, decoded)
    sess.e[b][at] = vals - decoded
    return parts


def _bootstrap(sess: CompressSession, rnd: Any, b: int, c: int, n: int) -> torch.Tensor:
    m = topk.block_count(n, sess.block)
    return topk.bootstrap_blocks(
        rnd.r, b, c, m, topk.nblocks_for(n, sess.block, sess.max_density())
    )


def _pending(
    sess: CompressSession,
    rnd: Any,
    owner: str,
    b: int,
    c: int,
    idx: torch.Tensor,
    vals: torch.Tensor,
) -> None:
    if idx.numel():
        sess.pending[(b, c, rnd.r)] = (owner, b, idx, vals.clone())


def decode_rs(
    sess: CompressSession,
    rnd: Any,
    src: str,
    b: int,
    c: int,
    z: int,
    payload: memoryview,
    w: float,
) -> tuple[torch.Tensor, float | None]:
    """A contribution to our chunk: dense values and a weight override (0 = no values)."""
    n = rnd.plans[b].chunk(c)[1]
    r = Reader(memoryview(payload).cast("B"))
    key = (b, c)
    dense = torch.zeros(n, dtype=torch.float32)
    if sess.family == "dct":
        if z != Z.DCT_RS:
            raise Bad("compressed_kind")
        (codec,) = r.struct(_DCT_RS)
        _same_codec(sess, codec)
        nnz = r.count(budget.dct_cap(sess, n))
        idx = r.indices(nnz, n)
        dense[idx] = r.coded(nnz, sess.values)
        r.done()
        return _got(sess, key, src, w, dense)
    if z != Z.TOPK_RS:
        raise Bad("compressed_kind")
    codec, tag = r.struct(_TOPK_RS)
    _same_codec(sess, codec)
    m = topk.block_count(n, sess.block)
    nprop, nvals = r.count(m), r.count(n)
    ids = r.indices(nprop, m)
    sk = r.tensor(torch.bfloat16, nprop).to(torch.float32)
    if not bool(torch.isfinite(sk).all()) or bool((sk < 0).any()):
        raise Bad("non_finite")
    vals = r.coded(nvals, sess.values)
    r.done()
    sess.sk_in.setdefault(key, {})[src] = (ids, sk.square_().mul_(w))  # ids: distinct
    sess.sk[key] = _summed_sketch(sess, rnd, key, m)
    sess.sk_w[key] = sess.sk_w.get(key, 0.0) + w
    if nvals == 0:
        sess.counters["sketch_only"] += 1
        sess.valueless[key].add(src)
        return dense, 0.0
    want_tag, blocks = _set_in_force(sess, rnd, b, c, n)
    if tag != want_tag:  # values at another index set: never added
        sess.counters["index_mismatch"] += 1
        sess.valueless[key].add(src)
        return dense, 0.0
    idx = topk.block_indices(blocks, sess.block, n)
    if nvals != idx.numel():
        raise Bad("compressed_count")
    dense[idx] = vals
    return _got(sess, key, src, w, dense)


def _summed_sketch(sess: CompressSession, rnd: Any, key: tuple[int, int], m: int) -> torch.Tensor:
    """The sketches of chunk ``key`` that arrived, summed in a fixed order: our own,
    then the participants' in the round's order.

    Why not a running sum: float addition is not associative, so a sum in arrival
    order moves by an ulp from run to run, and with it the choice among near-tied
    blocks (:func:`.topk.choose_blocks`): a lossless run would not replay.  Taken
    again at every arrival (a copy of one value per block, then each sender's
    proposals): ``sess.sk`` always holds the sum of what arrived so far.  Each
    sender's sketch is kept as it came, sparse (its proposed blocks' energies).
    """
    own = sess.sk_own.get(key)
    total = own.clone() if own is not None else torch.zeros(m)
    got = sess.sk_in.get(key, {})
    for p in rnd.participants:
        part = got.get(p)
        if part is not None:
            ids, energy = part
            total[ids] = total[ids] + energy
    return total


def _same_codec(sess: CompressSession, codec: int) -> None:
    """A payload whose values are in another codec than ours: a peer with another
    ``values=`` setting (its chunking differs too), never read as ours."""
    if codec != CODEC_IDS[sess.values]:
        raise Bad("compressed_kind")


def _got(
    sess: CompressSession, key: tuple[int, int], src: str, w: float, dense: torch.Tensor
) -> tuple[torch.Tensor, float | None]:
    if w <= 0:
        sess.valueless[key].add(src)
    if sess.ledger is not None:
        sess.got[(*key, src)] = dense
    return dense, None


def encode_ag(
    sess: CompressSession,
    rnd: Any,
    b: int,
    c: int,
    values: torch.Tensor,
    counted: Callable[[str], bool],
) -> tuple[int, bytes, torch.Tensor]:
    """Our broadcast of chunk ``c``: values, contributor bitmaps, (ARC-Top-K) the sets."""
    off, n = rnd.plans[b].chunk(c)
    key = (b, c)
    skip = sess.valueless.get(key, set())
    parts = rnd.participants
    flags = [(sess.weight > 0) if p == rnd.me else (counted(p) and p not in skip) for p in parts]
    bits = torch.tensor(flags, dtype=torch.bool)
    prev_round, prev_bits = sess.bm_prev.get(key, (NONE, torch.zeros(len(parts), dtype=torch.bool)))
    sess.bm_prev[key] = (rnd.r, bits)
    if sess.ledger is not None:
        for p, flag in zip(parts, flags, strict=True):
            got = sess.got.get((b, c, p))
            if flag and got is not None:
                _counted(sess, p, b)[off : off + n].add_(got)
    values = values.detach().to(torch.float32)
    param = sess.param_mode
    codec = CODEC_IDS[sess.values]
    base = rnd.plans[b].view(rnd.dst[b], c).to(torch.float32) if param else None
    if base is not None:
        values = values - base  # the update every replica adds to ``base``
    if sess.family == "dct":
        if param:
            k = max(1, min(n, math.ceil(sess.density(b) * n)))
            idx = torch.sort(torch.topk(values.abs(), k, sorted=False).indices).values
        else:
            idx = torch.nonzero(values).flatten()
        coded, vals = code_values(values[idx], sess.values)
        head = _DCT_AG.pack(codec, int(param), len(parts), prev_round)
        counts = uvarint(vals.numel())
        payload = join(head, bitmap(bits), bitmap(prev_bits), counts, idx.to(torch.int32), *coded)
        return Z.DCT_AG, payload, _spread(base, n, idx, vals)
    _, cur = _set_in_force(sess, rnd, b, c, n)
    m = topk.block_count(n, sess.block)
    energy = sess.sk.get(key, torch.zeros(m))
    weights = None if sess.stale is None else sess.stale.owner_weights(b, off, n, sess.block)
    if weights is not None:
        energy = energy * weights  # the step each block would take (.staleness)
    nxt = topk.choose_blocks(energy, budget.next_size(sess, rnd, b, off, n))
    sess.force[key] = (rnd.r, nxt)
    ages = torch.zeros(0, dtype=torch.float32)  # parameters: no ages (nothing steps on them)
    if param:  # the blocks of the largest update, as many as the set in force
        cur = topk.choose_blocks(topk.sketch(values, sess.block), cur.numel())
        idx = topk.block_indices(cur, sess.block, n)
    else:
        idx = topk.block_indices(cur, sess.block, n)
        ages = _block_ages(sess, b, off, cur)
        if sess.stale is not None:
            sess.stale.apply(b, off, n, idx + off, topk.per_element(ages, cur, sess.block, n))
    coded, vals = code_values(values[idx], sess.values)
    head = _TOPK_AG.pack(codec, int(param), len(parts), rnd.r, prev_round)
    counts = uvarint(cur.numel()) + uvarint(nxt.numel()) + uvarint(vals.numel())
    payload = join(
        head,
        bitmap(bits),
        bitmap(prev_bits),
        counts,
        cur.to(torch.int32),
        nxt.to(torch.int32),
        ages.to(torch.uint8),
        *coded,
    )
    return Z.TOPK_AG, payload, _spread(base, n, idx, vals)


def _block_ages(sess: CompressSession, b: int, off: int, cur: torch.Tensor) -> torch.Tensor:
    """The rounds each block of our set ``cur`` stands for (1..MAX_AGE), as our
    :meth:`.staleness.Staleness.own` counted them; 1 where not tracked."""
    if sess.stale is None or not cur.numel():
        return torch.ones(cur.numel(), dtype=torch.float32)
    return sess.stale.owned_ages(b, cur.to(torch.int64) * sess.block + off)


def _spread(
    base: torch.Tensor | None, n: int, idx: torch.Tensor, vals: torch.Tensor
) -> torch.Tensor:
    """What a receiver decodes: ``vals`` at ``idx``, zero elsewhere (averages), or
    added to ``base`` (the chunk's parameters: the new parameters)."""
    if base is None:
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = vals
        return out
    out = base.clone()
    out[idx] += vals
    return out


def decode_ag(
    sess: CompressSession, rnd: Any, src: str, b: int, c: int, z: int, payload: memoryview
) -> torch.Tensor:
    """An owner's broadcast of chunk ``c``: its dense values; learns the next set and
    resolves our pending contributions from the bitmaps."""
    n = rnd.plans[b].chunk(c)[1]
    r = Reader(memoryview(payload).cast("B"))
    parts = rnd.participants
    nxt = None
    if sess.family == "dct":
        if z != Z.DCT_AG:
            raise Bad("compressed_kind")
        codec, vkind, nparts, prev_round = r.struct(_DCT_AG)
        _same_codec(sess, codec)
        bm, bmp = _bitmaps(r, nparts, len(parts), vkind)
        nvals = r.count(n)
        idx = r.indices(nvals, n)
    else:
        if z != Z.TOPK_AG:
            raise Bad("compressed_kind")
        codec, vkind, nparts, tag, prev_round = r.struct(_TOPK_AG)
        _same_codec(sess, codec)
        bm, bmp = _bitmaps(r, nparts, len(parts), vkind)
        m = topk.block_count(n, sess.block)
        ncur, nnext, nvals = r.count(m), r.count(m), r.count(n)
        cur = r.indices(ncur, m)
        nxt = r.indices(nnext, m)
        ages = r.ages(0 if vkind else ncur)
        if tag != rnd.r:
            raise Bad("compressed_tag")
        idx = topk.block_indices(cur, sess.block, n)
    if vkind != int(sess.param_mode):  # an update where averages belong, or the reverse
        raise Bad("compressed_kind")
    vals = r.coded(nvals, sess.values)
    r.done()
    if nvals != idx.numel():
        raise Bad("compressed_count")
    me = parts.index(rnd.me)
    _resolve(sess, b, c, rnd.r, src, in_bitmap(bm, me))
    if prev_round != NONE:
        _resolve(sess, b, c, prev_round, src, in_bitmap(bmp, me))
    if nxt is not None:
        sess.ann[(b, c)] = (src, rnd.r, nxt)
    if sess.stale is not None and nxt is not None and not vkind:
        off = rnd.plans[b].chunk(c)[0]
        sess.stale.apply(b, off, n, idx + off, topk.per_element(ages, cur, sess.block, n))
    if not vkind:
        return _spread(None, n, idx, vals)
    out = _spread(rnd.plans[b].view(rnd.dst[b], c).to(torch.float32), n, idx, vals)
    if not all_finite(out):  # finite parameters plus a finite update can still overflow
        raise Bad("non_finite")
    return out


def _bitmaps(r: Reader, nparts: int, expect: int, vkind: int) -> tuple[torch.Tensor, torch.Tensor]:
    if nparts != expect or vkind not in (0, 1):
        raise Bad("compressed_count")
    nb = -(-nparts // 8)
    return r.tensor(torch.uint8, nb).clone(), r.tensor(torch.uint8, nb).clone()


def _resolve(sess: CompressSession, b: int, c: int, round_id: int, src: str, counted: bool) -> None:
    """An owner's answer about our contribution of ``round_id``: keep it gone, or restore it."""
    key = (b, c, round_id)
    held = sess.pending.get(key)
    if held is None or held[0] != src:
        return
    del sess.pending[key]
    _, bb, idx, vals = held
    if counted:
        if sess.ledger is not None:
            sess.ledger.confirmed[bb].index_add_(0, idx, vals)
    else:
        sess.e[bb].index_add_(0, idx, vals)
        sess.counters["ef_restored"] += 1
