"""The compressors' pure functions and the checks on compressed payloads.

No network: value types and their errors, the quantisers' edge cases (an
all-zero chunk, inf/NaN), ARC-Top-K's contractiveness and deterministic sets,
DCT's cap, Accordion's rule, and forged payloads fed to a round's decoders,
each a counted drop, never an exception.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet import DCT, Accordion, ArcTopK, ConfigError, Int8
from gossipnet.clock import FakeClock
from gossipnet.collectives.compress import CompressSession, accordion, budget, dct, quant, topk
from gossipnet.collectives.compress.payload import NONE, Bad, Reader, Z, bitmap, in_bitmap, join
from gossipnet.collectives.compress.spec import resolve
from gossipnet.collectives.lossy import bundle, gather, scatter
from gossipnet.collectives.lossy.round import Round
from gossipnet.transport.wire import Packet

IDS = ("p0", "p1", "p2", "p3")


# --------------------------------------------------------------------------- values
def test_exported_and_validated() -> None:
    assert gossipnet.ArcTopK is ArcTopK
    assert gossipnet.Int8 is Int8
    assert resolve(None) is None
    assert resolve("none") is None
    assert resolve("bf16") == "bf16"
    for bad, words in [
        ("int4", "'bf16', 'fp16'"),
        (3, "gossipnet.ArcTopK"),
    ]:
        with pytest.raises(ConfigError, match=words):
            resolve(bad)
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        ArcTopK(density=0.0)
    with pytest.raises(ConfigError, match="power of two"):
        ArcTopK(block=12)
    with pytest.raises(ConfigError, match="not both"):
        DCT(density=0.1, quantile=0.9)
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        DCT(quantile=1.0)
    with pytest.raises(ConfigError, match="same family"):
        Accordion(low=ArcTopK(density=0.1), high=DCT(density=0.01))
    with pytest.raises(ConfigError, match="lighter"):
        Accordion(low=ArcTopK(density=0.01), high=ArcTopK(density=0.1))
    with pytest.raises(ConfigError, match=r"ArcTopK or gossipnet\.DCT"):
        Accordion(low="bf16", high="bf16")  # type: ignore[arg-type]
    assert DCT(quantile=0.99).keep == pytest.approx(0.01)
    accepted = "'fp32', 'bf16', 'int8'"
    for bad_values in ("fp16", "INT8", 8, None):
        with pytest.raises(ConfigError, match=f"ArcTopK.values must be one of {accepted}"):
            ArcTopK(values=bad_values)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=f"DCT.values must be one of {accepted}"):
            DCT(values=bad_values)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="values alike"):
        Accordion(low=ArcTopK(density=0.1, values="int8"), high=ArcTopK(density=0.01))
    with pytest.raises(ConfigError, match="values alike"):
        Accordion(low=DCT(density=0.1), high=DCT(density=0.01, values="bf16"))
    assert ArcTopK(values="int8").values == "int8"


# --------------------------------------------------------------------------- value codecs
@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_value_codec_round_trip(codec: str) -> None:
    """What a receiver reads back is bit for bit what the sender says it decodes
    (the sender's error feedback and pending rest on it), within the codec's bound."""
    gen = torch.Generator().manual_seed(4)
    for n in (0, 1, 7, 1000):
        x = torch.randn(n, generator=gen) * 3
        parts, decoded = quant.code_values(x, codec)
        data = join(*parts)
        assert len(data) == quant.coded_bytes(codec, n)
        r = Reader(memoryview(data))
        got = r.coded(n, codec)
        r.done()
        assert got.dtype == torch.float32
        assert torch.equal(got, decoded)
        if n == 0:
            continue
        amax = float(x.abs().max())
        bound = {"fp32": 0.0, "bf16": amax / 256, "int8": amax / 254 * (1 + 1e-6)}[codec]
        assert float((decoded - x).abs().max()) <= bound
    _, zero_dec = quant.code_values(torch.zeros(16), codec)
    assert torch.equal(zero_dec, torch.zeros(16))  # int8: scale 0 decodes to zeros


def test_int8_values_keep_small_groups_fine() -> None:
    """One packet carries blocks of layers whose gradients differ by orders of
    magnitude: each group of 16 values gets a power-of-two step of its own, so a
    group 10^4 times smaller than the largest keeps ~2 significant digits instead
    of rounding to zero (one scale per packet), for 1 byte per 16 values."""
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(16, generator=gen)
    small = torch.randn(16, generator=gen) * 1e-4
    x = torch.cat([big, small, torch.zeros(16), small[:5]])  # 53 values: 4 groups
    scale, shifts, q = quant.quantize_grouped_int8(x)
    assert shifts.dtype == torch.uint8
    assert shifts.numel() == quant.group_count(53) == 4
    assert int(shifts[0]) == 0
    assert int(shifts[1]) >= 12
    dec = quant.dequantize_grouped_int8(scale, shifts, q)
    steps = (scale * torch.exp2(-shifts.float())).repeat_interleave(16)[:53]
    assert torch.all((dec - x).abs() <= steps / 2 * (1 + 1e-6))  # half a step, per group
    rel = ((dec[16:32] - small) / small.abs().max()).abs().max()
    assert float(rel) < 1 / 100
    _, one_scale = quant.quantize_int8(x)  # what one scale per packet would do
    assert int((one_scale[16:32] != 0).sum()) == 0  # every small value rounded to 0
    assert torch.equal(dec[32:48], torch.zeros(16))


def test_value_codec_non_finite_is_refused() -> None:
    scale_nan = struct.pack("<f", float("nan")) + bytes(4)
    bf16_inf = struct.pack("<H", 0x7F80)
    for codec, data, count in (("int8", scale_nan, 4), ("bf16", bf16_inf, 1)):
        with pytest.raises(Bad, match="non_finite"):
            Reader(memoryview(data)).coded(count, codec)
    with pytest.raises(Bad, match="compressed_count"):
        Reader(memoryview(bytes(6))).coded(4, "int8")  # scale and 2 of 4 values


@pytest.mark.parametrize("family", ["topk", "dct"])
def test_smaller_values_give_larger_chunks(family: str) -> None:
    """A packet of int8 values holds more of the chunk than one of bf16, which holds
    more than float32 (chunk sizing counts each codec's bytes per value)."""

    def spec(v: str) -> Any:
        return ArcTopK(density=0.01, values=v) if family == "topk" else DCT(density=0.01, values=v)

    sizes = [
        CompressSession(spec(v)).chunk_bytes(16_384, 10**7, 4, 4, False)
        for v in ("fp32", "bf16", "int8")
    ]
    assert sizes[0] < sizes[1] < sizes[2], sizes
    # the optimizer's parameter broadcast is compressed too: the same chunks
    assert CompressSession(spec("int8")).chunk_bytes(16_384, 10**7, 4, 4, True) == sizes[2]


# --------------------------------------------------------------------------- quantisers
def test_int8_error_bound_zero_chunk_and_non_finite() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 5
    scale, q = quant.quantize_int8(x)
    assert (quant.dequantize_int8(scale, q) - x).abs().max() <= scale / 2 + 1e-6
    zs, zq = quant.quantize_int8(torch.zeros(64))
    assert float(zs) == 0.0
    assert torch.equal(quant.dequantize_int8(zs, zq), torch.zeros(64))
    for poison in (float("inf"), float("nan")):
        y = x.clone()
        y[3] = poison
        s, _ = quant.quantize_int8(y)
        assert not torch.isfinite(s)  # the receiver drops it as non_finite (below)
    assert float(quant.to_half(torch.tensor([1e6]), "fp16")[0]) == 65504.0  # saturates


# --------------------------------------------------------------------------- ARC-Top-K
def test_topk_of_own_sketch_is_contractive() -> None:
    """||x - C(x)||^2 <= (1 - k/m) ||x||^2 for C = x at its own k top blocks."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(50):
        n, block = 1000 + trial, 16
        x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4
        m = topk.block_count(n, block)
        k = topk.nblocks_for(n, block, 0.05)
        idx = topk.block_indices(topk.choose_blocks(topk.sketch(x, block) ** 2, k), block, n)
        cx = topk.compress_at(x, idx)
        assert float((x - cx).square().sum()) <= (1 - k / m) * float(x.square().sum()) + 1e-4


def test_topk_sets_are_deterministic() -> None:
    energy = torch.tensor([1.0, 3.0, 3.0, 0.5, 2.0])
    assert topk.choose_blocks(energy, 3).tolist() == [1, 2, 4]  # ties: lower id first
    a = topk.bootstrap_blocks(7, 0, 3, 100, 5)
    assert torch.equal(a, topk.bootstrap_blocks(7, 0, 3, 100, 5))
    assert not torch.equal(a, topk.bootstrap_blocks(8, 0, 3, 100, 5))
    assert topk.block_indices(torch.tensor([0, 2]), 4, 10).tolist() == [0, 1, 2, 3, 8, 9]


def test_dct_threshold_and_cap() -> None:
    u = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    theta = dct.threshold(u, 0.01)
    assert 80 <= dct.select(u, theta, 10_000).numel() <= 120
    capped = dct.select(u, theta, 20)
    assert capped.numel() == 20
    assert bool((capped[1:] > capped[:-1]).all())
    assert float(u.abs()[capped].min()) >= float(u.abs().topk(20).values.min())


def test_accordion_rule() -> None:
    rule = accordion.critical_layers(
        torch.tensor([0.0, 2.0, 2.0]), torch.tensor([1.0, 0.9, 1.5]), 0.5
    )  # no previous norm; -55%; -25%
    assert rule.tolist() == [True, True, False]
    st = accordion.AccordionState(interval=2, threshold=0.5)
    seen = []
    for g in (1.0, 1.0, 1.0, 1.0, 5.0, 5.0):
        st.observe(0, torch.full((4,), g))
        seen.append(st.critical_share(0, 4) == 1.0)
    # first interval critical; then 2 -> 2 (calm); then 2 -> 10 (a jump: critical)
    assert seen == [True, True, True, False, False, True]
    assert st.switches == 2


def test_accordion_decides_per_layer() -> None:
    """Two layers in one bucket: only the one whose accumulated norm jumps turns
    critical, and ARC-Top-K's blocks take their own layer's density."""
    st = accordion.AccordionState(interval=1, threshold=0.5)
    st.set_segments(0, torch.tensor([0, 32]))
    calm, jump = torch.ones(32), torch.ones(32)
    st.observe(0, torch.cat([calm, jump]))  # first interval: both critical
    st.observe(0, torch.cat([calm, jump * 5]))
    held = st.layers(0)
    assert held is not None
    assert held[1].tolist() == [False, True]
    assert st.critical_share(0, 64) == 0.5
    assert accordion.layer_norms(torch.cat([calm, jump * 5]), torch.tensor([0, 32])).tolist() == [
        pytest.approx(32**0.5),
        pytest.approx(5 * 32**0.5),
    ]
    sess = CompressSession(
        Accordion(low=ArcTopK(density=0.5, block=8), high=ArcTopK(density=0.1, block=8), interval=1)
    )
    assert sess.accordion is not None
    sess.set_segments([[0, 32]])
    for g in (torch.cat([calm, jump]), torch.cat([calm, jump * 5])):
        sess.accordion.observe(0, g)
    dens = sess.block_densities(0, 8)
    assert dens is not None
    assert dens.tolist() == [pytest.approx(0.1)] * 4 + [pytest.approx(0.5)] * 4
    # the budget: the top 10% of the calm layer's blocks and 50% of the critical one's
    own = torch.arange(8, dtype=torch.float32) + 1.0
    cut = budget.top_cut(sess, 0, own, 1)
    assert isinstance(cut, torch.Tensor)
    assert int(((own >= cut) & (own > 0)).sum()) == 1 + 2


def test_bitmap_round_trip() -> None:
    flags = torch.tensor([True, False, True, True, False, False, False, False, True])
    bits = bitmap(flags)
    assert bits.numel() == 2
    assert [in_bitmap(bits, i) for i in range(9)] == flags.tolist()


# --------------------------------------------------------------------------- forged payloads
class _Ctx:
    """The part of a PhaseContext the decoders touch."""

    def __init__(self) -> None:
        self.dropped: collections.Counter[str] = collections.Counter()
        self.node = type("N", (), {"clock": FakeClock()})()

    def note_after_end(self, rnd: Any, pkt: Any) -> None:
        pass

    def spans(self, phase: str) -> collections.deque[float]:
        return collections.deque()


def _round(spec: Any, me: str = "p0") -> Round:
    src = [torch.randn(4096, generator=torch.Generator().manual_seed(3))]
    rnd = Round(5, me, IDS, src, [t.clone() for t in src], 1.0, [1024])
    sess = CompressSession(spec)
    rnd.codec = sess
    sess.begin(rnd, False)
    return rnd


def _rs(tag: int, nprop: int, nvals: int, codec: int) -> bytes:
    """A TOPK_RS payload's head (.payload): codec, set tag, then the varint counts."""
    return struct.pack("<BQ", codec, tag) + bundle.uvarint(nprop) + bundle.uvarint(nvals)


def _dct_rs(nnz: int, codec: int) -> bytes:
    return struct.pack("<B", codec) + bundle.uvarint(nnz)


def _ag(
    tag: int,
    prev: int,
    nparts: int,
    ncur: int,
    nnext: int,
    nvals: int,
    vkind: int,
    codec: int,
    bitmaps: bytes = bytes(2),
) -> bytes:
    """A TOPK_AG payload's head: per-round fields, contributor bitmaps, varint counts."""
    counts = b"".join(bundle.uvarint(k) for k in (ncur, nnext, nvals))
    return struct.pack("<BBHQQ", codec, vkind, nparts, tag, prev) + bitmaps + counts


def _pkt(src: str, b: int, c: int, z: int, payload: bytes, w: float = 1.0) -> Packet:
    fields = {"r": 5, "m": 0, "L": 0, "b": b, "c": c, "dt": "u8", "n": len(payload), "z": z, "w": w}
    return Packet(src, 1, 1, 16, fields, memoryview(payload))


@pytest.mark.parametrize(
    ("spec", "z", "payload", "reason"),
    [
        (
            Int8(),
            Z.QUANT,
            struct.pack("<BI", 2, 256) + struct.pack("<f", float("nan")) + bytes(256),
            "non_finite",
        ),
        (Int8(), Z.QUANT, struct.pack("<BI", 2, 255) + bytes(259), "compressed_count"),
        ("bf16", Z.QUANT, struct.pack("<BI", 0, 256) + bytes(100), "compressed_count"),
        ("bf16", Z.TOPK_RS, bytes(20), "compressed_kind"),
        (
            DCT(density=0.05),
            Z.DCT_RS,
            _dct_rs(1, 0) + struct.pack("<I", 99999) + bytes(4),
            "compressed_index",
        ),
        (
            DCT(density=0.05),
            Z.DCT_RS,
            _dct_rs(2, 0) + struct.pack("<II", 5, 3) + bytes(8),
            "compressed_index",
        ),
        (DCT(density=0.05), Z.DCT_RS, _dct_rs(3, 0) + bytes(8), "compressed_count"),
        (
            ArcTopK(density=0.05),
            Z.TOPK_RS,
            _rs(NONE, 1, 0, 0) + bytes(2),
            "compressed_count",
        ),
        (ArcTopK(density=0.05), Z.TOPK_RS, b"\x01", "compressed_short"),
        (
            ArcTopK(density=0.05),
            Z.TOPK_RS,
            _rs(NONE, 1, 0, 0) + struct.pack("<I", 10**6) + bytes(2),
            "compressed_index",
        ),
        (
            ArcTopK(density=0.05),
            Z.TOPK_RS,
            _rs(NONE, 1, 0, 0) + struct.pack("<IH", 0, 0xFFC0),  # bf16 NaN
            "non_finite",
        ),
        (  # a peer with values="fp32" talking to one with "int8": never read as ours
            ArcTopK(density=0.05, values="int8"),
            Z.TOPK_RS,
            _rs(NONE, 0, 1, 0) + struct.pack("<f", 1.0),
            "compressed_kind",
        ),
        (ArcTopK(density=0.05), Z.TOPK_RS, _rs(NONE, 0, 0, 7), "compressed_kind"),
        (ArcTopK(density=0.05), Z.TOPK_RS, _rs(NONE, 10**6, 0, 0), "compressed_count"),
        (
            ArcTopK(density=0.05),
            Z.TOPK_RS,
            struct.pack("<BQ", 0, NONE) + b"\x80" * 5 + b"\x00",
            "compressed_count",
        ),
        (
            ArcTopK(density=0.05),
            Z.TOPK_RS,
            struct.pack("<BQ", 0, NONE) + b"\x80",
            "compressed_short",
        ),
        (
            DCT(density=0.05, values="bf16"),
            Z.DCT_RS,
            _dct_rs(1, 2) + struct.pack("<I", 3) + struct.pack("<fb", 1.0, 5),
            "compressed_kind",
        ),
        (
            ArcTopK(density=0.05, values="int8"),
            Z.TOPK_RS,
            _rs(NONE, 0, 0, 2) + struct.pack("<f", float("inf")),
            "non_finite",
        ),
        (
            DCT(density=0.05, values="bf16"),
            Z.DCT_RS,
            _dct_rs(1, 1) + struct.pack("<IH", 3, 0x7FC0),  # bf16 NaN value
            "non_finite",
        ),
    ],
    ids=[
        "nan-scale",
        "int8-count",
        "bf16-short",
        "wrong-kind",
        "index-beyond",
        "unsorted",
        "dct-count",
        "sketch-count",
        "short",
        "proposal-beyond",
        "nan-sketch",
        "other-codec",
        "unknown-codec",
        "count-beyond",
        "overlong-count",
        "cut-count",
        "dct-other-codec",
        "inf-int8-scale",
        "nan-bf16-value",
    ],
)
def test_forged_contribution_is_a_counted_drop(
    spec: Any, z: int, payload: bytes, reason: str
) -> None:
    rnd = _round(spec, me="p0")
    ctx = _Ctx()
    c = rnd.owned[0].start
    assert scatter.rs_part(ctx, rnd, _pkt("p1", 0, c, z, payload)) is None  # type: ignore[arg-type]
    assert ctx.dropped[reason] == 1, ctx.dropped
    codec = rnd.codec
    assert isinstance(codec, CompressSession)
    assert codec.counters[f"dropped_{reason}"] == 1  # the round's report says so


def test_forged_chunk_fields_and_dense_packets_are_counted() -> None:
    rnd = _round(ArcTopK(density=0.05), me="p0")
    ctx = _Ctx()
    c = rnd.owned[0].start
    other = rnd.maps[0].chunks_of("p1").start
    for pkt in (
        _pkt("p1", 3, c, Z.TOPK_RS, b""),  # no such bucket
        _pkt("p1", 0, 10**6, Z.TOPK_RS, b""),  # no such chunk
        _pkt("p1", 0, other, Z.TOPK_RS, b""),  # not ours
    ):
        assert scatter.rs_part(ctx, rnd, pkt) is None  # type: ignore[arg-type]
    dense = Packet(
        "p1",
        1,
        2,
        16,
        {"r": 5, "m": 0, "L": 0, "b": 0, "c": c, "dt": "f32", "n": 4, "w": 1.0},
        memoryview(bytes(16)),
    )
    assert scatter.rs_part(ctx, rnd, dense) is None  # type: ignore[arg-type]
    assert ctx.dropped == {"bad_chunk": 2, "not_owner": 1, "compressed_kind": 1}


def test_forged_bundles_are_counted_and_their_records_checked_alone() -> None:
    """A malformed bundle (lengths that do not add up, a nested bundle) is one counted
    drop, nothing of it added; a well-formed one whose records are each forged counts
    each record's own reason, as if it had come alone (``collectives/lossy/bundle.py``)."""
    rnd = _round(ArcTopK(density=0.05), me="p0")
    ctx = _Ctx()
    c = rnd.owned[0].start
    other = rnd.maps[0].chunks_of("p1").start
    good = bundle.pack([(c, Z.TOPK_RS, b"x"), (c + 1, Z.TOPK_RS, b"y")])
    nested = bundle.pack([(c, bundle.BUNDLE, good), (c + 1, bundle.BUNDLE, good)])
    for payload in (good[:-1], nested):
        scatter.on_rs(ctx, rnd, _pkt("p1", 0, c, bundle.BUNDLE, payload))  # type: ignore[arg-type]
    assert ctx.dropped == {"bad_bundle": 2}
    forged = bundle.pack([(c, Z.TOPK_RS, b"x"), (other, Z.TOPK_RS, b""), (10**6, Z.TOPK_RS, b"")])
    scatter.on_rs(ctx, rnd, _pkt("p1", 0, c, bundle.BUNDLE, forged))  # type: ignore[arg-type]
    assert ctx.dropped == {
        "bad_bundle": 2,
        "compressed_short": 1,  # a payload too short for its header
        "not_owner": 1,
        "bad_chunk": 1,
    }, ctx.dropped
    assert not rnd.reducers[0].has("p1", c)  # nothing added
    rnd.sending = False
    gather.on_ag(ctx, rnd, _pkt("p1", 0, other, bundle.BUNDLE, good[:-1]))  # type: ignore[arg-type]
    assert ctx.dropped["bad_bundle"] == 3
    assert not rnd.got_np[0][other]


def test_forged_broadcasts_are_counted_drops() -> None:
    rnd = _round(ArcTopK(density=0.05), me="p0")
    rnd.sending = False
    ctx = _Ctx()
    c = rnd.maps[0].chunks_of("p1").start
    bad_set = _ag(5, NONE, 4, 1, 0, 0, 0, 0) + struct.pack("<I", 10**6)
    wrong_parts = _ag(5, NONE, 9, 0, 0, 0, 0, 0, bitmaps=bytes(4))
    nan_vals = (
        _ag(5, NONE, 4, 1, 0, 16, 0, 0)
        + struct.pack("<I", 0)
        + bytes([1])  # the block's age
        + struct.pack("<15f", *[0.0] * 15)
        + struct.pack("<f", float("nan"))
    )
    zero_age = _ag(5, NONE, 4, 1, 0, 0, 0, 0) + struct.pack("<I", 0) + bytes(1)
    # a parameter update (value kind 1, no ages) where this round broadcasts averages
    update = _ag(5, NONE, 4, 1, 0, 16, 1, 0) + struct.pack("<I", 0) + bytes(64)
    for payload in (bad_set, wrong_parts, nan_vals, zero_age, update):
        gather.on_ag(ctx, rnd, _pkt("p1", 0, c, Z.TOPK_AG, payload))  # type: ignore[arg-type]
    assert ctx.dropped == {
        "compressed_index": 1,
        "compressed_count": 1,
        "non_finite": 1,
        "compressed_age": 1,
        "compressed_kind": 1,
    }
    assert not rnd.got_np[0][c]  # nothing written


def test_forged_coded_broadcasts_are_counted_drops() -> None:
    """An int8 peer's broadcasts: another codec's values, a non-finite scale, a count
    that does not match the int8 bytes: each a counted drop, nothing written."""
    rnd = _round(ArcTopK(density=0.05, values="int8"), me="p0")
    rnd.sending = False
    ctx = _Ctx()
    c = rnd.maps[0].chunks_of("p1").start
    cur = struct.pack("<I", 0) + bytes([1])  # set = block 0, its age
    fp32_vals = _ag(5, NONE, 4, 1, 0, 16, 0, 0) + cur + bytes(64)
    inf_scale = _ag(5, NONE, 4, 1, 0, 16, 0, 2) + cur + struct.pack("<f", float("inf")) + bytes(16)
    short = _ag(5, NONE, 4, 1, 0, 16, 0, 2) + cur + struct.pack("<f", 1.0) + bytes(15)
    for payload in (fp32_vals, inf_scale, short):
        gather.on_ag(ctx, rnd, _pkt("p1", 0, c, Z.TOPK_AG, payload))  # type: ignore[arg-type]
    assert ctx.dropped == {"compressed_kind": 1, "non_finite": 1, "compressed_count": 1}
    assert not rnd.got_np[0][c]


def test_values_at_another_set_arrive_with_weight_zero_and_are_counted() -> None:
    """A tag other than the set in force: the packet counts as arrived (its sender is
    complete) with weight 0 and no values, and ``index_mismatch`` counts it."""
    rnd = _round(ArcTopK(density=0.05), me="p0")
    ctx = _Ctx()
    c = rnd.owned[0].start
    payload = _rs(77, 0, 3, 0) + struct.pack("<3f", 1.0, 2.0, 3.0)
    part = scatter.rs_part(ctx, rnd, _pkt("p1", 0, c, Z.TOPK_RS, payload))  # type: ignore[arg-type]
    assert part is not None
    _, _, _, values, weight, _ = part
    assert weight == 0.0
    assert not bool(values.any())
    codec = rnd.codec
    assert isinstance(codec, CompressSession)
    assert codec.counters["index_mismatch"] == 1
    assert "p1" in codec.valueless[(0, c)]  # its bitmap bit will say "not counted"
