"""The codec's fast path for a drain (``transport/_fast_decode.py``) against the full path.

A drain mixes good data packets with every kind of bad one, most of them with a
sender tail the fast path already knows, so it decides them itself: each must
come out exactly as :meth:`WireCodec.decode` called packet by packet decides it
(the same packets, the same reject reasons and counts), and a bad packet in the
middle of a batch must cost only itself.  A packet whose tail is known but whose
key is not that tail's session (another member's, another incarnation's, none)
is left to the full path.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest
import torch

from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.config import Config
from gossipnet.testing import introduce
from gossipnet.transport import _data_header as fixed
from gossipnet.transport.base import Buffer, LocalFrames
from gossipnet.transport.wire import Packet, WireCodec
from tests.unit.test_wire import codec

DATA = {"r": 7, "m": 2, "L": 0xDEADBEEF, "b": 1, "c": 5, "dt": "f32", "n": 4, "w": 0.5}
PAYLOAD = torch.arange(4, dtype=torch.float32).numpy().tobytes()


def _views(frames: Sequence[Buffer]) -> list[memoryview]:
    """Frames as a socket backend delivers them: byte views of received buffers."""
    return [memoryview(bytes(f)) for f in frames]


def _resigned(signer: WireCodec, frames: Sequence[Buffer], **changes: int) -> list[memoryview]:
    """``frames`` with fields of the fixed header changed, signed again by ``signer``
    with its pair key for ``b`` (a valid MAC, whatever the header now says)."""
    head, payload = bytes(frames[0]), bytes(frames[1])
    names = ("magic", "version", "kind", "mode", "dt", "x", "flags", "src_len", "ndst", "z",
             "run", "epoch", "seq", "r", "L", "b", "c", "n", "w")  # fmt: skip
    values = dict(zip(names, fixed.FIXED.unpack_from(head), strict=True))
    values.update(changes)
    new = fixed.FIXED.pack(*(values[k] for k in names)) + head[fixed.FIXED.size :]
    mac = signer.keys.by_id["b"].send.sign(new, payload) + signer.identity.key_id
    return _views([new, payload, mac])


def _with_mac(frames: Sequence[Buffer], mac: bytes) -> list[memoryview]:
    return _views([frames[0], frames[1], mac])


def _drain(rx: WireCodec, cfg: Config) -> tuple[list[list[memoryview]], int]:
    """A drain of good and bad packets for ``rx`` (``b``) from ``a`` and ``z``, both
    introduced to it, and how many of them the fast path decides.  Made anew for each
    receiver (its own keys), from senders of fixed epochs: the same packets but MACs."""
    tx, other = codec("a", cfg=cfg, epoch=1000), codec("z", cfg=cfg, epoch=2000)
    introduce(tx, other, rx)
    tx.bind("c", 1, codec("c", cfg=cfg).identity.public)  # a peer of a's, not of ours
    kid = tx.identity.key_id
    good = [tx.encode(LossyKind.RS_DATA, {**DATA, "c": c}, PAYLOAD, dst="b") for c in range(9)]
    forged = _views(good[3])
    forged[1] = memoryview(bytes([forged[1][0] ^ 1]) + bytes(forged[1][1:]))
    local = tx.encode(LossyKind.AG_DATA, DATA, PAYLOAD, dst="b", local=True)
    local2 = tx.encode(LossyKind.AG_DATA, DATA, PAYLOAD, dst="b", local=True)
    batch = [
        _views(good[0]),  # first of its sender: the full path, which teaches the tail
        _views(good[1]),
        _resigned(tx, good[2], n=3),  # count: 3 f32 are not 16 bytes
        forged,  # mac
        _views(good[4]),
        _views(good[4]),  # replay
        _resigned(tx, good[5], epoch=(1 << 64) - 1),  # header_fields (epoch > int64): full path
        _resigned(tx, good[6], dt=200),  # dtype: the full path says why
        _resigned(tx, good[6], run=12345),  # run
        _resigned(tx, good[6], version=9),  # version
        _resigned(tx, good[8], flags=fixed.HAS_W),  # tags, unflagged: undirected (full path)
        _views(good[5])[:2],  # frames
        _views(tx.encode(LossyKind.RS_END, {"r": 7}, dst="b")),  # msgpack: full path
        _views(other.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="b")),  # a new sender
        _views(other.encode(LossyKind.RS_DATA, {**DATA, "c": 1}, PAYLOAD, dst="b")),
        LocalFrames(_views(local)),  # a's local token, over a local channel
        _views(local),  # the same bytes from the network: no MAC, rejected (mac)
        _views(good[6]),
        _views(good[7]),
        _views(tx.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="c")),  # not for us: full path
        _resigned(other, good[7]),  # a's header under z's key (impersonation): full path
        _resigned(tx, good[7], epoch=1001),  # another incarnation of a's (full path)
        # z's local token for b under a's key id: a bad tag, decided fast (mac)
        LocalFrames(_with_mac(local2, other.keys.by_id["b"].token_out + kid)),
        _with_mac(good[7], bytes(good[7][2])[:-8] + bytes(8)),  # a key id nobody holds
    ]
    # good[1], count, mac, good[4] x2, second of z, local x2, good 6-7, z's token
    fast = 11
    return batch, fast


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
def test_fast_path_decides_as_the_full_path(mac: str) -> None:
    cfg = Config(mac=mac)
    per_packet, batched = codec("b", cfg=cfg), codec("b", cfg=cfg)
    singles, fast = _drain(per_packet, cfg)
    batch, _ = _drain(batched, cfg)
    want = [per_packet.decode(f, local=type(f) is LocalFrames) for f in singles]
    got = batched.decode_batch(batch)
    assert got == want
    assert batched.rejects == per_packet.rejects
    assert batched.accepted == per_packet.accepted == 10
    assert batched._fast.fast == fast
    assert dict(batched.rejects) == {
        "count": 1, "mac": 4, "replay": 1, "header_fields": 1, "dtype": 1, "run": 1,
        "version": 1, "frames": 1, "impersonation": 1, "epoch_mismatch": 1, "unknown_key": 1,
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
    introduce(tx, rx)
    frames = [_views(tx.encode(LossyKind.RS_DATA, {**DATA, "c": c}, PAYLOAD, dst="b"))
              for c in range(64)]  # fmt: skip
    frames[10][2] = memoryview(bytes(len(frames[10][2]) - 8) + tx.identity.key_id)  # zero tag
    frames[40][0] = frames[40][0][:-1]  # cut header: its tail is unknown, full path
    got = rx.decode_batch(frames)
    assert [i for i, p in enumerate(got) if p is None] == [10, 40]
    assert dict(rx.rejects) == {"mac": 2}
    assert rx._fast.fast == 62  # all but the first (teaches the tail) and the cut one


def test_fast_path_forgets_past_its_bound() -> None:
    """The tail memory is bounded: past it, it starts over (and still decodes)."""
    from gossipnet.transport import _fast_decode

    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    junk = ("x", 1, 0, rx.keys.by_id["a"])
    rx._fast._tails.update({struct.pack("<I", i): junk for i in range(4096)})
    frames = _views(tx.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="b"))
    assert rx.decode_batch([frames])[0] is not None
    assert len(rx._fast._tails) == 1 <= _fast_decode._MAX_TAILS


def test_an_unbound_peer_is_refused_by_both_paths() -> None:
    """Once a peer's keys are released (``unbind``) or bound to a new incarnation, its
    packets are ``unknown_key`` on the full path and in a drain: the fast path forgot
    the tails it had learned under the old session."""
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)

    def drain(n: int) -> list[list[memoryview]]:
        return [_views(tx.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="b")) for _ in range(n)]

    assert all(p is not None for p in rx.decode_batch(drain(4)))
    assert rx._fast.fast == 3  # the first taught the tail
    rx.unbind("a")
    assert rx.decode_batch(drain(4)) == [None] * 4
    assert rx.decode(drain(1)[0]) is None
    assert rx.rejects == {"unknown_key": 5}
    assert rx._fast.fast == 3  # none decided (let alone taken) on the old session
    restarted = codec("a")
    introduce(restarted, rx)  # a's id, a new key and incarnation
    assert rx.decode_batch(drain(2)) == [None, None]
    assert rx.rejects == {"unknown_key": 7}
    new = [_views(restarted.encode(LossyKind.RS_DATA, DATA, PAYLOAD, dst="b")) for _ in range(3)]
    assert all(p is not None and p.epoch == restarted.epoch for p in rx.decode_batch(new))
    assert rx._fast.fast == 5
