"""The codec's fast path for a drain (``transport/_fast_decode.py``) against the full path.

A drain mixes good data packets with every kind of bad one, most of them with a
sender tail the fast path already knows, so it decides them itself: each must
come out exactly as :meth:`WireCodec.decode` called packet by packet decides it
(the same packets, the same reject reasons and counts), and a bad packet in the
middle of a batch must cost only itself.
"""

from __future__ import annotations

import struct

import pytest
import torch

from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.config import Config
from gossipnet.transport import _data_header as fixed
from gossipnet.transport.base import LocalFrames
from gossipnet.transport.wire import Packet, WireCodec
from tests.unit.test_wire import codec

DATA = {"r": 7, "m": 2, "L": 0xDEADBEEF, "b": 1, "c": 5, "dt": "f32", "n": 4, "w": 0.5}
PAYLOAD = torch.arange(4, dtype=torch.float32).numpy().tobytes()


def _views(frames: list[bytes] | list[memoryview]) -> list[memoryview]:
    """Frames as a socket backend delivers them: byte views of received buffers."""
    return [memoryview(bytes(f)) for f in frames]


def _resigned(tx: WireCodec, frames: list[bytes], **changes: int) -> list[memoryview]:
    """``frames`` with fields of the fixed header changed and a valid MAC again."""
    head, payload = bytes(frames[0]), bytes(frames[1])
    names = ("magic", "version", "kind", "mode", "dt", "x", "flags", "src_len", "ndst", "z",
             "run", "epoch", "seq", "r", "L", "b", "c", "n", "w")  # fmt: skip
    values = dict(zip(names, fixed.FIXED.unpack_from(head), strict=True))
    values.update(changes)
    new = fixed.FIXED.pack(*(values[k] for k in names)) + head[fixed.FIXED.size :]
    mac = tx._signer.sign(new, payload) + tx._fingerprint
    return _views([new, payload, mac])


def _drain(tx: WireCodec, other: WireCodec) -> tuple[list[list[memoryview]], int]:
    """A drain of good and bad packets for ``b``, and how many the fast path decides."""
    good = [tx.encode(LossyKind.RS_DATA, {**DATA, "c": c}, PAYLOAD, dst="b") for c in range(9)]
    forged = _views(good[3])
    forged[1] = memoryview(bytes([forged[1][0] ^ 1]) + bytes(forged[1][1:]))
    local = tx.encode(LossyKind.AG_DATA, DATA, PAYLOAD, dst="b", local=True)
    batch = [
        _views(good[0]),  # first of its sender: the full path, which teaches the tail
        _views(good[1]),
        _resigned(tx, good[2], n=3),  # count: 3 f32 are not 16 bytes
        forged,  # mac
        _views(good[4]),
        _views(good[4]),  # replay
        _resigned(tx, good[5], epoch=(1 << 64) - 1),  # header_fields (epoch > int64)
        _resigned(tx, good[6], dt=200),  # dtype: the full path says why
        _resigned(tx, good[6], run=12345),  # run
        _resigned(tx, good[6], version=9),  # version
        _resigned(tx, good[8], flags=fixed.HAS_W),  # tags, unflagged: undirected (full path)
        _views(good[5])[:2],  # frames
        _views(tx.encode(LossyKind.RS_END, {"r": 7}, dst="b")),  # msgpack: full path
        _views(other.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="b")),  # a new sender
        _views(other.encode(LossyKind.RS_DATA, {**DATA, "c": 1}, PAYLOAD, dst="b")),
        LocalFrames(_views(local)),  # unsigned, over a local channel: the fingerprint
        _views(local),  # the same bytes from the network: no MAC, rejected (mac)
        _views(good[6]),
        _views(good[7]),
        _views(tx.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="c")),  # not for us: full path
    ]
    fast = 11  # good[1], count, mac, good[4] x2, epoch, second of other, local x2, good 6-7
    return batch, fast


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
def test_fast_path_decides_as_the_full_path(mac: str) -> None:
    cfg = Config(mac=mac)
    tx, other = codec("a", cfg=cfg), codec("z", cfg=cfg)
    batch, fast = _drain(tx, other)
    per_packet, batched = codec("b", cfg=cfg), codec("b", cfg=cfg)
    want = [per_packet.decode(f, local=type(f) is LocalFrames) for f in batch]
    got = batched.decode_batch(batch)
    assert got == want
    assert batched.rejects == per_packet.rejects
    assert batched.accepted == per_packet.accepted == 10
    assert batched._fast.fast == fast
    assert dict(batched.rejects) == {
        "count": 1, "mac": 2, "replay": 1, "header_fields": 1, "dtype": 1, "run": 1,
        "version": 1, "frames": 1, "destination": 1,
    }  # fmt: skip
    ok = [p for p in got if p is not None]
    assert all(isinstance(p, Packet) for p in ok)
    assert [p.fields.get("c") for p in ok if p.src == "a" and "n" in p.fields] == [
        0,
        1,
        4,
        8,
        5,
        6,
        7,
    ]


def test_a_bad_packet_costs_only_itself() -> None:
    """Every packet after a bad one in the same drain still arrives (batch of 64)."""
    tx, rx = codec("a"), codec("b")
    frames = [_views(tx.encode(LossyKind.RS_DATA, {**DATA, "c": c}, PAYLOAD, dst="b"))
              for c in range(64)]  # fmt: skip
    frames[10][2] = memoryview(bytes(len(frames[10][2])))  # zero MAC: forged
    frames[40][0] = frames[40][0][:-1]  # cut header: its tail is unknown, full path
    got = rx.decode_batch(frames)
    assert [i for i, p in enumerate(got) if p is None] == [10, 40]
    assert dict(rx.rejects) == {"mac": 2}
    assert rx._fast.fast == 62  # all but the first (teaches the tail) and the cut one


def test_fast_path_forgets_past_its_bound() -> None:
    """The tail memory is bounded: past it, it starts over (and still decodes)."""
    from gossipnet.transport import _fast_decode

    tx, rx = codec("a"), codec("b")
    rx._fast._tails.update({struct.pack("<I", i): ("x", 1, 0, False) for i in range(4096)})
    frames = _views(tx.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="b"))
    assert rx.decode_batch([frames])[0] is not None
    assert len(rx._fast._tails) == 1 <= _fast_decode._MAX_TAILS
