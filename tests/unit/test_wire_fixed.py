"""The fixed binary header of data packets: its byte layout, every check, batches.

Headers are built here from the layout in ``transport/_data_header.py``'s docstring
(not through the codec) and signed with a bound member's pair key
(``test_wire.forged``), so each check after authentication is reached with a
header of our choosing.  Under the run key (an introduction) a data header is
never taken.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest
import torch

from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.config import Config
from gossipnet.runtime.kinds import NodeKind
from gossipnet.testing import introduce
from gossipnet.transport import _data_header as fixed
from gossipnet.transport.wire import Packet
from tests.unit.test_wire import codec, forged, seal, sign

LAYOUT = struct.Struct("<BBHBBBBBBHIQQQIIIId")
RUN_TAG = int.from_bytes(hashlib.blake2b(b"gossipnet", digest_size=4).digest(), "little")
DATA = {"r": 7, "m": 2, "L": 0xDEADBEEF, "b": 1, "c": 5, "dt": "f32", "n": 4, "w": 0.5}


def spec_header(**kw: Any) -> bytes:
    """A fixed header from the documented layout; ``kw`` overrides its fields."""
    f: dict[str, Any] = {
        "magic": 0xC1, "version": 3, "kind": int(LossyKind.RS_DATA), "mode": 2, "dt": 0,
        "x": 0, "flags": 1, "src": b"x", "tags": b"", "run": RUN_TAG, "epoch": 1, "seq": 0,
        "r": 7, "L": 9, "b": 0, "c": 3, "n": 2, "w": 1.0, "src_len": None, "ndst": None,
    }  # fmt: skip
    f.update(kw)
    src_len = len(f["src"]) if f["src_len"] is None else f["src_len"]
    ndst = len(f["tags"]) // 4 if f["ndst"] is None else f["ndst"]
    head = LAYOUT.pack(
        f["magic"], f["version"], f["kind"], f["mode"], f["dt"], f["x"], f["flags"], src_len,
        ndst, 0, f["run"], f["epoch"], f["seq"], f["r"], f["L"], f["b"], f["c"], f["n"], f["w"],
    )  # fmt: skip
    return head + f["src"] + f["tags"]


def test_layout_is_the_documented_one() -> None:
    assert fixed.FIXED.format == LAYOUT.format
    assert fixed.FIXED.size == 64
    assert fixed.run_tag("gossipnet") == RUN_TAG


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
def test_data_fields_travel_in_the_fixed_header(mac: str) -> None:
    cfg = Config(mac=mac)
    tx, rx = codec("a", cfg=cfg), codec("b", cfg=cfg)
    introduce(tx, rx)
    payload = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    frames = tx.encode(LossyKind.RS_DATA, {**DATA, "x": 3}, payload, dst="b")
    assert bytes(frames[0])[0] == fixed.MAGIC
    pkt = rx.decode(frames)
    assert isinstance(pkt, Packet)
    assert pkt.fields == {**DATA, "x": 3}
    assert (pkt.src, pkt.kind, pkt.directed, pkt.fresh) == ("a", LossyKind.RS_DATA, True, True)
    assert bytes(pkt.payload) == payload
    # a compressed payload's kind (the u16 once reserved) travels fixed too
    zipped = {**DATA, "dt": "u8", "n": len(payload), "z": 3}
    pkt = rx.decode(tx.encode(LossyKind.RS_DATA, zipped, payload, dst="b"))
    assert pkt is not None
    assert pkt.fields == zipped
    no_w = {k: v for k, v in DATA.items() if k != "w"}
    pkt = rx.decode(tx.encode(LossyKind.AG_DATA, no_w, payload, dst=["c", "b"]))
    assert pkt is not None
    assert pkt.fields == no_w
    assert not rx.rejects


PARITY = {"r": 7, "m": 2, "L": 0xDEADBEEF, "b": 1, "g": 3, "gs": 4, "n": 16, "w": 0.5}


def test_parity_fields_travel_in_the_fixed_header() -> None:
    """A parity packet's fields (``g``, ``gs``; no chunk, dtype or ``x``) come out
    as sent, over the full path and the fast one (a drain after the first)."""
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    payload = bytes(range(16))
    no_w = {k: v for k, v in PARITY.items() if k != "w"}
    sent = [
        tx.encode(LossyKind.RS_DATA, PARITY, payload, dst="b"),
        tx.encode(LossyKind.AG_DATA, no_w, payload, dst=["c", "b"]),
        tx.encode(LossyKind.RS_DATA, {**PARITY, "g": 0xFFFF_FFFF, "gs": 255}, payload, dst="b"),
    ]
    for frames in sent:
        head = bytes(frames[0])
        assert head[0] == fixed.MAGIC
        assert LAYOUT.unpack_from(head)[6] & fixed.HAS_G
    got = rx.decode_batch([[memoryview(f) for f in fr] for fr in sent])
    assert [p.fields if p else None for p in got] == [
        PARITY,
        no_w,
        {**PARITY, "g": 0xFFFF_FFFF, "gs": 255},
    ]
    assert all(p is not None and bytes(p.payload) == payload for p in got)
    assert rx._fast.fast == 1  # the third (the first two have other destination tags)
    assert not rx.rejects


@pytest.mark.parametrize(
    "fields",
    [
        {**PARITY, "gs": 256},  # wider than x
        {**PARITY, "g": -1},
        {**PARITY, "c": 1},  # a data field too: neither layout
        {k: v for k, v in PARITY.items() if k != "gs"},
    ],
)
def test_parity_fields_that_do_not_fit_go_in_msgpack(fields: dict[str, Any]) -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    frames = tx.encode(LossyKind.RS_DATA, fields, b"x" * 16, dst="b")
    assert bytes(frames[0])[0] != fixed.MAGIC
    pkt = rx.decode(frames)
    assert pkt is not None
    assert pkt.fields == fields


def test_a_spec_parity_header_is_accepted() -> None:
    """Built from the documented layout: flags bit 4, ``chunk`` = g, ``x`` = gs, u8."""
    rx = codec("b")
    head = spec_header(flags=fixed.HAS_G, c=5, x=7, dt=fixed.DTYPE_ORDER.index("u8"), n=8)
    pkt = rx.decode(forged(rx, head, b"x" * 8))
    assert pkt is not None
    assert pkt.fields == {"r": 7, "m": 2, "L": 9, "b": 0, "g": 5, "gs": 7, "n": 8}


@pytest.mark.parametrize(
    "fields",
    [
        {**DATA, "extra": 1},  # another field: msgpack
        {**DATA, "r": -1},  # outside its field
        {**DATA, "m": 256},
        {**DATA, "c": -1},
        {**DATA, "b": True},  # a bool is not a chunk index
        {**DATA, "dt": "f128"},
        {**DATA, "w": "1"},
        {**DATA, "z": 1 << 16},  # wider than its field
        {k: v for k, v in DATA.items() if k != "L"},  # a required field missing
    ],
)
def test_fields_that_do_not_fit_go_in_msgpack(fields: dict[str, Any]) -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    frames = tx.encode(LossyKind.RS_DATA, fields, b"x" * 16, dst="b")
    assert bytes(frames[0])[0] != fixed.MAGIC
    pkt = rx.decode(frames)
    if fields["dt"] == "f128":  # the msgpack path applies its own checks
        assert pkt is None
        assert rx.rejects == {"dtype": 1}
    else:
        assert pkt is not None
        assert pkt.fields == fields


def test_the_spec_header_is_accepted() -> None:
    """A header of the documented layout under a bound member's pair key; naming no
    destination, it is still for us alone (only we can check its tag)."""
    rx = codec("b")
    pkt = rx.decode(forged(rx, spec_header(), b"x" * 8))
    assert pkt is not None
    assert pkt.fields == {"r": 7, "m": 2, "L": 9, "b": 0, "c": 3, "dt": "f32", "n": 2, "w": 1.0}
    assert (pkt.src, pkt.epoch, pkt.directed, pkt.fresh) == ("x", 1, True, True)


def test_a_data_header_is_never_an_introduction() -> None:
    """Under the run key a fixed header is ``not_member``, even of an introduction
    kind, before any of its fields is read; and member m cannot sign one as x."""
    rx = codec("b", intro_kinds=frozenset({int(LossyKind.RS_DATA), 1}))
    for head in (spec_header(), spec_header(kind=1), spec_header(version=9), b"\xc1"):
        assert rx.decode(sign(head, b"x" * 8)) is None
    assert rx.rejects == {"not_member": 4}
    x, m = codec("x", epoch=1), codec("m")
    introduce(x, m, rx)
    assert rx.decode(seal(m, rx, spec_header(), b"x" * 8)) is None
    assert rx.rejects == {"not_member": 4, "impersonation": 1}
    assert rx.decode(seal(x, rx, spec_header(), b"x" * 8)) is not None


_FAR = (1 << 63) - 1  # an epoch far in the future (within int64)
#: (name, header, reason, the epoch its signer is bound with): each header signed by a
#: bound member ``x`` for a payload of 8 bytes, each failing one check after the MAC.
FIXED_REJECTS: list[tuple[str, bytes, str, int]] = [
    ("short", spec_header()[:40], "header_parse", 1),
    ("version 4", spec_header(version=4), "version", 1),
    ("version 2", spec_header(version=2), "version", 1),
    ("other run", spec_header(run=RUN_TAG ^ 1), "run", 1),
    ("src length", spec_header(src_len=3), "header_parse", 1),
    ("tag count", spec_header(ndst=2), "header_parse", 1),
    ("trailing", spec_header() + b"\0", "header_parse", 1),
    ("empty src", spec_header(src=b""), "header_fields", 1),
    ("src not utf-8", spec_header(src=b"\xff"), "header_fields", 1),
    ("epoch > int64", spec_header(epoch=1 << 63), "header_fields", 1),
    ("seq > int64", spec_header(seq=1 << 63), "header_fields", 1),
    ("own id", spec_header(src=b"b"), "own_packet", 1),
    ("other src", spec_header(src=b"y"), "impersonation", 1),
    ("other epoch", spec_header(epoch=2), "epoch_mismatch", 1),
    ("other dst", spec_header(flags=5, tags=b"abcd"), "destination", 1),
    ("no dst tags", spec_header(flags=5), "destination", 1),
    ("dtype index", spec_header(dt=7), "dtype", 1),
    ("count", spec_header(n=3), "count", 1),
    ("count f64", spec_header(dt=3, n=2), "count", 1),
    ("future epoch", spec_header(epoch=_FAR), "future_epoch", _FAR),
    ("seq range", spec_header(seq=(1 << 62)), "seq_range", 1),
]


@pytest.mark.parametrize(
    ("head", "reason", "epoch"), [r[1:] for r in FIXED_REJECTS], ids=[r[0] for r in FIXED_REJECTS]
)
def test_fixed_rejected_and_counted(head: bytes, reason: str, epoch: int) -> None:
    rx = codec("b")
    assert rx.decode(forged(rx, head, b"x" * 8, epoch=epoch)) is None
    assert rx.rejects == {reason: 1}
    assert rx.accepted == 0


def test_fixed_header_is_authenticated_and_replay_checked() -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    frames = [bytes(f) for f in tx.encode(LossyKind.RS_DATA, DATA, b"x" * 16, dst="b")]
    assert rx.decode(frames) is not None
    assert rx.decode(frames) is None  # the same packet again
    head = bytearray(frames[0])
    head[4] ^= 1  # the dtype byte: signed like the rest
    assert rx.decode([bytes(head), *frames[1:]]) is None
    assert rx.rejects == {"replay": 1, "mac": 1}
    local = tx.encode(LossyKind.RS_DATA, DATA, b"x" * 16, local=True, dst="b")
    assert rx.decode(local) is None  # unsigned, but not on a local channel
    assert rx.rejects["mac"] == 2


def test_destination_tag_of_a_group() -> None:
    """A fixed header for b and c: both take it; d, bound to a, finds no tag of its
    own, and a header naming b and c under a's key for d is not for d either."""
    tx, b, c, d = codec("a"), codec("b"), codec("c"), codec("d")
    introduce(tx, b, c, d)
    frames = tx.encode(LossyKind.AG_DATA, DATA, b"x" * 16, dst=["b", "c"])
    assert b.decode(frames) is not None
    assert c.decode(frames) is not None
    assert d.decode(frames) is None
    assert d.rejects == {"destination": 1}
    assert d.decode(seal(tx, d, bytes(frames[0]), b"x" * 16)) is None
    assert d.rejects == {"destination": 2}


def test_control_packets_stay_msgpack() -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    for frames in (
        tx.encode(NodeKind.HEARTBEAT, {"addr": "mem://a"}, b"", dst="b"),
        tx.encode(NodeKind.HELLO, {"addr": "mem://a"}, b"", intro=True),
    ):
        assert bytes(frames[0])[0] & 0xF0 == 0x80  # a msgpack fixmap
        assert rx.decode(frames) is not None


@pytest.mark.parametrize("local", [False, True])
def test_encode_run_gives_the_packets_encode_gives(local: bool) -> None:
    """``encode_run`` (one checked header, the rest repacked) against ``encode`` per
    packet: the same headers but the sequence numbers, each accepted by both receivers
    with its own fields and payload, a MAC (or local token) of its own per receiver."""
    tx, ref, rx, other = codec("a"), codec("a"), codec("b"), codec("c")
    introduce(tx, rx, other)
    ref.epoch = tx.epoch
    common = {"r": 7, "m": 2, "L": 0xDEADBEEF, "dt": "f32", "w": 0.5, "x": 3}
    rows = [(0, 3, 2), (1, 9, 2), (4, 0, 1)]
    payloads = [memoryview(torch.tensor(v, dtype=torch.float32).numpy()) for v in
                ([1.0, 2.0], [3.0, 4.0], [5.0])]  # fmt: skip
    run = tx.encode_run(LossyKind.RS_DATA, common, rows, payloads, local=local, dst=["b", "c"])
    assert len(run) == 3
    for (b, c, n), pl, frames in zip(rows, payloads, run, strict=True):
        want = ref.encode(LossyKind.RS_DATA, {**common, "b": b, "c": c, "n": n}, pl,
                          local=local, dst=["b", "c"])  # fmt: skip
        assert bytes(frames[0]) == bytes(want[0])  # same seq: both codecs count from 0
        assert bytes(frames[1]) == bytes(pl)
        for receiver in (rx, other):
            pkt = receiver.decode(frames, local=local)
            assert isinstance(pkt, Packet)
            assert (pkt.fields["b"], pkt.fields["c"], pkt.fields["n"]) == (b, c, n)
            assert bytes(pkt.payload) == bytes(pl)
    assert rx.decode(run[1], local=local) is None  # a replay of the second: dropped
    assert rx.rejects["replay"] == 1


@pytest.mark.parametrize("gs", [4, 300])  # 300: wider than x, every packet in msgpack
def test_encode_run_of_parity_packets(gs: int) -> None:
    """``chunk_key="g"``: a stream's parity packets as one run, the same packets
    ``encode`` makes one by one (fixed header where ``gs`` fits, msgpack where not)."""
    tx, ref, rx = codec("a"), codec("a"), codec("b")
    introduce(tx, rx)
    ref.epoch = tx.epoch
    common = {"r": 7, "m": 2, "L": 9, "w": 0.5, "gs": gs}
    rows = [(1, 0, 8), (1, 1, 8), (1, 2, 4)]
    payloads = [b"a" * 8, b"b" * 8, b"c" * 4]
    run = tx.encode_run(LossyKind.RS_DATA, common, rows, payloads, dst="b", chunk_key="g")
    for (b, g, n), pl, frames in zip(rows, payloads, run, strict=True):
        want = ref.encode(LossyKind.RS_DATA, {**common, "b": b, "g": g, "n": n}, pl, dst="b")
        if gs < 256:  # (a msgpack header holds the epoch its codec started with)
            assert bytes(frames[0]) == bytes(want[0])
        assert (bytes(frames[0])[0] == fixed.MAGIC) is (gs < 256)
        pkt = rx.decode(frames)
        assert pkt is not None
        assert pkt.fields == {**common, "b": b, "g": g, "n": n}
        assert bytes(pkt.payload) == pl


def test_encode_run_checks_the_run_once_and_falls_back_to_msgpack() -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    common = {"r": 7, "m": 2, "L": 1, "dt": "f32"}
    with pytest.raises(ValueError, match="rows"):
        tx.encode_run(LossyKind.RS_DATA, common, [(0, 0, 1)], [], dst="b")
    # a chunk index past the fixed header's u32: every packet of the run goes in msgpack
    rows = [(0, 0, 1), (0, 1 << 33, 1)]
    pl = [b"\x00" * 4, b"\x00" * 4]
    run = tx.encode_run(LossyKind.RS_DATA, common, rows, pl, dst="b")
    assert [bytes(f[0])[0] == fixed.MAGIC for f in run] == [True, False]
    assert all(isinstance(rx.decode(f), Packet) for f in run)
    assert tx.encode_run(LossyKind.RS_DATA, common, [], [], dst="b") == []
