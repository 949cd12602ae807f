"""Wire codec: round trips, every reject reason, the replay guard, fuzzing.

The MACs are recomputed here from the format's definition (not through the
codec) so that a header of our choosing can be signed validly: that is how
the checks after authentication are reached, and it pins the byte format.
Two signers, as on the wire: :func:`seal` signs with the pairwise key of a
sender and a receiver (X25519 agreement, HKDF-SHA256 salted with the run key),
:func:`sign` an introduction with the run key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossipnet.clock import FakeClock
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.config import Config
from gossipnet.runtime.kinds import NodeKind
from gossipnet.testing import introduce
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
#: The kinds a node takes signed with the run key (its HELLO); every codec here takes them.
INTRO = frozenset({NodeKind.HELLO})
FAST = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)


def codec(
    src: str = "a",
    *,
    cfg: Config = CFG,
    secret: bytes | None = SECRET,
    intro_kinds: frozenset[int] = INTRO,
    **kw: Any,
) -> WireCodec:
    """A codec of its own key pair, bound to nobody (:func:`introduce` binds)."""
    return WireCodec(secret, cfg, src, clock=FakeClock(), intro_kinds=intro_kinds, **kw)


# ------------------------------------------------------------------ the spec, rebuilt
def run_key(secret: bytes = SECRET, run: str = "gossipnet") -> bytes:
    return hmac.new(secret, b"gossipnet/v1/" + run.encode(), hashlib.sha256).digest()


def fingerprint(secret: bytes = SECRET, run: str = "gossipnet") -> bytes:
    """The run key's fingerprint closing an introduction's MAC frame."""
    return hashlib.blake2b(b"fingerprint", key=run_key(secret, run), digest_size=8).digest()


def key_id(peer_id: str, public: bytes, *, secret: bytes = SECRET, run: str = "gossipnet") -> bytes:
    """The key id closing every pairwise MAC frame: a keyed hash of id and public key."""
    h = hashlib.blake2b(key=run_key(secret, run), digest_size=8, person=b"gossipnet-kid")
    raw = peer_id.encode()
    h.update(len(raw).to_bytes(2, "big") + raw + public)
    return h.digest()


def dest_tag(peer_id: str, *, secret: bytes = SECRET, run: str = "gossipnet") -> bytes:
    """A peer's 4-byte destination tag under the run key."""
    return hashlib.blake2b(
        peer_id.encode(), key=run_key(secret, run), digest_size=4, person=b"gossipnet-dst"
    ).digest()


def pair_key(
    tx: WireCodec, rx: WireCodec, *, secret: bytes = SECRET, run: str = "gossipnet"
) -> bytes:
    """The key ``tx`` signs its packets to ``rx`` with: HKDF-SHA256 of their X25519
    agreement, salted with the run key, per direction (the key ids in ``info``)."""
    shared = tx.identity.agree(rx.identity.public)
    kid = {c: key_id(c.src, c.identity.public, secret=secret, run=run) for c in (tx, rx)}
    info = b"gossipnet/pair/v1" + kid[tx] + kid[rx]
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=run_key(secret, run), info=info).derive(
        shared
    )


def expected_tag(mac: str, key: bytes, head: bytes, payload: bytes, got: bytes) -> bytes:
    """What the signer ``mac`` must give for ``head``/``payload`` under ``key`` (for
    AES-GMAC, with the nonce that ``got`` carries)."""
    msg = len(head).to_bytes(4, "big") + head + payload
    if mac == "blake2b":
        return hashlib.blake2b(msg, key=key, digest_size=16).digest()
    if mac == "aes-gmac":
        nonce = got[16:]
        return AESGCM(key).encrypt(nonce, b"", msg) + nonce
    return hmac.new(key, msg, hashlib.sha256).digest()[:16]


def gmac(key: bytes, head: bytes, payload: bytes, nonce: bytes = bytes(12)) -> bytes:
    """An AES-GMAC signature (``tag || nonce``) of ``len(head) || head || payload``."""
    msg = len(head).to_bytes(4, "big") + head + payload
    return AESGCM(key).encrypt(nonce, b"", msg) + nonce


def sign(
    head: bytes,
    payload: bytes = b"",
    *,
    secret: bytes = SECRET,
    run: str = "gossipnet",
    nonce: bytes = bytes(12),
) -> list[bytes]:
    """Introduction frames for ``head``/``payload``: signed with the run key (AES-GMAC)."""
    key = run_key(secret, run)
    return [head, payload, gmac(key, head, payload, nonce) + fingerprint(secret, run)]


def seal(
    tx: WireCodec, rx: WireCodec, head: bytes, payload: bytes = b"", nonce: bytes = bytes(12)
) -> list[bytes]:
    """Frames for ``head``/``payload`` as ``tx`` would sign them for ``rx`` (AES-GMAC)."""
    kid = key_id(tx.src, tx.identity.public)
    return [head, payload, gmac(pair_key(tx, rx), head, payload, nonce) + kid]


def forged(
    rx: WireCodec, head: bytes, payload: bytes = b"", *, src: str = "x", epoch: int = 1
) -> list[bytes]:
    """``head``/``payload`` signed by a member ``src`` (incarnation ``epoch``) bound at
    ``rx``: whatever the header says, only the checks after the MAC can drop it."""
    tx = codec(src, epoch=epoch)
    introduce(tx, rx)
    return seal(tx, rx, head, payload)


def header(**overrides: Any) -> bytes:
    h: dict[str, Any] = {"v": 3, "run": "gossipnet", "src": "x", "e": 1, "q": 0, "k": 1}
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
    assert wire.VERSION == 3


def test_dtype_tables_are_inverse() -> None:
    assert set(DTYPES) == {"f32", "f16", "bf16", "f64", "i64", "i32", "u8"}
    assert {DTYPES[c]: c for c in DTYPES} == DTYPE_CODES


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype(code: str, mac: str) -> None:
    cfg = Config(mac=mac)
    tx, rx = codec("a", cfg=cfg), codec("b", cfg=cfg)
    introduce(tx, rx)
    t = (torch.arange(37, dtype=torch.float64) * 1.5).to(DTYPES[code])
    fields = {**encode_tensor_fields(t), "round": 3, "chunk": 1}
    frames = [bytearray(f) for f in tx.encode(LossyKind.RS_DATA, fields, tensor_bytes(t), dst="b")]
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
    """A packet to one peer: ``tag || sender's key id``, the tag under the pair key
    (X25519 agreement, HKDF-SHA256 salted with the run key, info naming sender then
    receiver key id), the key id a keyed hash of id and public key."""
    cfg = Config(mac=mac, run="r1")
    tx, rx = codec("a", cfg=cfg, epoch=7), codec("b", cfg=cfg)
    introduce(tx, rx)
    payload = bytes(range(256)) * (size // 256) + b"p" * (size % 256)
    head, _, frame = tx.encode(NodeKind.HEARTBEAT, {"x": 1}, payload, dst="b")
    key = pair_key(tx, rx, run="r1")
    assert key != pair_key(rx, tx, run="r1")  # one key per direction
    tag, kid = bytes(frame[:-8]), bytes(frame[-8:])
    assert kid == tx.identity.key_id == key_id("a", tx.identity.public, run="r1")
    assert len(frame) == tx.mac_bytes == (36 if mac == "aes-gmac" else 24)
    assert tag == expected_tag(mac, key, bytes(head), payload, tag)
    assert rx.decode([head, payload, frame]) is not None
    assert msgpack.unpackb(head) == {
        "v": 3,
        "run": "r1",
        "src": "a",
        "e": 7,
        "q": 0,
        "k": NodeKind.HEARTBEAT,
        "x": 1,
        "@": dest_tag("b", run="r1"),
    }


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
@pytest.mark.parametrize("size", [2, 64 * 1024 + 1])
def test_introduction_mac_is_the_run_key_construction(mac: str, size: int) -> None:
    """An introduction: ``tag || run key fingerprint``, the tag under the run key,
    taken by a receiver that has bound nobody."""
    cfg = Config(mac=mac, run="r1")
    tx = codec(cfg=cfg, epoch=7)
    payload = bytes(range(256)) * (size // 256) + b"p" * (size % 256)
    head, _, frame = tx.encode(NodeKind.HELLO, {"x": 1}, payload, intro=True)
    tag, fp = bytes(frame[:-8]), bytes(frame[-8:])
    assert fp == fingerprint(run="r1")
    assert tag == expected_tag(mac, run_key(run="r1"), bytes(head), payload, tag)
    pkt = codec("b", cfg=Config(mac=mac, run="r1")).decode([head, payload, frame])
    assert pkt is not None
    assert (pkt.directed, pkt.fresh) == (False, False)
    assert msgpack.unpackb(head) == {"v": 3, "run": "r1", "src": "a", "e": 7, "q": 0, "k": 1,
                                     "x": 1}  # fmt: skip


@pytest.mark.parametrize("mac", ["aes-gmac", "hmac-sha256", "blake2b"])
def test_a_packet_for_several_peers_carries_a_tag_for_each(mac: str) -> None:
    """``k >= 2`` destinations: ``dest tags (4k) || tags (s*k) || key id``, each tag under
    that destination's pair key; every destination takes it, and a peer bound to
    the sender but not named finds no tag of its own."""
    cfg = Config(mac=mac)
    tx, b, c, d = (codec(name, cfg=cfg) for name in "abcd")
    introduce(tx, b, c, d)
    frames = tx.encode(LossyKind.BCAST, {"i": 2}, b"y" * 40, dst=["b", "c"])
    head, payload, frame = (bytes(f) for f in frames)
    s = 28 if mac == "aes-gmac" else 16
    assert len(frame) == 4 * 2 + s * 2 + 8
    assert frame[:8] == dest_tag("b") + dest_tag("c")
    assert frame[-8:] == key_id("a", tx.identity.public)
    for i, rx in enumerate((b, c)):
        tag = frame[8 + i * s : 8 + (i + 1) * s]
        assert tag == expected_tag(mac, pair_key(tx, rx), head, payload, tag)
        pkt = rx.decode(frames)
        assert pkt is not None
        assert (pkt.src, pkt.fields, pkt.directed) == ("a", {"i": 2}, True)
    assert d.decode(frames) is None
    assert d.rejects == {"destination": 1}
    # the same destinations in another order: the tags follow the order of dst
    frames = tx.encode(LossyKind.BCAST, {"i": 3}, b"z", dst=["c", "b"])
    assert bytes(frames[2][:8]) == dest_tag("c") + dest_tag("b")
    assert b.decode(frames) is not None
    assert c.decode(frames) is not None


def test_payload_is_not_copied() -> None:
    tx, rx = codec(), codec("b")
    introduce(tx, rx)
    buf = bytearray(b"abcdefgh")
    view = memoryview(buf)
    frames = tx.encode(LossyKind.BCAST, None, view, dst="b")
    assert frames[1] is view
    recv = [bytearray(f) for f in frames]
    pkt = rx.decode(recv)
    assert pkt is not None
    recv[1][0] = ord("Z")  # the packet's payload is a view of the received frame
    assert bytes(pkt.payload[:1]) == b"Z"


def test_typed_memoryview_payload_is_viewed_as_bytes() -> None:
    tx, rx = codec(), codec("b")
    introduce(tx, rx)
    t = torch.ones(5, dtype=torch.float32)
    frames = tx.encode(LossyKind.RS_DATA, encode_tensor_fields(t), memoryview(t.numpy()), dst="b")
    assert len(frames[1]) == 20
    assert rx.decode(frames) is not None


def test_seq_increases_and_own_packets_reflected_back_are_rejected() -> None:
    """Issue 19: a peer took ~1,800 of its own packets reflected back to it.  Ours come
    back under our own key id (for a peer, or for ourselves) or as our introduction."""
    c, rx = codec("self", epoch=42), codec("b")
    introduce(c, rx)
    pkts = [rx.decode(c.encode(NodeKind.HEARTBEAT, dst="b")) for _ in range(3)]
    assert [(p.src, p.epoch, p.seq) for p in pkts if p] == [("self", 42, i) for i in range(3)]
    reflected = [
        c.encode(NodeKind.HEARTBEAT, dst="b"),
        c.encode(NodeKind.HEARTBEAT, dst="self"),  # no key for ourselves: no tag at all
        c.encode(NodeKind.HELLO, {"addr": "mem://self"}, intro=True),
    ]
    assert all(c.decode(f) is None for f in reflected)
    assert c.rejects == {"own_packet": 3}
    assert c.accepted == 0


@pytest.mark.parametrize("key", sorted(wire.RESERVED_KEYS))
def test_reserved_keys_cannot_be_overridden(key: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        codec().encode(NodeKind.HELLO, {key: 1}, dst="b")


def test_encode_refuses_what_a_peer_would_drop() -> None:
    c = codec(cfg=Config(max_header_bytes=64, max_payload_bytes=128))
    with pytest.raises(ValueError, match="max_header_bytes"):
        c.encode(NodeKind.HELLO, {"s": "x" * 64}, dst="b")
    with pytest.raises(ValueError, match="max_payload_bytes"):
        c.encode(NodeKind.HELLO, None, b"x" * 129, dst="b")
    with pytest.raises(ValueError, match="kind"):
        c.encode(-1, dst="b")
    with pytest.raises(ValueError, match="dst"):  # a pairwise packet names its signers
        c.encode(NodeKind.HEARTBEAT)
    with pytest.raises(ValueError, match="dtype"):
        encode_tensor_fields(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError):
        c.encode(NodeKind.HELLO, {"obj": object()}, dst="b")
    with pytest.raises(TypeError):
        c.encode(NodeKind.HELLO, {1: "non-str key"}, dst="b")


def test_a_destination_without_a_key_gets_no_tag() -> None:
    """A packet for a peer we hold no key of is counted (``unkeyed``) and carries no
    tag: that peer drops it, it verifies nowhere."""
    tx, rx = codec(), codec("b")
    tx.bind("c", 1, codec("c").identity.public)  # rx has not introduced itself to tx
    rx.bind("a", tx.epoch, tx.identity.public)
    frames = tx.encode(NodeKind.HEARTBEAT, dst="b")
    assert tx.unkeyed == 1
    assert bytes(frames[2]) == tx.identity.key_id
    assert rx.decode(frames) is None
    assert rx.rejects == {"mac_size": 1}


def test_a_broadcast_counts_each_destination_it_holds_no_key_of() -> None:
    """dst=[b, e] with only b keyed: b verifies its tag; e's copy is counted, per packet."""
    tx, b = codec(), codec("b")
    introduce(tx, b)
    for i in range(3):
        frames = tx.encode(NodeKind.HEARTBEAT, dst=["b", "e"])
        assert tx.unkeyed == i + 1
        assert b.decode(frames) is not None


# --------------------------------------------------------------------------- rejects


def _valid(rx: WireCodec, **kw: Any) -> list[bytes]:
    """A packet to ``rx`` from ``a`` (a codec made with ``kw``), the two introduced."""
    tx = codec("a", **kw)
    introduce(tx, rx)
    return [bytes(f) for f in tx.encode(NodeKind.HEARTBEAT, {"addr": "mem://a"}, b"payload",
                                        dst="b")]  # fmt: skip


def _flip(frames: list[bytes], i: int, byte: int = 0) -> list[bytes]:
    out = list(frames)
    b = bytearray(out[i])
    b[byte] ^= 1
    out[i] = bytes(b)
    return out


def _cut(frames: list[bytes], i: int, keep: slice) -> list[bytes]:
    out = list(frames)
    out[i] = out[i][keep]
    return out


def _moved(rx: WireCodec) -> list[bytes]:
    """A signed packet with one byte moved from the payload into the header."""
    frames = forged(rx, header(), b"payload")
    return [frames[0] + b"p", b"ayload", frames[2]]


def _intro_cut(rx: WireCodec) -> list[bytes]:
    frames = sign(header(), b"")
    return [frames[0], b"", frames[2][1:]]


#: Packets rejected before any header is read: frame shapes, sizes, keys, MACs.
FRAME_REJECTS: list[tuple[str, Callable[[WireCodec], Any], str]] = [
    ("no frames", lambda rx: [], "frames"),
    ("two frames", lambda rx: _valid(rx)[:2], "frames"),
    ("four frames", lambda rx: [*_valid(rx), b""], "frames"),
    ("not buffers", lambda rx: [None, 1, "x"], "frames"),
    ("not a sequence", lambda rx: 12345, "frames"),
    ("dict frames", lambda rx: {1: b"", 2: b"", 3: b""}, "frames"),
    ("header too large", lambda rx: [b"\x80" * 4096, b"", b"0" * 36], "header_size"),
    (
        "payload too large",
        lambda rx: [b"\x80", bytes(CFG.max_payload_bytes + 1), b"0" * 36],
        "payload_size",
    ),
    ("mac frame shorter than a key id", lambda rx: _cut(_valid(rx), 2, slice(None, 7)), "mac_size"),
    ("tag cut short, key id kept", lambda rx: _cut(_valid(rx), 2, slice(1, None)), "mac_size"),
    ("introduction tag cut short", _intro_cut, "mac_size"),
    ("key id cut short", lambda rx: _cut(_valid(rx), 2, slice(None, -1)), "unknown_key"),
    ("flipped header", lambda rx: _flip(_valid(rx), 0, 3), "mac"),
    ("flipped payload", lambda rx: _flip(_valid(rx), 1), "mac"),
    ("flipped tag", lambda rx: _flip(_valid(rx), 2, 15), "mac"),
    ("flipped nonce", lambda rx: _flip(_valid(rx), 2, 20), "mac"),
    ("flipped key id", lambda rx: _flip(_valid(rx), 2, 30), "unknown_key"),
    ("flipped introduction", lambda rx: _flip(sign(header(), b"p"), 1), "mac"),
    # another secret or run: another run key, so its key ids are unknown here
    ("wrong secret", lambda rx: _valid(rx, secret=b"other"), "unknown_key"),
    ("no secret", lambda rx: _valid(rx, secret=None), "unknown_key"),
    ("other run", lambda rx: _valid(rx, cfg=Config(run="other")), "unknown_key"),
    ("other run's introduction", lambda rx: sign(header(), run="other"), "unknown_key"),
    ("other mac algorithm", lambda rx: _valid(rx, cfg=Config(mac="blake2b")), "mac_size"),
    ("bytes moved across frames", _moved, "mac"),
]


@pytest.mark.parametrize(
    ("frames", "reason"), [r[1:] for r in FRAME_REJECTS], ids=[r[0] for r in FRAME_REJECTS]
)
def test_rejected_and_counted(frames: Callable[[WireCodec], Any], reason: str) -> None:
    rx = codec("b")
    got = frames(rx)
    assert rx.decode(got) is None
    assert rx.rejects == {reason: 1}
    assert rx.accepted == 0


#: Authenticated headers (and payloads) of our choosing, each failing one check after
#: the MAC.  Each is tried under a member's pair key and as an introduction.
HEADER_REJECTS: list[tuple[str, bytes, bytes, str]] = [
    ("list header", msgpack.packb([1, 2]), b"", "header_parse"),
    ("int header", msgpack.packb(7), b"", "header_parse"),
    ("garbage header", b"\x81\xc1\xc1", b"", "header_parse"),  # a map, then 0xC1
    ("trailing bytes", header() + b"\x00", b"", "header_parse"),
    ("int map key", msgpack.packb({1: 2}), b"", "header_parse"),
    ("ext type", msgpack.packb({"x": msgpack.ExtType(1, b"ab")}), b"", "header_parse"),
    ("deep nesting", b"\x81\xa1x" + b"\x91" * 2000 + b"\x00", b"", "header_parse"),
    ("empty header", b"", b"", "header_parse"),
    ("version 4", header(v=4), b"", "version"),
    ("version 2", header(v=2), b"", "version"),
    ("version true", header(v=True), b"", "version"),
    ("no version", header(v=_DROP), b"", "version"),
    ("run field mismatch", header(run="other"), b"", "run"),
    ("src not str", header(src=5), b"", "header_fields"),
    ("empty src", header(src=""), b"", "header_fields"),
    ("epoch str", header(e="1"), b"", "header_fields"),
    ("negative seq", header(q=-1), b"", "header_fields"),
    ("missing seq", header(q=_DROP), b"", "header_fields"),
    ("kind bool", header(k=True), b"", "header_fields"),
    ("kind float", header(k=1.0), b"", "header_fields"),
    ("own id", header(src="b"), b"", "own_packet"),
    ("unknown dtype", header(dt="f128", n=1), b"x" * 16, "dtype"),
    ("dtype not str", header(dt=4, n=1), b"x" * 4, "dtype"),
    ("count mismatch", header(dt="f32", n=3), b"x" * 8, "count"),
    ("count missing", header(dt="f32"), b"x" * 8, "count"),
    ("count bool", header(dt="u8", n=True), b"x", "count"),
    ("count negative", header(dt="u8", n=-1), b"", "count"),
    ("count float", header(dt="u8", n=1.0), b"x", "count"),
]


@pytest.mark.parametrize("signer", ["pair", "intro"])
@pytest.mark.parametrize(
    ("head", "payload", "reason"),
    [r[1:] for r in HEADER_REJECTS],
    ids=[r[0] for r in HEADER_REJECTS],
)
def test_authenticated_header_rejected_and_counted(
    head: bytes, payload: bytes, reason: str, signer: str
) -> None:
    rx = codec("b")
    frames = forged(rx, head, payload) if signer == "pair" else sign(head, payload)
    assert rx.decode(frames) is None
    assert rx.rejects == {reason: 1}
    assert rx.accepted == 0


@pytest.mark.parametrize("signer", ["pair", "intro"])
def test_accepts_the_forged_template_when_valid(signer: str) -> None:
    """The signing helpers themselves are right: their untouched packets are accepted."""
    rx = codec("b", intro_kinds=frozenset({1, 60000}))
    make = (lambda h, p=b"": forged(rx, h, p)) if signer == "pair" else sign
    pkt = rx.decode(make(header(dt="f32", n=2, extra=[1, "s", 2.5, None]), b"x" * 8))
    assert pkt is not None
    assert (pkt.src, pkt.epoch, pkt.directed) == ("x", 1, signer == "pair")
    assert rx.decode(make(header(q=1, k=60000))) is not None
    assert not rx.rejects


def test_a_member_cannot_claim_another_id() -> None:
    """A packet under member m's own pair key whose header claims to come from a is
    ``impersonation``, whichever epoch it names; a's own packets still come in."""
    a, m, rx = codec("a"), codec("m"), codec("b")
    introduce(a, m, rx)
    for epoch in (a.epoch, m.epoch):
        assert rx.decode(seal(m, rx, header(src="a", e=epoch))) is None
    assert rx.decode(seal(m, rx, header(src="nobody", e=m.epoch))) is None
    assert rx.rejects == {"impersonation": 3}
    assert rx.decode(seal(m, rx, header(src="m", e=m.epoch))) is not None
    assert rx.decode(a.encode(NodeKind.HEARTBEAT, dst="b")) is not None


def test_a_packet_of_another_incarnation_is_an_epoch_mismatch() -> None:
    """The key is bound to one incarnation: a header naming another epoch under it,
    or a packet from a key bound with another epoch, is ``epoch_mismatch``."""
    tx, rx = codec("a", epoch=7), codec("b")
    introduce(tx, rx)
    assert rx.decode(seal(tx, rx, header(src="a", e=8))) is None
    assert rx.decode(seal(tx, rx, header(src="a", e=6))) is None
    rx.bind("a", 9, tx.identity.public)  # the same key, bound as incarnation 9
    assert rx.decode(tx.encode(NodeKind.HEARTBEAT, dst="b")) is None
    assert rx.rejects == {"epoch_mismatch": 3}
    rx.bind("a", 7, tx.identity.public)
    assert rx.decode(tx.encode(NodeKind.HEARTBEAT, dst="b")) is not None


def test_only_introduction_kinds_travel_under_the_run_key() -> None:
    """Under the run key only the receiver's ``intro_kinds`` are taken; any other kind,
    from a bound member or not, is ``not_member``."""
    tx, rx = codec(), codec("b")
    introduce(tx, rx)
    for kind in (NodeKind.HEARTBEAT, NodeKind.LEAVE, LossyKind.RS_DATA):
        assert rx.decode(tx.encode(kind, {"addr": "mem://a"}, intro=True)) is None
    assert rx.decode(sign(header(k=int(NodeKind.HELLO_ACK)))) is None
    assert rx.rejects == {"not_member": 4}
    assert rx.decode(tx.encode(NodeKind.HELLO, {"addr": "mem://a"}, intro=True)) is not None
    bare = codec("c", intro_kinds=frozenset())  # takes no introduction at all
    assert bare.decode(tx.encode(NodeKind.HELLO, {"addr": "mem://a"}, intro=True)) is None
    assert bare.rejects == {"not_member": 1}


def test_an_unknown_key_is_dropped_before_any_hash() -> None:
    """A key id we hold no session for: a member whose introduction we lack, one of
    another secret although introduced, or a made-up id.  Each is ``unknown_key``."""
    rx = codec("b")
    stranger = codec("s")
    stranger.bind("b", rx.epoch, rx.identity.public)  # it knows us, we do not know it
    other = codec("o", secret=b"another secret")
    introduce(other, rx)  # both bound, but the key ids are made under other run keys
    made_up = _valid(rx)
    made_up[2] = made_up[2][:-8] + b"\x00" * 8
    for frames in (
        stranger.encode(NodeKind.HEARTBEAT, dst="b"),
        other.encode(NodeKind.HEARTBEAT, dst="b"),
        made_up,
    ):
        assert rx.decode(frames) is None
    assert rx.rejects == {"unknown_key": 3}
    assert rx.accepted == 0


def test_introductions_are_taken_but_move_nothing() -> None:
    """An introduction (any member can send one under any name) is accepted from a
    sender nobody bound, undirected and not fresh, as often as it comes: it never
    touches the replay window, so the sender's own packets stay fresh."""
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    pairwise = [tx.encode(NodeKind.HEARTBEAT, dst="b") for _ in range(2)]  # seq 0, 1
    intro = tx.encode(NodeKind.HELLO, {"addr": "mem://a"}, intro=True)  # seq 2
    for _ in range(3):
        pkt = rx.decode(intro)
        assert pkt is not None
        assert (pkt.seq, pkt.directed, pkt.fresh) == (2, False, False)
    assert all((p := rx.decode(f)) is not None and p.fresh for f in pairwise)
    unbound = codec("z").encode(NodeKind.HELLO, {"addr": "mem://z"}, intro=True)
    assert (pkt := rx.decode(unbound)) is not None
    assert pkt.src == "z"
    assert not rx.rejects


# --------------------------------------------------------------------------- replay guard


def test_identical_packet_is_dropped_as_replay() -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    frames = tx.encode(NodeKind.HEARTBEAT, dst="b")
    assert rx.decode(frames) is not None
    assert rx.decode(frames) is None
    assert rx.decode([bytes(f) for f in frames]) is None
    assert rx.rejects == {"replay": 2}


def test_reordered_within_window_accepted_once() -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    packets = [tx.encode(LossyKind.RS_DATA, {"i": i}, dst="b") for i in range(200)]
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
    introduce(tx, rx)
    packets = [tx.encode(NodeKind.HEARTBEAT, dst="b") for _ in range(100)]
    assert rx.decode(packets[20]) is not None
    assert rx.decode(packets[13]) is not None  # 7 behind: inside the window
    assert rx.decode(packets[12]) is None  # 8 behind: outside
    assert rx.decode(packets[90]) is not None  # jump past the whole window
    assert rx.decode(packets[85]) is not None
    assert rx.decode(packets[85]) is None
    assert rx.decode(packets[20]) is None
    assert rx.rejects == {"replay": 3}


def test_old_epoch_rejected_new_epoch_resets() -> None:
    """The window remembers the newest incarnation: an older one bound again (which
    the runtime's admission refuses anyway) is ``stale_epoch``; a restart, bound to its
    new key, counts from zero; the previous life's key is gone (``unknown_key``)."""
    rx = codec("b")
    mid = codec("a", epoch=100)
    introduce(mid, rx)
    for _ in range(5):
        assert rx.decode(mid.encode(NodeKind.HEARTBEAT, dst="b")) is not None
    old = codec("a", epoch=99)
    introduce(old, rx)
    assert rx.decode(old.encode(NodeKind.HEARTBEAT, dst="b")) is None
    assert rx.rejects == {"stale_epoch": 1}
    restarted = codec("a", epoch=101)
    introduce(restarted, rx)
    assert (pkt := rx.decode(restarted.encode(NodeKind.HEARTBEAT, dst="b"))) is not None
    assert (pkt.epoch, pkt.seq) == (101, 0)
    assert rx.decode(mid.encode(NodeKind.HEARTBEAT, dst="b")) is None
    assert rx.rejects == {"stale_epoch": 1, "unknown_key": 1}
    rx.bind("a", 100, mid.identity.public)  # the middle life bound again: the window says no
    assert rx.decode(mid.encode(NodeKind.HEARTBEAT, dst="b")) is None
    assert rx.rejects == {"stale_epoch": 2, "unknown_key": 1}


def test_senders_have_independent_windows() -> None:
    rx, a, b = codec("r"), codec("a"), codec("b")
    introduce(rx, a, b)
    assert rx.decode(a.encode(NodeKind.HEARTBEAT, dst="r")) is not None
    assert rx.decode(b.encode(NodeKind.HEARTBEAT, dst="r")) is not None  # seq 0 again


def test_forget_keeps_old_packets_out_but_lets_the_peer_return() -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    old = [tx.encode(NodeKind.HEARTBEAT, dst="b") for _ in range(10)]
    assert rx.decode(old[9]) is not None
    rx.forget("a")
    rx.forget("never-seen")
    assert rx.decode(old[9]) is None
    assert rx.decode(old[5]) is None  # never delivered, but it predates the departure
    assert rx.decode(tx.encode(NodeKind.HEARTBEAT, dst="b")) is not None
    restarted = codec("a")
    introduce(restarted, rx)
    assert rx.decode(restarted.encode(NodeKind.HEARTBEAT, dst="b")) is not None
    assert rx.rejects == {"replay": 2}


# --------------------------------------------------------------------------- logging


def test_reject_log_is_rate_limited_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    rx = WireCodec(SECRET, Config(reject_log_interval_s=5.0), "b", clock=clock)
    tx = codec("a")
    introduce(tx, rx)
    caplog.set_level(logging.DEBUG, logger=wire.__name__)
    for _ in range(100):
        rx.decode([b"x"])
        rx.decode(_flip([bytes(f) for f in tx.encode(NodeKind.HEARTBEAT, None, b"p", dst="b")], 1))
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
    st.binary(min_size=36, max_size=36),
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
    """One flipped bit or a cut anywhere: never accepted, and dropped at the MAC
    frame (its size, key id or tag), before any header is read."""
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    frames = [
        bytearray(f)
        for f in tx.encode(LossyKind.RS_DATA, {"dt": "u8", "n": 24}, bytes(24), dst="b")
    ]
    target = frames[frame]
    if cut is not None:
        del target[cut % max(1, len(target)) :]
        if frame == 1 and not target:
            target.append(0)  # an empty payload must still differ from the original
    else:
        target[(bit // 8) % len(target)] ^= 1 << (bit % 8)
    assert rx.decode(frames) is None
    assert set(rx.rejects) <= {"mac", "mac_size", "unknown_key"}


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
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    pkt = rx.decode(tx.encode(LossyKind.ROUND, fields, b"xyz", dst="b"))
    assert pkt is not None
    assert pkt.fields == fields
    assert bytes(pkt.payload) == b"xyz"


def test_ten_thousand_random_packets_leave_the_codec_working() -> None:
    rng = random.Random(20240601)
    tx, rx, member = codec("a"), codec("b"), codec("m")
    introduce(tx, rx, member)
    stranger = codec("a", secret=b"stranger")  # claims a's id, holds another secret
    stranger.bind("b", rx.epoch, rx.identity.public)
    history: list[list[bytes]] = []
    fresh = 0
    for _ in range(10_000):
        roll = rng.random()
        frames: Any
        if roll < 0.2:
            frames = [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.randrange(0, 5))]
        elif roll < 0.35:
            frames = [
                bytearray(f)
                for f in tx.encode(LossyKind.RS_DATA, {"i": 1}, rng.randbytes(32), dst="b")
            ]
            victim = frames[rng.randrange(3)] or frames[0]
            victim[rng.randrange(len(victim))] ^= 1 << rng.randrange(8)
        elif roll < 0.4:
            frames = list(stranger.encode(NodeKind.HEARTBEAT, dst="b"))
        elif roll < 0.45:
            frames = seal(member, rx, header(src="a", e=tx.epoch, q=rng.randrange(1 << 20)))
        elif roll < 0.5:
            frames = list(tx.encode(NodeKind.HEARTBEAT, intro=True))  # not an intro kind
        elif roll < 0.6:
            frames = [bytes(f) for f in tx.encode(LossyKind.RS_DATA, dst="b")][: rng.randrange(3)]
        elif roll < 0.8 and history:
            frames = rng.choice(history)  # a replay (or a late first delivery)
        else:
            frames = [
                bytes(f) for f in tx.encode(LossyKind.AG_DATA, {"i": 2}, rng.randbytes(8), dst="b")
            ]
            history.append(frames)
            fresh += 1
        rx.decode(frames)
    assert rx.accepted == fresh  # every fresh packet in, every replay and forgery out
    assert "internal" not in rx.rejects
    assert {"impersonation", "not_member", "unknown_key", "replay", "mac"} <= set(rx.rejects)
    assert rx.decode(tx.encode(NodeKind.HEARTBEAT, {"ok": True}, dst="b")) is not None


def test_gmac_nonces_never_repeat_and_large_payloads_verify() -> None:
    tx, rx, other = codec("a"), codec("b"), codec("c")
    introduce(tx, rx, other)
    big = bytes(range(256)) * 1024  # 256 KiB: the streaming GMAC path
    frames = [
        tx.encode(LossyKind.RS_DATA, {"dt": "u8", "n": len(big)}, big, dst="b") for _ in range(50)
    ]
    nonces = {bytes(f[2][16:28]) for f in frames}
    assert len(nonces) == 50
    assert all(rx.decode(f) is not None for f in frames)
    # another signer starts elsewhere in nonce space
    assert bytes(other.encode(NodeKind.HEARTBEAT, dst="b")[2][16:28]) not in nonces


# ---------------------------------------------------------------------- local channel
def test_local_packets_skip_the_mac_but_not_the_key() -> None:
    """On a private local channel the tag slot carries the pair's local token (no MAC
    computed) and the receiver compares it; anywhere else a token is a forgery."""
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    unsigned = tx.encode(NodeKind.HEARTBEAT, {"x": 1}, b"payload", local=True, dst="b")
    token = tx.keys.by_id["b"].token_out
    assert bytes(unsigned[2]) == token + tx.identity.key_id  # no MAC computed
    assert rx.keys.by_id["a"].token_in == token
    assert rx.decode(unsigned) is None  # over the network: rejected
    assert rx.rejects["mac"] == 1
    frames = tx.encode(NodeKind.HEARTBEAT, {"x": 2}, b"payload", local=True, dst="b")
    pkt = rx.decode(frames, local=True)
    assert pkt is not None
    assert pkt.fields == {"x": 2}
    # a signed packet is fine on the local channel too (a sender that did not know)
    assert rx.decode(tx.encode(NodeKind.HEARTBEAT, {"x": 3}, dst="b"), local=True) is not None
    # another secret (another job on the same host): its key ids are unknown here
    other = codec("c", secret=b"another job's secret")
    introduce(tx, other)
    frames = tx.encode(NodeKind.HEARTBEAT, None, b"p", local=True, dst="c")
    assert other.decode(frames, local=True) is None
    assert other.rejects == {"unknown_key": 1}
    # every other check still runs: a replay is a replay
    frames = tx.encode(NodeKind.HEARTBEAT, None, b"p", local=True, dst="b")
    assert rx.decode(frames, local=True) is not None
    assert rx.decode(frames, local=True) is None
    assert rx.rejects["replay"] == 1


def test_a_local_token_of_another_pair_is_refused() -> None:
    """A token is a secret of one pair and one direction: a's token for c, c's own for
    b, or b's for a, under a's key id, is a bad tag at b; a local packet for b and c
    carries each destination's own token."""
    a, b, c = codec("a"), codec("b"), codec("c")
    introduce(a, b, c)
    head, payload, _ = a.encode(NodeKind.HEARTBEAT, None, b"p", local=True, dst="b")
    kid = a.identity.key_id
    for token in (
        a.keys.by_id["c"].token_out,
        c.keys.by_id["b"].token_out,
        b.keys.by_id["a"].token_out,
    ):
        assert b.decode([head, payload, token + kid], local=True) is None
    assert b.rejects == {"mac": 3}
    both = a.encode(NodeKind.HEARTBEAT, None, b"q", local=True, dst=["b", "c"])
    assert b.decode(both, local=True) is not None
    assert c.decode(both, local=True) is not None
    assert b.decode(a.encode(NodeKind.HEARTBEAT, None, b"r", local=True, dst=["b", "c"])) is None
    assert b.rejects == {"mac": 4}  # tokens are never taken from the network


def test_an_introduction_on_a_local_channel_is_checked_in_full() -> None:
    tx, rx = codec("a"), codec("b")
    introduce(tx, rx)
    head, payload, frame = tx.encode(NodeKind.HELLO, {"addr": "mem://a"}, intro=True, local=True)
    assert rx.decode([head, payload, frame], local=True) is not None  # signed all the same
    zeroed = bytes(len(frame) - 8) + bytes(frame[-8:])  # no tag, the run key's fingerprint
    assert rx.decode([head, payload, zeroed], local=True) is None
    assert rx.rejects == {"mac": 1}


# ---------------------------------------------------------------------- destinations
def test_packets_are_bound_to_their_destinations() -> None:
    """Issue 19: a packet captured on its way to one peer was fresh to every other.
    Now only its destinations hold a tag for it, and its header names them (checked
    after the MAC: a sender's packet signed for c but naming b is refused at c)."""
    tx, b, c, d = codec("a"), codec("b"), codec("c"), codec("d")
    introduce(tx, b, c, d)
    one = tx.encode(LossyKind.RS_DATA, {"i": 1}, b"x", dst="b")
    assert (pkt := b.decode(one)) is not None
    assert pkt.directed
    assert c.decode(one) is None  # the tag is under a's key for b
    assert c.rejects == {"mac": 1}
    many = tx.encode(LossyKind.BCAST, {"i": 2}, b"y", dst=["b", "c"])
    assert b.decode(many) is not None
    assert c.decode(many) is not None
    assert d.decode(many) is None
    assert d.rejects == {"destination": 1}  # no tag of d's among the destinations
    misnamed = seal(tx, c, header(src="a", e=tx.epoch, **{"@": dest_tag("b")}))
    assert c.decode(misnamed) is None
    assert c.rejects == {"mac": 1, "destination": 1}
    bare = tx.encode(NodeKind.HELLO, {"addr": "mem://a"}, intro=True)  # no id known yet
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
    introduce(tx, rx)
    first, second = tx.encode(NodeKind.HEARTBEAT, dst="b"), tx.encode(NodeKind.HEARTBEAT, dst="b")
    assert (pkt := rx.decode(second)) is not None
    assert pkt.fresh
    assert (pkt := rx.decode(first)) is not None  # late, still inside the window
    assert not pkt.fresh
