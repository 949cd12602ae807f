"""Bundles: several compressed chunks in one packet (``collectives/lossy/bundle.py``).

What must hold: a bundle never exceeds the packet room it was grouped for and
keeps the chunks' order; its records come back byte for byte, each as a packet
with the bundle's header and the record's chunk, kind and length; anything
malformed (truncated, lengths that do not add up, a count below two, a nested
bundle) is refused whole, never half-read.
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


def test_pack_expand_round_trip() -> None:
    run = [(4, 2, b"abc"), (5, 3, b""), (9, 2, b"\x00" * 70)]
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


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:-1],  # truncated: lengths exceed the payload
        lambda b: b + b"x",  # trailing bytes: lengths fall short
        lambda b: b[:1],  # cut inside the count
        lambda b: bundle.HEAD.pack(1) + b[2:],  # a count below two
        lambda b: bundle.HEAD.pack(60000) + b[2:],  # more records than bytes
    ],
    ids=["truncated", "trailing", "cut-count", "count-one", "count-huge"],
)
def test_malformed_bundles_are_refused_whole(mangle: object) -> None:
    good = bundle.pack([(1, 2, b"ab"), (2, 2, b"cd")])
    assert bundle.expand(_packet(good)) is not None
    assert bundle.expand(_packet(mangle(good))) is None  # type: ignore[operator]


def test_nested_bundle_refused() -> None:
    inner = bundle.pack([(1, 2, b"ab"), (2, 2, b"cd")])
    outer = bundle.pack([(1, bundle.BUNDLE, inner), (3, 2, b"ef")])
    assert bundle.expand(_packet(outer)) is None


def test_compressor_kinds_stay_below_the_bundle_kind() -> None:
    assert max(Z) < bundle.BUNDLE
