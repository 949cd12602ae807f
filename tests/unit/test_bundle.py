"""Bundles: several compressed chunks in one packet (``collectives/lossy/bundle.py``).

What must hold: a bundle never exceeds the packet room it was grouped for and
keeps the chunks' order; its records come back byte for byte (the shared prefix
stated once, then each record's own bytes), each as a packet with the bundle's
header and the record's chunk, kind and length; anything malformed (truncated,
lengths or a prefix that do not add up, a count below two, a zero chunk step,
an overlong varint, a nested bundle) is refused whole, never half-read.
"""

from __future__ import annotations

import pytest

from gossipnet.collectives.compress.payload import Z
from gossipnet.collectives.lossy import bundle
from gossipnet.transport.wire import Packet


def _packet(payload: bytes) -> Packet:
    fields = {"r": 3, "m": 0, "L": 7, "b": 1, "c": 4, "z": bundle.BUNDLE, "n": len(payload)}
    return Packet("p1", 1, 9, 20, fields, memoryview(payload))


def test_group_fits_the_room_and_keeps_order() -> None:
    records = [(c, 2, bytes([c]) * size) for c, size in enumerate([100, 300, 50, 900, 40, 10])]
    runs = list(bundle.group(records, 512))
    assert [r[0] for run in runs for r in run] == list(range(6))
    for run in runs:
        if len(run) > 1:
            assert len(bundle.pack(run)) <= 512
    assert [len(run) for run in runs] == [3, 1, 2]  # 900 alone: too large to share


def test_group_fills_the_room_exactly_with_a_shared_prefix() -> None:
    """The size ``group`` plans is the size ``pack`` makes: records sharing a
    30-byte prefix pay it once, so more of them fit than their full lengths say;
    a new payload kind or a chunk that does not increase starts a new run."""
    head = bytes(range(30))
    records = [(c, 3, head + bytes([c]) * 40) for c in range(10)]
    for room in range(150, 700, 7):
        runs = list(bundle.group(records, room))
        for run in runs:
            if len(run) > 1:
                size = len(bundle.pack(run))
                assert size <= room
                nxt = [r for r in records if r[0] == run[-1][0] + 1]
                if nxt:  # one more record would not have fitted
                    assert len(bundle.pack([*run, *nxt])) > room
    # count, kind, prefix length; the prefix once; 3 lengths, 2 chunk steps; 3 x 40 own bytes
    assert len(bundle.pack(records[:3])) == 3 + 30 + 3 + 2 + 3 * 40
    mixed = [(0, 3, head), (1, 4, head), (2, 4, head), (1, 4, head)]
    assert [len(r) for r in bundle.group(mixed, 4096)] == [1, 2, 1]
    with pytest.raises(ValueError, match="increasing"):
        bundle.pack(mixed[1:])


def test_pack_expand_round_trip() -> None:
    run = [(4, 2, b"abc"), (5, 2, b"ab"), (9, 2, b"abc" + b"\x00" * 70), (300, 2, b"a")]
    pkt = _packet(bundle.pack(run))
    parts = bundle.expand(pkt)
    assert parts is not None
    assert [(p.fields["c"], p.fields["z"], p.fields["n"], bytes(p.payload)) for p in parts] == [
        (c, z, len(b), b) for c, z, b in run
    ]
    for p in parts:
        assert (p.src, p.seq, p.kind, p.fields["r"], p.fields["L"], p.fields["b"]) == (
            "p1", 9, 20, 3, 7, 1,
        )  # fmt: skip
    assert (pkt.fields["c"], pkt.fields["z"]) == (4, bundle.BUNDLE)  # the bundle is untouched


def test_varints_round_trip_and_refuse_overlong() -> None:
    for n in (0, 1, 127, 128, 300, 16383, 16384, 2**32 - 1):
        enc = bundle.uvarint(n)
        assert len(enc) == max(1, -(-n.bit_length() // 7))
        assert bundle.read_uvarint(enc + b"rest", 0) == (n, len(enc))
    assert bundle.read_uvarint(b"\x80\x80", 0) is None  # cut short
    assert bundle.read_uvarint(b"\x80" * 5 + b"\x01", 0) is None  # longer than MAX_VARINT


# the good bundle: count 2, kind 2, prefix "a", chunk 4 own "b", step 1 own "c"
GOOD = bytes([2, 2, 1]) + b"a" + bytes([1, 1, 1]) + b"bc"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:-1],  # truncated: lengths exceed the payload
        lambda b: b + b"x",  # trailing bytes: lengths fall short
        lambda b: b[:1],  # cut inside the heads
        lambda b: bytes([1]) + b[1:],  # a count below two
        lambda b: bytes([0xE0, 0xD4, 0x03]) + b[1:],  # more records than bytes
        lambda b: b[:2] + bytes([90]) + b[3:],  # a prefix beyond the payload
        lambda b: b[:5] + bytes([0]) + b[6:],  # a chunk step of 0 (a repeated chunk)
        lambda b: b[:1] + bytes([0xFF, 0xFF, 0x03]) + b[2:],  # the bundle kind itself
        lambda b: b[:2] + b"\x80" * 5 + b"\x00" + b[3:],  # an overlong varint
    ],
    ids=[
        "truncated",
        "trailing",
        "cut-heads",
        "count-one",
        "count-huge",
        "prefix-huge",
        "step-zero",
        "nested-kind",
        "overlong",
    ],
)
def test_malformed_bundles_are_refused_whole(mangle: object) -> None:
    assert bundle.pack([(4, 2, b"ab"), (5, 2, b"ac")]) == GOOD
    assert [bytes(p.payload) for p in bundle.expand(_packet(GOOD)) or []] == [b"ab", b"ac"]
    assert bundle.expand(_packet(mangle(GOOD))) is None  # type: ignore[operator]


def test_nested_bundle_refused() -> None:
    inner = bundle.pack([(1, 2, b"ab"), (2, 2, b"cd")])
    outer = bundle.pack([(1, bundle.BUNDLE, inner), (3, bundle.BUNDLE, b"ef")])
    assert bundle.expand(_packet(outer)) is None


def test_compressor_kinds_stay_below_the_bundle_kind() -> None:
    assert max(Z) < bundle.BUNDLE
