"""The authenticated wire format: ``[header, payload, mac]`` frames.

A packet is a small msgpack map (the header; data packets, whose fields are
always the same, use the fixed binary layout of :mod:`._data_header` instead,
told apart by its first byte), the raw payload (never
msgpack-encoded, so tensor chunks travel without a copy) and a MAC frame.

Who signs.  Every packet but an *introduction* is signed with the pairwise key
of its sender and its receiver (:mod:`.identity`): only those two can compute
it, so a member holding the run secret cannot speak for another.  The MAC
frame is, with ``s`` the signer's tag size (28 bytes for AES-GMAC)::

    for one peer:    tag (s)                          || sender's key id (8)
    for k >= 2:      dest tags (4k) || tags (s * k)    || sender's key id (8)

A broadcast is encoded once and tagged once per destination, each receiver
finding its tag by its destination tag (:mod:`._dest`).  An introduction (a
HELLO carrying the sender's public key: the kinds the runtime names in
``intro_kinds``) is signed with the run key and closed by the run key's
fingerprint instead: any member can send one under any name, so it binds
nothing by itself (:mod:`gossipnet.runtime.admission` decides), never refreshes
liveness and bypasses the members' replay windows.

The receiver rejects with the cheapest failing test, in order: frame count,
sizes, key id (unknown: ``unknown_key``, before any hash), MAC, header parse
(msgpack size limits), version, run, field types and ranges, the sender the
key belongs to (``impersonation``) and its incarnation (``epoch_mismatch``),
destination, dtype/count, replay.  Nothing is parsed before the MAC checks
out; the one exception is a diagnostic: a rejected header is sampled (at most
100 a second, size-limited) for the sender it *claims*, so ``join()`` can name
a peer with another secret (:class:`Suspect`; never acted on).

Why a per-sender replay window, and bounds on epoch and seq: see
:mod:`._replay`.  ``Packet.fresh`` says the packet advanced its sender's
window: only such packets refresh liveness, so a replayed or withheld older
packet cannot keep a dead peer alive.

Rejections are data: ``decode`` returns ``None``, counts the reason in
``codec.rejects`` and logs one record per reason per ``reject_log_interval_s``
(:mod:`._rejects`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard, cast

import msgpack
import torch

from gossipnet.clock import Clock, MonotonicClock
from gossipnet.config import Config
from gossipnet.transport import _data_header as _fixed
from gossipnet.transport._dest import TAG_BYTES, DestTags
from gossipnet.transport._fast_decode import SLOW, FixedFastPath, tag_in
from gossipnet.transport._packet import Packet
from gossipnet.transport._rejects import RejectLog, Suspect
from gossipnet.transport._replay import INT64_MAX, ReplayWindow
from gossipnet.transport.base import Buffer, LocalFrames
from gossipnet.transport.identity import KEY_ID_BYTES, Identity, Keyring, Session
from gossipnet.transport.mac import make_signer, sign_each

__all__ = (
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

log = logging.getLogger(__name__)

VERSION = 3  # 3: pairwise MACs and key ids (identity.py)
MAC_BYTES = 16  # the tag; a one-peer MAC frame is ``WireCodec.mac_bytes`` long (36 for aes-gmac)
#: Bytes of key id (or, for introductions, run key fingerprint) closing every MAC frame.
FINGERPRINT_BYTES = KEY_ID_BYTES
#: Header keys the codec owns; caller fields may not use them.
RESERVED_KEYS = frozenset({"v", "run", "src", "e", "q", "k", "@"})

#: Dtype codes allowed in a typed packet's ``dt`` field.
DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f64": torch.float64,
    "i64": torch.int64,
    "i32": torch.int32,
    "u8": torch.uint8,
}
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
_ITEMSIZE: dict[str, int] = {code: dtype.itemsize for code, dtype in DTYPES.items()}

_KIND_MAX = 0xFFFF


def encode_tensor_fields(t: torch.Tensor) -> dict[str, Any]:
    """The ``{"dt": code, "n": numel}`` fields that describe ``t``'s payload.

    Raises:
        ValueError: ``t``'s dtype has no wire code (see :data:`DTYPES`).
    """
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise ValueError(f"dtype {t.dtype} cannot go on the wire; use one of {sorted(DTYPES)}")
    return {"dt": code, "n": t.numel()}


def _derive_key(secret: bytes, run: str) -> bytes:
    """Per-run key, so packets of another run (same secret) never authenticate."""
    return hmac.new(secret, b"gossipnet/v1/" + run.encode(), hashlib.sha256).digest()


def _fingerprint(key: bytes) -> bytes:
    """Which key signed a packet, for receivers that skip the MAC on a private channel.

    A keyed hash of the run key: it names the key without revealing it, and it
    tells no more about a weak secret than any signed packet does.
    """
    return hashlib.blake2b(b"fingerprint", key=key, digest_size=FINGERPRINT_BYTES).digest()


def _as_bytes_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view (zero-copy), so ``len`` counts bytes."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


#: A destination's sealing: MAC-frame destination tags, the sessions the tags are made
#: with, and how many destinations we hold no key of.
_Sealer = tuple[bytes, tuple[Session, ...], int]


def _uint(x: object) -> TypeGuard[int]:
    # bool is an int subclass and msgpack decodes true/false as bool: refuse it.
    return type(x) is int and 0 <= x <= INT64_MAX


class WireCodec:
    """Encode, authenticate and check packets for one peer.

    Not thread-safe: use one codec from the event-loop thread only.

    Args:
        secret: shared run secret.  ``None`` (or empty) keys introductions with an
            empty secret: corruption and other runs' packets are still dropped,
            and members still cannot speak for each other, but anyone who knows
            the run id can introduce itself and join.
        config: reads ``run``, ``mac``, ``max_header_bytes``,
            ``max_payload_bytes``, ``replay_window_packets``, ``reject_log_interval_s``.
        src: our peer id, stamped on every packet we encode.
        epoch: our incarnation; defaults to ``time.time_ns()`` so a restarted
            peer (a new process) outranks its previous life.  Wall time is the
            point here, not a deadline, hence not the injected clock.
        clock: paces the reject log; defaults to :class:`MonotonicClock`.
        intro_kinds: the kinds that may travel signed with the run key (the
            runtime's HELLO); any other kind must come under a bound peer's key.
    """

    def __init__(
        self,
        secret: bytes | None,
        config: Config,
        src: str,
        *,
        epoch: int | None = None,
        clock: Clock | None = None,
        intro_kinds: frozenset[int] = frozenset(),
    ) -> None:
        if secret is not None and not isinstance(secret, bytes | bytearray | memoryview):
            raise TypeError(f"secret must be bytes (e.g. 'text'.encode()), got {type(secret)}")
        if not isinstance(src, str) or not src:
            raise ValueError(f"src must be a non-empty peer id string, got {src!r}")
        if epoch is not None and not _uint(epoch):
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.config = config
        self.src = src
        self.epoch = time.time_ns() if epoch is None else epoch
        self.clock: Clock = clock or MonotonicClock()
        self.accepted = 0
        self.intro_kinds = frozenset(int(k) for k in intro_kinds)
        key = _derive_key(bytes(secret or b""), config.run)
        self._signer = make_signer(config.mac, key)  # introductions only
        self._sig = self._signer.size
        self._fingerprint = _fingerprint(key)
        #: our key pair; :attr:`keys` holds the peers bound to theirs
        self.identity = Identity(key, src)
        self.keys = Keyring(self.identity, key, config.mac)
        self._kid = self.identity.key_id
        self.mac_bytes = self._sig + FINGERPRINT_BYTES  # a one-peer MAC frame's length
        self._base = {"v": VERSION, "run": config.run, "src": src, "e": self.epoch}
        self._src_utf8 = src.encode()
        self._run_tag = _fixed.run_tag(config.run)
        self._src_names: dict[bytes, str] = {}  # decoded sender ids of fixed headers
        self._dest = DestTags(key, src)
        #: dst -> (MAC-frame destination tags, sessions of the peers we hold keys of,
        #: how many of dst's peers we hold no key of)
        self._sealers: dict[str | tuple[str, ...], _Sealer] = {}
        #: packets encoded for a destination we hold no key of (that peer drops them)
        self.unkeyed = 0
        self._seq = itertools.count()  # next() is atomic under the GIL
        self._replay = ReplayWindow(config.replay_window_packets, config.max_clock_skew_s)
        n = config.max_header_bytes  # no object inside a header can be larger
        self._unpack = functools.partial(
            msgpack.unpackb, raw=False, strict_map_key=True, max_ext_len=0,
            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n,
        )  # fmt: skip
        self._log = RejectLog(src, self.clock, config.reject_log_interval_s, self._unpack)
        self._reject = self._log.reject
        self._note_suspect = self._log.note_suspect
        self._replay_check = self._replay.check
        self._fast = FixedFastPath(
            self._dest.own,
            self._sig,
            (config.max_header_bytes, config.max_payload_bytes),
            (VERSION, self._run_tag),
            self._replay_check,
            self._reject,
        )
        #: drops per reason (``decode`` returned None), counted since the start
        self.rejects = self._log.rejects
        #: the latest distinct senders of unauthenticated packets, oldest first
        #: (bounded; see :class:`Suspect`): what ``join()``'s error names.
        self.suspects = self._log.suspects

    # ------------------------------------------------------------------ keys
    def bind(self, peer_id: str, epoch: int, public: bytes, *, pinned: bool = False) -> Session:
        """Bind ``peer_id`` (incarnation ``epoch``) to ``public``: from now on only packets
        under its pairwise key are taken from it (:meth:`.Keyring.bind`; whether it may
        rebind a name is the runtime's rule).

        Raises:
            ValueError: an unusable public key, our own key or our own id.
        """
        session = self.keys.bind(peer_id, epoch, public, pinned=pinned)
        self._keys_changed()
        return session

    def unbind(self, peer_id: str) -> Session | None:
        """Forget ``peer_id``'s keys: its packets are dropped (``unknown_key``)."""
        old = self.keys.unbind(peer_id)
        if old is not None:
            self._keys_changed()
        return old

    def _keys_changed(self) -> None:
        self._sealers.clear()
        self._fast.forget()

    def _sealer(self, dst: str | Sequence[str]) -> _Sealer:
        """The MAC-frame destination tags and the sessions that ``dst``'s tags are made
        with, and how many of ``dst`` we hold no key of."""
        key: str | tuple[str, ...] = dst if isinstance(dst, str) else tuple(dst)
        got = self._sealers.get(key)
        if got is None:
            by_id = self.keys.by_id
            ids = tuple(dict.fromkeys((key,) if isinstance(key, str) else key))
            sessions = tuple(by_id[p] for p in ids if p in by_id)
            tags = self._dest.of([s.peer_id for s in sessions]) if len(sessions) > 1 else b""
            if len(self._sealers) > 1024:
                self._sealers.clear()
            got = self._sealers[key] = (tags, sessions, len(ids) - len(sessions))
        return got

    def _seal(self, sealer: _Sealer, head: Buffer, payload: Buffer, local: bool) -> bytes:
        """The MAC frame of one packet for the sessions of ``sealer``."""
        tags, sessions, missing = sealer
        if missing:
            self.unkeyed += missing  # those peers drop it: they hold no tag of ours
        if len(sessions) == 1:
            s = sessions[0]
            return (s.token_out if local else s.send.sign(head, payload)) + self._kid
        if not sessions:
            return self._kid  # every receiver drops it (mac_size)
        if local:
            return b"".join((tags, *(s.token_out for s in sessions), self._kid))
        return b"".join((tags, *sign_each([s.send for s in sessions], head, payload), self._kid))

    # ------------------------------------------------------------------ encode
    def encode(
        self,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
        *,
        local: bool = False,
        dst: str | Sequence[str] | None = None,
        intro: bool = False,
    ) -> list[Buffer]:
        """Build ``[header, payload, mac]`` for one packet; the payload is not copied.

        ``local``: every destination receives this packet over a private local
        channel (``Transport.is_local``), where the MAC frame carries each pair's
        local token instead of a MAC (:meth:`decode`), saving the hash of the
        payload.  Such a packet is rejected anywhere else.

        Args:
            kind: a protocol's packet kind (its ``kinds`` module), any int in [0, 65535].
            fields: caller header fields: str keys, msgpack-able values (ints,
                str, floats, bools, small lists); nested maps need str keys.
            payload: raw bytes; a memoryview is re-viewed as bytes, never copied.
            dst: the peer id (or ids) this packet is for, each signed for with its
                pairwise key; a peer whose key we do not hold gets no tag (counted
                in :attr:`unkeyed`) and drops the packet.
            intro: sign with the run key instead (an introduction: ``kind`` must be
                one of the receiver's ``intro_kinds``); ``dst`` may then be None
                (a HELLO to a bootstrap address whose peer is not known yet).

        Raises:
            ValueError: a reserved key in ``fields``, a kind out of range, no ``dst``
                for a pairwise packet, or a header or payload over the configured
                limits (a peer would drop it).
            TypeError: a field value msgpack cannot encode.
        """
        kind = int(kind)
        if not 0 <= kind <= _KIND_MAX:
            raise ValueError(f"kind must be in [0, {_KIND_MAX}], got {kind}")
        if dst is None and not intro:
            raise ValueError("a packet needs dst (the peers whose keys sign it) unless intro=True")
        if isinstance(payload, memoryview):
            payload = _as_bytes_view(payload)
        if (size := len(payload)) > self.config.max_payload_bytes:
            raise ValueError(f"payload of {size} B > Config.max_payload_bytes; send smaller chunks")
        if fields and not RESERVED_KEYS.isdisjoint(fields):
            bad = sorted(RESERVED_KEYS.intersection(fields))
            raise ValueError(f"header keys {bad} are reserved by the wire codec; rename them")
        tags = self._dest.of(dst) if dst is not None else None
        seq = next(self._seq)
        head: bytes | None = None
        if fields and len(fields) >= 7:  # a data packet's fields: the fixed header
            ident = (self._src_utf8, self._run_tag, self.epoch, seq)
            head = _fixed.pack(VERSION, kind, fields, ident, tags)
        if head is None:
            header = dict(self._base, q=seq, k=kind, **(fields or {}))
            if tags is not None:
                header["@"] = tags
            head = msgpack.packb(header)
        if (size := len(head)) > self.config.max_header_bytes:
            raise ValueError(
                f"header of {size} B > Config.max_header_bytes; move data to the payload"
            )
        if intro:
            return [head, payload, self._signer.sign(head, payload) + self._fingerprint]
        assert dst is not None
        if type(dst) is str and (one := self.keys.by_id.get(dst)) is not None:  # the usual
            return [
                head,
                payload,
                (one.token_out if local else one.send.sign(head, payload)) + self._kid,
            ]
        return [head, payload, self._seal(self._sealer(dst), head, payload, local)]

    def encode_run(
        self,
        kind: int,
        common: Mapping[str, Any],
        rows: Sequence[tuple[int, int, int]],
        payloads: Sequence[Buffer],
        *,
        local: bool = False,
        dst: str | Sequence[str],
        chunk_key: str = "c",
    ) -> list[list[Buffer]]:
        """Frames of data packets that differ only in bucket, chunk, count and payload.

        ``rows[i]`` is packet ``i``'s ``(b, c, n)``; ``common`` its other fields.
        ``chunk_key``: the field the middle value goes in: ``"c"`` (data), or ``"g"``
        for parity packets, whose fixed header carries their group where a data
        packet's carries its chunk.
        The same packets as :meth:`encode` called once per row (same checks, own
        sequence numbers and MACs), built per run: the first header is packed
        and checked as usual, the others are one ``struct`` call each after one
        range check of the run (:func:`._data_header.repack`).  Where the fields
        do not fit the fixed header, every packet takes :meth:`encode`.

        Raises:
            ValueError, TypeError: as :meth:`encode`.
        """
        if not rows:
            return []
        if len(rows) != len(payloads):
            raise ValueError(f"{len(rows)} rows for {len(payloads)} payloads")
        b0, c0, n0 = rows[0]
        first = self.encode(kind, {**common, "b": b0, chunk_key: c0, "n": n0}, payloads[0],
                            local=local, dst=dst)  # fmt: skip
        head = first[0]
        flat = [v for row in rows[1:] for v in row]
        if (
            not isinstance(head, bytes)
            or head[0] != _fixed.MAGIC
            or (flat and not (min(flat) >= 0 and max(flat) <= 0xFFFF_FFFF))
            or any(type(v) is not int for v in flat)
        ):
            return [first] + [
                self.encode(
                    kind, {**common, "b": b, chunk_key: c, "n": n}, pl, local=local, dst=dst
                )
                for (b, c, n), pl in zip(rows[1:], payloads[1:], strict=True)
            ]
        views = [_as_bytes_view(pl) if isinstance(pl, memoryview) else pl for pl in payloads[1:]]
        if views and max(len(v) for v in views) > self.config.max_payload_bytes:
            raise ValueError("payload > Config.max_payload_bytes; send smaller chunks")
        seq = self._seq
        heads = _fixed.repack(head, [(next(seq), b, c, n) for b, c, n in rows[1:]])
        out: list[list[Buffer]] = [first]
        sealer = self._sealer(dst)
        sessions = sealer[1]
        if len(sessions) == 1 and not sealer[2]:  # the common case, without the general call
            s, kid = sessions[0], self._kid
            if local:
                frame = s.token_out + kid
                out += [[h, v, frame] for h, v in zip(heads, views, strict=True)]
            else:
                sign = s.send.sign
                out += [[h, v, sign(h, v) + kid] for h, v in zip(heads, views, strict=True)]
            return out
        seal = self._seal
        out += [[h, v, seal(sealer, h, v, local)] for h, v in zip(heads, views, strict=True)]
        return out

    # ------------------------------------------------------------------ decode
    def decode(self, frames: Sequence[Buffer], *, local: bool = False) -> Packet | None:
        """Check and parse one received packet; ``None`` if rejected (counted, logged).

        Never raises, whatever the input: a malformed packet is a dropped
        packet, and the receive path must keep running for the others.

        ``local``: the packet came over a channel only this user's processes can
        write to (:class:`~gossipnet.transport.base.LocalFrames`).  Then the
        pair's local token is compared instead of hashing header and payload:
        what a MAC would prove there (the holder of the pair key sent these
        bytes) the operating system mostly does, and the MAC is a sixth of a
        local all-reduce's CPU.  The token is a secret of the pair, so another
        member on the host cannot pass for this sender without reading its
        memory (which the same user can: see the guide's security model).  An
        introduction is always checked in full; every other check runs as on
        the network.  Network packets never rely on a token.
        """
        try:
            return self._decode(frames, local)
        except Exception:  # a bug here must not kill the receive path
            log.debug("peer %s: wire decode failed unexpectedly", self.src, exc_info=True)
            self._reject("internal", None)
            return None

    def decode_batch(self, batch: Sequence[Sequence[Buffer]]) -> list[Packet | None]:
        """:meth:`decode` every packet of one receive drain, in order; never raises.

        Each packet stays independently authenticated and replay-checked (one MAC
        check each: loss stays per packet); a packet is local when its frames are
        :class:`~gossipnet.transport.base.LocalFrames`.  Why a batch call: the
        dispatcher (``PacketIO.on_batch``) then hands a subscriber all of a drain's
        packets together, and the data packets of senders already seen take the
        fast path (:mod:`._fast_decode`: the same checks and reject reasons, the
        per-sender ones done once).
        """
        decode, fast, out = self._decode, self._fast.decode, []
        for frames in batch:
            try:
                pkt = fast(frames)
                if pkt is SLOW:
                    pkt = decode(frames, type(frames) is LocalFrames)
                elif pkt is not None:
                    self.accepted += 1
                out.append(cast(Packet | None, pkt))
            except Exception:  # a bug here must not kill the receive path
                log.debug("peer %s: wire decode failed unexpectedly", self.src, exc_info=True)
                self._reject("internal", None)
                out.append(None)
        return out

    def _decode(self, frames: Sequence[Buffer], local: bool = False) -> Packet | None:
        try:
            if len(frames) != 3:
                self._reject("frames", None)
                return None
            head = _as_bytes_view(frames[0])
            payload = _as_bytes_view(frames[1])
            mac = _as_bytes_view(frames[2])
        except Exception:  # not a sequence of three buffers
            self._reject("frames", None)
            return None
        cfg = self.config
        if len(head) > cfg.max_header_bytes:
            self._reject("header_size", None)
            return None
        if len(payload) > cfg.max_payload_bytes:
            self._reject("payload_size", None)
            return None
        session = self._open(head, payload, mac, local)
        if session is None:
            return None
        if head and head[0] == _fixed.MAGIC:
            return self._check_fixed(head, payload, session)
        try:
            header = self._unpack(head)
        except Exception:
            self._reject("header_parse", None)
            return None
        if type(header) is not dict:
            self._reject("header_parse", None)
            return None
        return self._check_header(header, payload, session)

    def _open(
        self, head: memoryview, payload: memoryview, mac: memoryview, local: bool
    ) -> Session | bool | None:
        """Authenticate: the sender's session, True for a valid introduction, or None
        (rejected and counted)."""
        size, sig = len(mac), self._sig
        session = self.keys.by_kid.get(bytes(mac[-FINGERPRINT_BYTES:]))
        if session is None or size < FINGERPRINT_BYTES:
            return self._open_unbound(head, payload, mac)
        tag = mac[:sig] if size == sig + FINGERPRINT_BYTES else tag_in(mac, sig, self._dest.own)
        if tag is None:
            k, rest = divmod(size - FINGERPRINT_BYTES, sig + TAG_BYTES)
            # a well-formed frame for others (e.g. our previous life on this address)
            self._reject("destination" if not rest and k >= 2 else "mac_size", session.peer_id)
            return None
        # a sender that did not know the channel is local signed it: that is fine too
        if (local and hmac.compare_digest(tag, session.token_in)) or session.recv.verify(
            head, payload, tag
        ):
            return session
        self._reject("mac", session.peer_id)  # corrupted, forged, or meant for another peer
        return None

    def _open_unbound(self, head: memoryview, payload: memoryview, mac: memoryview) -> bool | None:
        """:meth:`_open` of a frame under no bound key: an introduction (True), or None."""
        size, sig = len(mac), self._sig
        if size < FINGERPRINT_BYTES:
            self._reject("mac_size", None)
            self._note_suspect("mac_size", head, False)
            return None
        kid = bytes(mac[-FINGERPRINT_BYTES:])
        if kid == self._fingerprint:  # an introduction, under the run key: never a token
            if size != sig + FINGERPRINT_BYTES:
                self._reject("mac_size", None)
                self._note_suspect("mac_size", head, True)
                return None
            if not self._signer.verify(head, payload, mac[:sig]):
                self._reject("mac", None)
                self._note_suspect("mac", head, True)
                return None
            return True
        if kid == self._kid:
            self._reject("own_packet", self.src)  # reflected back to us
            return None
        self._reject("unknown_key", None)  # another secret, or an introduction we lack
        self._note_suspect("mac", head, False, self.intro_kinds)
        return None

    def _check_sender(self, src: str, epoch: int, kind: int, session: Session | bool) -> bool:
        """The authenticated key is ``src``'s of incarnation ``epoch``; an introduction
        is of an introduction kind.  False: rejected (counted)."""
        if session is True:
            if kind not in self.intro_kinds:
                self._reject("not_member", None)
                return False
            return True
        assert isinstance(session, Session)
        if src != session.peer_id:
            self._reject("impersonation", session.peer_id)
            return False
        if epoch != session.epoch:
            self._reject("epoch_mismatch", src)
            return False
        return True

    def _check_header(
        self, header: dict[str, Any], payload: memoryview, session: Session | bool
    ) -> Packet | None:
        """Semantic checks on an authenticated header, then the replay guard."""
        version = header.pop("v", None)
        if type(version) is not int or version != VERSION:
            self._reject("version", None)
            return None
        if header.pop("run", None) != self.config.run:
            self._reject("run", None)
            return None
        src = header.pop("src", None)
        epoch = header.pop("e", None)
        seq = header.pop("q", None)
        kind = header.pop("k", None)
        if not isinstance(src, str):
            self._reject("header_fields", None)
            return None
        if not (src and _uint(epoch) and _uint(seq) and _uint(kind) and kind <= _KIND_MAX):
            self._reject("header_fields", src)
            return None
        if src == self.src:
            self._reject("own_packet", src)  # reflected back to us: never ours to take
            return None
        if not self._check_sender(src, epoch, kind, session):
            return None
        to = header.pop("@", None)
        if to is not None and not self._dest.for_us(to):
            self._reject("destination", src)
            return None
        if "dt" in header:
            itemsize = _ITEMSIZE.get(header["dt"]) if isinstance(header["dt"], str) else None
            if itemsize is None:
                self._reject("dtype", src)
                return None
            count = header.get("n")
            if not _uint(count) or count * itemsize != len(payload):
                self._reject("count", src)
                return None
        if session is True:  # anyone may repeat an introduction: it moves no window
            self.accepted += 1
            return Packet(src, epoch, seq, kind, header, payload, False, False)
        reason = self._replay_check(src, epoch, seq)
        if reason:
            self._reject(reason, src)
            return None
        self.accepted += 1
        return Packet(src, epoch, seq, kind, header, payload, True, reason is None)

    def _check_fixed(
        self, head: memoryview, payload: memoryview, session: Session | bool
    ) -> Packet | None:
        """:meth:`_check_header`'s checks, in its order, on a fixed data header.

        Field widths do what the msgpack path's type checks do (a round id is a
        u64, a chunk a u32); what widths cannot bound (epoch and seq within int64,
        a non-empty UTF-8 sender, the lengths adding up) is checked here.
        """
        if session is True:  # a data header is never an introduction
            self._reject("not_member", None)
            return None
        size = _fixed.FIXED.size
        if len(head) < size:
            self._reject("header_parse", None)
            return None
        (_, version, kind, mode, dt, x, flags, src_len, ndst, z, run, epoch, seq,
         r, lay, b, c, n, w) = _fixed.FIXED.unpack_from(head)  # fmt: skip
        if version != VERSION:
            self._reject("version", None)
            return None
        if run != self._run_tag:
            self._reject("run", None)
            return None
        if len(head) != size + src_len + 4 * ndst:
            self._reject("header_parse", None)
            return None
        raw = bytes(head[size : size + src_len])
        src = self._src_names.get(raw) or self._src_name(raw)
        if not src:
            self._reject("header_fields", None)
            return None
        if epoch > INT64_MAX or seq > INT64_MAX:
            self._reject("header_fields", src)
            return None
        if src == self.src:
            self._reject("own_packet", src)
            return None
        assert isinstance(session, Session)
        if src != session.peer_id:
            self._reject("impersonation", session.peer_id)
            return None
        if epoch != session.epoch:
            self._reject("epoch_mismatch", src)
            return None
        directed = bool(flags & _fixed.HAS_DST)
        if directed:
            to = bytes(head[size + src_len :])
            if not self._dest.for_us(to):
                self._reject("destination", src)
                return None
        if dt >= len(_fixed.DTYPE_ORDER):
            self._reject("dtype", src)
            return None
        code = _fixed.DTYPE_ORDER[dt]
        if n * _ITEMSIZE[code] != len(payload):
            self._reject("count", src)
            return None
        reason = self._replay_check(src, epoch, seq)
        if reason:
            self._reject(reason, src)
            return None
        self.accepted += 1
        fields = _fixed.fields_of(mode, code, r, lay, b, c, n, flags, w, x, z)
        pkt = Packet(src, epoch, seq, kind, fields, payload, True, reason is None)
        if directed:
            assert isinstance(session, Session)
            self._fast.learn(head, pkt, session)  # this sender's next packets: the fast path
        return pkt

    def _src_name(self, raw: bytes) -> str:
        """A fixed header's sender id as text ("" if not UTF-8), remembered (bounded)."""
        try:
            name = raw.decode()
        except UnicodeDecodeError:
            return ""
        if len(self._src_names) > 4096:
            self._src_names.clear()
        self._src_names[raw] = name
        return name

    def forget(self, src: str) -> None:
        """Release the replay window of a departed peer (:meth:`.ReplayWindow.forget`:
        its old packets stay rejected)."""
        self._replay.forget(src)
