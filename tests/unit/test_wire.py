"""Wire codec: round trips, every reject reason, the replay guard, fuzzing.

The MAC is recomputed here from the format's definition (not through the
codec) so that a header of our choosing can be signed validly: that is how
the checks after authentication are reached, and it pins the byte format.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
from typing import Any

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossipnet.clock import FakeClock
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.config import Config
from gossipnet.runtime.kinds import NodeKind
from gossipnet.transport import wire
from gossipnet.transport._dest import DestTags
from gossipnet.transport.wire import (
    DTYPE_CODES,
    DTYPES,
    Packet,
    WireCodec,
    encode_tensor_fields,
)

SECRET = b"unit-test-secret"
CFG = Config()
FAST = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)


def codec(
    src: str = "a", *, cfg: Config = CFG, secret: bytes | None = SECRET, **kw: Any
) -> WireCodec:
    return WireCodec(secret, cfg, src, clock=FakeClock(), **kw)


def run_key(secret: bytes = SECRET, run: str = "gossipnet") -> bytes:
    return hmac.new(secret, b"gossipnet/v1/" + run.encode(), hashlib.sha256).digest()


def sign(
    head: bytes,
    payload: bytes = b"",
    *,
    secret: bytes = SECRET,
    run: str = "gossipnet",
    nonce: bytes = bytes(12),
) -> list[bytes]:
    """Frames for ``head``/``payload`` with a valid AES-GMAC (the default), built from the spec."""
    msg = len(head).to_bytes(4, "big") + head + payload
    tag = AESGCM(run_key(secret, run)).encrypt(nonce, b"", msg)
    return [head, payload, tag + nonce + fingerprint(secret, run)]


def fingerprint(secret: bytes = SECRET, run: str = "gossipnet") -> bytes:
    """The key fingerprint closing every MAC frame, from the spec."""
    return hashlib.blake2b(b"fingerprint", key=run_key(secret, run), digest_size=8).digest()


def header(**overrides: Any) -> bytes:
    h: dict[str, Any] = {"v": 2, "run": "gossipnet", "src": "x", "e": 1, "q": 0, "k": 1}
    h.update(overrides)
    return msgpack.packb({k: v for k, v in h.items() if v is not _DROP})


_DROP = object()


def tensor_bytes(t: torch.Tensor) -> bytearray:
    return bytearray(t.contiguous().view(torch.uint8).numpy().tobytes())


# --------------------------------------------------------------------------- API


def test_public_names_are_pinned() -> None:
    assert wire.__all__ == (
        "DTYPES",
        "DTYPE_CODES",
        "MAC_BYTES",
        "RESERVED_KEYS",
        "VERSION",
        "Packet",
        "Suspect",
        "WireCodec",
        "encode_tensor_fields",
    )


def test_dtype_tables_are_inverse() -> None:
    assert set(DTYPES) == {"f32", "f16", "bf16", "f64", "i64", "i32", "u8"}
    assert {DTYPES[c]: c for c in DTYPES} == DTYPE_CODES


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype(code: str, mac: str) -> None:
    cfg = Config(mac=mac)
    tx, rx = codec("a", cfg=cfg), codec("b", cfg=cfg)
    t = (torch.arange(37, dtype=torch.float64) * 1.5).to(DTYPES[code])
    fields = {**encode_tensor_fields(t), "round": 3, "chunk": 1}
    frames = [bytearray(f) for f in tx.encode(LossyKind.RS_DATA, fields, tensor_bytes(t))]
    pkt = rx.decode(frames)
    assert isinstance(pkt, Packet)
    assert (pkt.src, pkt.epoch, pkt.seq, pkt.kind) == ("a", tx.epoch, 0, LossyKind.RS_DATA)
    assert pkt.fields == {"dt": code, "n": 37, "round": 3, "chunk": 1}
    out = torch.frombuffer(pkt.payload, dtype=DTYPES[pkt.fields["dt"]])
    assert torch.equal(out, t)
    assert rx.accepted == 1
    assert not rx.rejects


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
# both sides of the one-shot/streaming GMAC split (_mac._ONESHOT_MAX = 64 KiB)
@pytest.mark.parametrize("size", [2, 9000, 64 * 1024, 64 * 1024 + 1])
def test_mac_is_the_documented_construction(mac: str, size: int) -> None:
    tx = codec(cfg=Config(mac=mac, run="r1"), epoch=7)
    payload = bytes(range(256)) * (size // 256) + b"p" * (size % 256)
    head, _, frame = tx.encode(NodeKind.HELLO, {"x": 1}, payload)
    key = run_key(run="r1")
    msg = len(head).to_bytes(4, "big") + bytes(head) + payload
    tag, fp = frame[:-8], frame[-8:]
    assert fp == fingerprint(run="r1")
    if mac == "blake2b":
        expected = hashlib.blake2b(msg, key=key, digest_size=16).digest()
    elif mac == "aes-gmac":
        assert len(frame) == tx.mac_bytes == 36
        expected = AESGCM(key).encrypt(tag[16:], b"", msg) + tag[16:]
    else:
        expected = hmac.new(key, msg, hashlib.sha256).digest()[:16]
    assert tag == expected
    assert codec("b", cfg=Config(mac=mac, run="r1")).decode([head, payload, frame]) is not None
    assert msgpack.unpackb(head) == {
        "v": 2,
        "run": "r1",
        "src": "a",
        "e": 7,
        "q": 0,
        "k": 1,
        "x": 1,
    }


def test_payload_is_not_copied() -> None:
    buf = bytearray(b"abcdefgh")
    view = memoryview(buf)
    frames = codec().encode(LossyKind.BCAST, None, view)
    assert frames[1] is view
    recv = [bytearray(f) for f in frames]
    pkt = codec("b").decode(recv)
    assert pkt is not None
    recv[1][0] = ord("Z")  # the packet's payload is a view of the received frame
    assert bytes(pkt.payload[:1]) == b"Z"


def test_typed_memoryview_payload_is_viewed_as_bytes() -> None:
    t = torch.ones(5, dtype=torch.float32)
    frames = codec().encode(LossyKind.RS_DATA, encode_tensor_fields(t), memoryview(t.numpy()))
    assert len(frames[1]) == 20
    assert codec("b").decode(frames) is not None


def test_seq_increases_and_own_packets_reflected_back_are_rejected() -> None:
    """Issue 19: a peer took ~1,800 of its own packets reflected back to it."""
    c, rx = codec("self", epoch=42), codec("b")
    pkts = [rx.decode(c.encode(NodeKind.HEARTBEAT)) for _ in range(3)]
    assert [(p.src, p.epoch, p.seq) for p in pkts if p] == [("self", 42, i) for i in range(3)]
    assert all(c.decode(c.encode(NodeKind.HEARTBEAT, dst=d)) is None for d in ("self", None))
    assert c.rejects["own_packet"] == 2
    assert c.accepted == 0


@pytest.mark.parametrize("key", sorted(wire.RESERVED_KEYS))
def test_reserved_keys_cannot_be_overridden(key: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        codec().encode(NodeKind.HELLO, {key: 1})


def test_encode_refuses_what_a_peer_would_drop() -> None:
    c = codec(cfg=Config(max_header_bytes=64, max_payload_bytes=128))
    with pytest.raises(ValueError, match="max_header_bytes"):
        c.encode(NodeKind.HELLO, {"s": "x" * 64})
    with pytest.raises(ValueError, match="max_payload_bytes"):
        c.encode(NodeKind.HELLO, None, b"x" * 129)
    with pytest.raises(ValueError, match="kind"):
        c.encode(-1)
    with pytest.raises(ValueError, match="dtype"):
        encode_tensor_fields(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError):
        c.encode(NodeKind.HELLO, {"obj": object()})
    with pytest.raises(TypeError):
        c.encode(NodeKind.HELLO, {1: "non-str key"})


# --------------------------------------------------------------------------- rejects


def _valid(**kw: Any) -> list[bytes]:
    return list(codec("a", **kw).encode(NodeKind.HELLO, {"addr": "mem://a"}, b"payload"))


def _tag() -> bytes:
    return sign(header(), b"payload")[2]


def _flip(frames: list[bytes], i: int, byte: int = 0) -> list[bytes]:
    out = list(frames)
    b = bytearray(out[i])
    b[byte] ^= 1
    out[i] = bytes(b)
    return out


REJECTS: list[tuple[str, Any, str]] = [
    ("no frames", lambda: [], "frames"),
    ("two frames", lambda: _valid()[:2], "frames"),
    ("four frames", lambda: [*_valid(), b""], "frames"),
    ("not buffers", lambda: [None, 1, "x"], "frames"),
    ("not a sequence", lambda: 12345, "frames"),
    ("dict frames", lambda: {1: b"", 2: b"", 3: b""}, "frames"),
    ("header too large", lambda: [b"\x80" * 4096, b"", b"0" * 16], "header_size"),
    (
        "payload too large",
        lambda: [b"\x80", bytes(CFG.max_payload_bytes + 1), b"0" * 16],
        "payload_size",
    ),
    ("short mac", lambda: [*_valid()[:2], _valid()[2][:15]], "mac_size"),
    ("flipped header", lambda: _flip(_valid(), 0, 3), "mac"),
    ("flipped payload", lambda: _flip(_valid(), 1), "mac"),
    ("flipped mac", lambda: _flip(_valid(), 2, 15), "mac"),
    ("flipped nonce", lambda: _flip(_valid(), 2, 20), "mac"),
    ("wrong secret", lambda: _valid(secret=b"other"), "mac"),
    ("no secret", lambda: _valid(secret=None), "mac"),
    ("other run", lambda: _valid(cfg=Config(run="other")), "mac"),
    ("other mac algorithm", lambda: _valid(cfg=Config(mac="blake2b")), "mac_size"),
    ("bytes moved across frames", lambda: [*sign(header() + b"p", b"ayload")[:2], _tag()], "mac"),
    ("list header", lambda: sign(msgpack.packb([1, 2])), "header_parse"),
    ("int header", lambda: sign(msgpack.packb(7)), "header_parse"),
    ("garbage header", lambda: sign(b"\xc1\xc1"), "header_parse"),
    ("trailing bytes", lambda: sign(header() + b"\x00"), "header_parse"),
    ("int map key", lambda: sign(msgpack.packb({1: 2})), "header_parse"),
    ("ext type", lambda: sign(msgpack.packb({"x": msgpack.ExtType(1, b"ab")})), "header_parse"),
    ("deep nesting", lambda: sign(b"\x81\xa1x" + b"\x91" * 2000 + b"\x00"), "header_parse"),
    ("empty header", lambda: sign(b""), "header_parse"),
    ("version 3", lambda: sign(header(v=3)), "version"),
    ("version 1", lambda: sign(header(v=1)), "version"),
    ("version true", lambda: sign(header(v=True)), "version"),
    ("no version", lambda: sign(header(v=_DROP)), "version"),
    ("run field mismatch", lambda: sign(header(run="other")), "run"),
    ("src not str", lambda: sign(header(src=5)), "header_fields"),
    ("empty src", lambda: sign(header(src="")), "header_fields"),
    ("epoch str", lambda: sign(header(e="1")), "header_fields"),
    ("negative seq", lambda: sign(header(q=-1)), "header_fields"),
    ("missing seq", lambda: sign(header(q=_DROP)), "header_fields"),
    ("kind bool", lambda: sign(header(k=True)), "header_fields"),
    ("kind float", lambda: sign(header(k=1.0)), "header_fields"),
    ("unknown dtype", lambda: sign(header(dt="f128", n=1), b"x" * 16), "dtype"),
    ("dtype not str", lambda: sign(header(dt=4, n=1), b"x" * 4), "dtype"),
    ("count mismatch", lambda: sign(header(dt="f32", n=3), b"x" * 8), "count"),
    ("count missing", lambda: sign(header(dt="f32"), b"x" * 8), "count"),
    ("count bool", lambda: sign(header(dt="u8", n=True), b"x"), "count"),
    ("count negative", lambda: sign(header(dt="u8", n=-1), b""), "count"),
    ("count float", lambda: sign(header(dt="u8", n=1.0), b"x"), "count"),
]


@pytest.mark.parametrize(
    ("frames", "reason"), [r[1:] for r in REJECTS], ids=[r[0] for r in REJECTS]
)
def test_rejected_and_counted(frames: Any, reason: str) -> None:
    rx = codec("b")
    assert rx.decode(frames()) is None
    assert rx.rejects == {reason: 1}
    assert rx.accepted == 0


def test_accepts_the_forged_template_when_valid() -> None:
    """The signing helper itself is right: its untouched packets are accepted."""
    rx = codec("b")
    assert rx.decode(sign(header(dt="f32", n=2, extra=[1, "s", 2.5, None]), b"x" * 8)) is not None
    assert rx.decode(sign(header(q=1, k=60000))) is not None


# --------------------------------------------------------------------------- replay guard


def test_identical_packet_is_dropped_as_replay() -> None:
    tx, rx = codec("a"), codec("b")
    frames = tx.encode(NodeKind.HEARTBEAT)
    assert rx.decode(frames) is not None
    assert rx.decode(frames) is None
    assert rx.decode([bytes(f) for f in frames]) is None
    assert rx.rejects == {"replay": 2}


def test_reordered_within_window_accepted_once() -> None:
    tx, rx = codec("a"), codec("b")
    packets = [tx.encode(LossyKind.RS_DATA, {"i": i}) for i in range(200)]
    order = list(range(200))
    random.Random(7).shuffle(order)
    got = [rx.decode(packets[i]) for i in order]
    assert sorted(p.fields["i"] for p in got if p) == list(range(200))
    assert all(rx.decode(packets[i]) is None for i in order)
    assert rx.rejects == {"replay": 200}
    assert rx.accepted == 200


def test_older_than_window_is_replay_and_big_jump_resets_window() -> None:
    cfg = Config(replay_window_packets=8)
    tx, rx = codec("a", cfg=cfg), codec("b", cfg=cfg)
    packets = [tx.encode(NodeKind.HEARTBEAT) for _ in range(100)]
    assert rx.decode(packets[20]) is not None
    assert rx.decode(packets[13]) is not None  # 7 behind: inside the window
    assert rx.decode(packets[12]) is None  # 8 behind: outside
    assert rx.decode(packets[90]) is not None  # jump past the whole window
    assert rx.decode(packets[85]) is not None
    assert rx.decode(packets[85]) is None
    assert rx.decode(packets[20]) is None
    assert rx.rejects == {"replay": 3}


def test_old_epoch_rejected_new_epoch_resets() -> None:
    rx = codec("b")
    mid = codec("a", epoch=100)
    for _ in range(5):
        assert rx.decode(mid.encode(NodeKind.HEARTBEAT)) is not None
    assert rx.decode(codec("a", epoch=99).encode(NodeKind.HEARTBEAT)) is None
    assert rx.rejects == {"stale_epoch": 1}
    restarted = codec("a", epoch=101)
    assert (pkt := rx.decode(restarted.encode(NodeKind.HELLO))) is not None
    assert (pkt.epoch, pkt.seq) == (101, 0)
    assert rx.decode(mid.encode(NodeKind.HEARTBEAT)) is None
    assert rx.rejects == {"stale_epoch": 2}


def test_senders_have_independent_windows() -> None:
    rx, a, b = codec("r"), codec("a"), codec("b")
    assert rx.decode(a.encode(NodeKind.HELLO)) is not None
    assert rx.decode(b.encode(NodeKind.HELLO)) is not None  # seq 0 again, other sender


def test_forget_keeps_old_packets_out_but_lets_the_peer_return() -> None:
    tx, rx = codec("a"), codec("b")
    old = [tx.encode(NodeKind.HEARTBEAT) for _ in range(10)]
    assert rx.decode(old[9]) is not None
    rx.forget("a")
    rx.forget("never-seen")
    assert rx.decode(old[9]) is None
    assert rx.decode(old[5]) is None  # never delivered, but it predates the departure
    assert rx.decode(tx.encode(NodeKind.HELLO)) is not None
    assert rx.decode(codec("a").encode(NodeKind.HELLO)) is not None  # a restart


# --------------------------------------------------------------------------- logging


def test_reject_log_is_rate_limited_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rx = WireCodec(SECRET, Config(reject_log_interval_s=5.0), "b", clock=clock)
    caplog.set_level(logging.DEBUG, logger=wire.__name__)
    for _ in range(100):
        rx.decode([b"x"])
        rx.decode(_flip(_valid(), 1))
    assert [r.getMessage().split(" for ")[1].split()[0] for r in caplog.records] == [
        "frames",
        "mac",
    ]
    caplog.clear()
    clock.advance(5.0)
    rx.decode([b"x"])
    (record,) = caplog.records
    assert "dropped 100 packet(s) for frames" in record.getMessage()
    assert record.levelno == logging.WARNING
    assert rx.rejects == {"frames": 101, "mac": 100}


# --------------------------------------------------------------------------- fuzzing

frame_values = st.one_of(
    st.binary(max_size=64),
    st.none(),
    st.integers(),
    st.text(max_size=4),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=28, max_size=28),
)


@FAST
@given(st.lists(frame_values, max_size=5))
def test_random_frames_never_raise_never_accepted(frames: list[Any]) -> None:
    rx = codec("b")
    assert rx.decode(frames) is None
    assert sum(rx.rejects.values()) == 1
    assert "internal" not in rx.rejects


@FAST
@given(
    frame=st.integers(0, 2),
    bit=st.integers(0, 10_000),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
)
def test_mutated_valid_packets_are_rejected(frame: int, bit: int, cut: int | None) -> None:
    frames = [
        bytearray(f) for f in codec("a").encode(LossyKind.RS_DATA, {"dt": "u8", "n": 24}, bytes(24))
    ]
    target = frames[frame]
    if cut is not None:
        del target[cut % max(1, len(target)) :]
        if frame == 1 and not target:
            target.append(0)  # an empty payload must still differ from the original
    else:
        target[(bit // 8) % len(target)] ^= 1 << (bit % 8)
    rx = codec("b")
    assert rx.decode(frames) is None
    assert set(rx.rejects) <= {"mac", "mac_size"}


scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
field_key = st.text(min_size=1, max_size=6).filter(
    lambda k: k not in wire.RESERVED_KEYS and k != "dt"
)


@FAST
@given(st.dictionaries(field_key, st.one_of(scalar, st.lists(scalar, max_size=4)), max_size=6))
def test_caller_fields_round_trip(fields: dict[str, Any]) -> None:
    pkt = codec("b").decode(codec("a").encode(LossyKind.ROUND, fields, b"xyz"))
    assert pkt is not None
    assert pkt.fields == fields
    assert bytes(pkt.payload) == b"xyz"


def test_ten_thousand_random_packets_leave_the_codec_working() -> None:
    rng = random.Random(20240601)
    tx, rx = codec("a"), codec("b")
    stranger = codec("a", secret=b"stranger")
    history: list[list[bytes]] = []
    fresh = 0
    for _ in range(10_000):
        roll = rng.random()
        if roll < 0.2:
            frames = [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.randrange(0, 5))]
        elif roll < 0.4:
            frames = [
                bytearray(f) for f in tx.encode(LossyKind.RS_DATA, {"i": 1}, rng.randbytes(32))
            ]
            victim = frames[rng.randrange(3)] or frames[0]
            victim[rng.randrange(len(victim))] ^= 1 << rng.randrange(8)
        elif roll < 0.5:
            frames = list(stranger.encode(NodeKind.HELLO))
        elif roll < 0.6:
            frames = [bytes(f) for f in tx.encode(LossyKind.RS_DATA)][: rng.randrange(3)]
        elif roll < 0.8 and history:
            frames = rng.choice(history)  # a replay (or a late first delivery)
        else:
            frames = [bytes(f) for f in tx.encode(LossyKind.AG_DATA, {"i": 2}, rng.randbytes(8))]
            history.append(frames)
            fresh += 1
        rx.decode(frames)
    assert rx.accepted == fresh  # every fresh packet in, every replay and forgery out
    assert "internal" not in rx.rejects
    assert rx.decode(tx.encode(NodeKind.HELLO, {"ok": True})) is not None


def test_gmac_nonces_never_repeat_and_large_payloads_verify() -> None:
    tx, rx = codec("a"), codec("b")
    big = bytes(range(256)) * 1024  # 256 KiB: the streaming GMAC path
    frames = [tx.encode(LossyKind.RS_DATA, {"dt": "u8", "n": len(big)}, big) for _ in range(50)]
    nonces = {bytes(f[2][16:]) for f in frames}
    assert len(nonces) == 50
    assert all(rx.decode(f) is not None for f in frames)
    other = codec("c")  # another signer of the same run starts elsewhere in nonce space
    assert bytes(other.encode(NodeKind.HELLO)[2][16:]) not in nonces


# ---------------------------------------------------------------------- local channel
def test_local_packets_skip_the_mac_but_not_the_key() -> None:
    """On a private local channel only the key fingerprint is checked; anywhere else
    an unsigned packet is a forgery."""
    tx, rx = codec("a"), codec("b")
    unsigned = tx.encode(NodeKind.HELLO, {"x": 1}, b"payload", local=True)
    assert bytes(unsigned[2][:-8]) == bytes(tx.mac_bytes - 8)  # no MAC computed
    assert rx.decode(unsigned) is None  # over the network: rejected
    assert rx.rejects["mac"] == 1
    pkt = rx.decode(tx.encode(NodeKind.HELLO, {"x": 2}, b"payload", local=True), local=True)
    assert pkt is not None
    assert pkt.fields == {"x": 2}
    # a signed packet is fine on the local channel too (a sender that did not know)
    assert rx.decode(tx.encode(NodeKind.HELLO, {"x": 3}), local=True) is not None
    # another secret (another job on the same host): its fingerprint differs
    other = codec("c", secret=b"another job's secret")
    assert other.decode(tx.encode(NodeKind.HELLO, None, b"p", local=True), local=True) is None
    assert other.rejects["mac"] == 1
    # every other check still runs: a replay is a replay
    frames = tx.encode(NodeKind.HELLO, None, b"p", local=True)
    assert rx.decode(frames, local=True) is not None
    assert rx.decode(frames, local=True) is None
    assert rx.rejects["replay"] == 1


# ---------------------------------------------------------------------- destinations
def test_packets_are_bound_to_their_destinations() -> None:
    """Issue 19: a packet captured on its way to one peer was fresh to every other.
    Now it names its destinations; one encoding may name many (a broadcast)."""
    tx, b, c, d = codec("a"), codec("b"), codec("c"), codec("d")
    one = tx.encode(LossyKind.RS_DATA, {"i": 1}, b"x", dst="b")
    assert (pkt := b.decode(one)) is not None
    assert pkt.directed
    assert c.decode(one) is None
    assert c.rejects["destination"] == 1
    many = tx.encode(LossyKind.BCAST, {"i": 2}, b"y", dst=["b", "c"])
    assert b.decode(many) is not None
    assert c.decode(many) is not None
    assert d.decode(many) is None
    assert d.rejects["destination"] == 1
    bare = tx.encode(NodeKind.HELLO, {"addr": "mem://a"})  # no id known yet: accepted, undirected
    assert (pkt := d.decode(bare)) is not None
    assert not pkt.directed


def test_a_tag_straddling_two_tags_does_not_match() -> None:
    """Only aligned 4-byte tags count: our tag split across two others is not ours."""
    tags = DestTags(b"k" * 32, "b")
    own = tags.own
    straddle = bytes(2) + own + bytes(2)  # our tag at offset 2 of two "tags"
    assert not tags.for_us(straddle)
    assert tags.for_us(bytes(4) + own)
    assert not tags.for_us(own[:3])


def test_only_packets_that_advance_the_window_are_fresh() -> None:
    tx, rx = codec("a"), codec("b")
    first, second = tx.encode(NodeKind.HEARTBEAT, dst="b"), tx.encode(NodeKind.HEARTBEAT, dst="b")
    assert (pkt := rx.decode(second)) is not None
    assert pkt.fresh
    assert (pkt := rx.decode(first)) is not None  # late, still inside the window
    assert not pkt.fresh
