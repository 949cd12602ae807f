"""The authenticated wire format: ``[header, payload, mac]`` frames.

A packet is a small msgpack map (the header; data packets, whose fields are
always the same, use the fixed binary layout of :mod:`._data_header` instead,
told apart by its first byte), the raw payload (never
msgpack-encoded, so tensor chunks travel without a copy) and a 16-byte MAC
over both.  The receiver rejects with the cheapest failing test, in order:
frame count, sizes, MAC, header parse (msgpack size limits), version, run,
field types and ranges, our own id, destination, dtype/count, epoch, replay.
Nothing is parsed before the MAC checks out, so a forger costs us one hash of
a bounded buffer and nothing more; the one exception is a diagnostic: a
rejected header is sampled (at most 100 a second, size-limited) for the
sender it *claims*, so ``join()`` can name a peer with another secret
(:class:`Suspect`; never acted on).

Why a destination (``"@"``: 4-byte tags of the peers a packet is for): see
:mod:`._dest`.  A packet with no destination (a HELLO to a bootstrap address
whose peer id we do not know yet) is accepted with ``Packet.directed`` False;
the node lets such packets refresh no liveness.
Our own id as ``src`` is rejected outright (``own_packet``).

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
from gossipnet.transport._dest import DestTags
from gossipnet.transport._fast_decode import SLOW, FixedFastPath
from gossipnet.transport._packet import Packet
from gossipnet.transport._rejects import RejectLog, Suspect
from gossipnet.transport._replay import INT64_MAX, ReplayWindow
from gossipnet.transport.base import Buffer, LocalFrames
from gossipnet.transport.mac import make_signer

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

VERSION = 2  # 2: parity packets in the fixed header (_data_header.HAS_G)
MAC_BYTES = 16  # the tag; the MAC frame is ``WireCodec.mac_bytes`` long (36 for aes-gmac)
#: Bytes of key fingerprint closing every MAC frame (see ``WireCodec.decode``).
FINGERPRINT_BYTES = 8
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


def _uint(x: object) -> TypeGuard[int]:
    # bool is an int subclass and msgpack decodes true/false as bool: refuse it.
    return type(x) is int and 0 <= x <= INT64_MAX


class WireCodec:
    """Encode, authenticate and check packets for one peer.

    Not thread-safe: use one codec from the event-loop thread only.

    Args:
        secret: shared run secret.  ``None`` (or empty) keys the MAC with an
            empty secret: corruption and other runs' packets are still dropped,
            but anyone who knows the run id can forge packets.
        config: reads ``run``, ``mac``, ``max_header_bytes``,
            ``max_payload_bytes``, ``replay_window_packets``, ``reject_log_interval_s``.
        src: our peer id, stamped on every packet we encode.
        epoch: our incarnation; defaults to ``time.time_ns()`` so a restarted
            peer (a new process) outranks its previous life.  Wall time is the
            point here, not a deadline, hence not the injected clock.
        clock: paces the reject log; defaults to :class:`MonotonicClock`.
    """

    def __init__(
        self,
        secret: bytes | None,
        config: Config,
        src: str,
        *,
        epoch: int | None = None,
        clock: Clock | None = None,
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
        key = _derive_key(bytes(secret or b""), config.run)
        self._signer = make_signer(config.mac, key)
        self._fingerprint = _fingerprint(key)
        self.mac_bytes = self._signer.size + FINGERPRINT_BYTES  # length of the MAC frame
        self._unsigned = bytes(self._signer.size) + self._fingerprint
        self._base = {"v": VERSION, "run": config.run, "src": src, "e": self.epoch}
        self._src_utf8 = src.encode()
        self._run_tag = _fixed.run_tag(config.run)
        self._src_names: dict[bytes, str] = {}  # decoded sender ids of fixed headers
        self._dest = DestTags(key, src)
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
            self._signer.verify,
            self._fingerprint,
            self.mac_bytes,
            (config.max_header_bytes, config.max_payload_bytes),
            (VERSION, self._run_tag),
            self._replay_check,
            self._reject,
            self._note_suspect,
        )
        #: drops per reason (``decode`` returned None), counted since the start
        self.rejects = self._log.rejects
        #: the latest distinct senders of unauthenticated packets, oldest first
        #: (bounded; see :class:`Suspect`): what ``join()``'s error names.
        self.suspects = self._log.suspects

    # ------------------------------------------------------------------ encode
    def encode(
        self,
        kind: int,
        fields: Mapping[str, Any] | None = None,
        payload: Buffer = b"",
        *,
        local: bool = False,
        dst: str | Sequence[str] | None = None,
    ) -> list[Buffer]:
        """Build ``[header, payload, mac]`` for one packet; the payload is not copied.

        ``local``: every destination receives this packet over a private local
        channel (``Transport.is_local``), where only the key fingerprint is
        checked (:meth:`decode`): the MAC is left zero, saving its hash of the
        payload.  Such a packet is rejected anywhere else.

        Args:
            kind: a protocol's packet kind (its ``kinds`` module), any int in [0, 65535].
            fields: caller header fields: str keys, msgpack-able values (ints,
                str, floats, bools, small lists); nested maps need str keys.
            payload: raw bytes; a memoryview is re-viewed as bytes, never copied.
            dst: the peer id (or ids) this packet is for; any other receiver drops
                it (``destination``).  ``None`` only where no id is known yet (a
                HELLO to a bare address): such a packet refreshes no liveness.

        Raises:
            ValueError: a reserved key in ``fields``, a kind out of range, or a
                header or payload over the configured limits (a peer would drop it).
            TypeError: a field value msgpack cannot encode.
        """
        kind = int(kind)
        if not 0 <= kind <= _KIND_MAX:
            raise ValueError(f"kind must be in [0, {_KIND_MAX}], got {kind}")
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
        if local:
            return [head, payload, self._unsigned]
        return [head, payload, self._signer.sign(head, payload) + self._fingerprint]

    def encode_run(
        self,
        kind: int,
        common: Mapping[str, Any],
        rows: Sequence[tuple[int, int, int]],
        payloads: Sequence[Buffer],
        *,
        local: bool = False,
        dst: str | Sequence[str] | None = None,
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
        if local:
            unsigned = self._unsigned
            out += [[h, v, unsigned] for h, v in zip(heads, views, strict=True)]
        else:
            sign, fp = self._signer.sign, self._fingerprint
            out += [[h, v, sign(h, v) + fp] for h, v in zip(heads, views, strict=True)]
        return out

    # ------------------------------------------------------------------ decode
    def decode(self, frames: Sequence[Buffer], *, local: bool = False) -> Packet | None:
        """Check and parse one received packet; ``None`` if rejected (counted, logged).

        Never raises, whatever the input: a malformed packet is a dropped
        packet, and the receive path must keep running for the others.

        ``local``: the packet came over a channel only this user's processes can
        write to (:class:`~gossipnet.transport.base.LocalFrames`).  Then the MAC
        frame's closing key fingerprint is compared instead of hashing header and
        payload: what a MAC would prove there (a holder of the key sent these
        bytes) the operating system already does, and the MAC is a sixth of a
        local all-reduce's CPU.  The fingerprint still keeps out a job on the
        same host with another secret; every other check runs as on the network.
        Network packets are checked against both; they never rely on the
        fingerprint alone, which is not signed.
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
        per-sender ones done once): ``bench/packet_path.py --quick`` measured
        ``decode_batch_us`` 4.5-4.6 -> 3.8 us per 8 KiB packet (most of the rest is the MAC).
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
        same_key = hmac.compare_digest(mac[-FINGERPRINT_BYTES:], self._fingerprint)
        if len(mac) != self.mac_bytes:
            self._reject("mac_size", None)
            self._note_suspect("mac_size", head, same_key)
            return None
        if not same_key or not (
            local or self._signer.verify(head, payload, mac[:-FINGERPRINT_BYTES])
        ):
            self._reject("mac", None)
            self._note_suspect("mac", head, same_key)
            return None
        if head and head[0] == _fixed.MAGIC:
            return self._check_fixed(head, payload)
        try:
            header = self._unpack(head)
        except Exception:
            self._reject("header_parse", None)
            return None
        if type(header) is not dict:
            self._reject("header_parse", None)
            return None
        return self._check_header(header, payload)

    def _check_header(self, header: dict[str, Any], payload: memoryview) -> Packet | None:
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
        reason = self._replay_check(src, epoch, seq)
        if reason:
            self._reject(reason, src)
            return None
        self.accepted += 1
        return Packet(src, epoch, seq, kind, header, payload, to is not None, reason is None)

    def _check_fixed(self, head: memoryview, payload: memoryview) -> Packet | None:
        """:meth:`_check_header`'s checks, in its order, on a fixed data header.

        Field widths do what the msgpack path's type checks do (a round id is a
        u64, a chunk a u32); what widths cannot bound (epoch and seq within int64,
        a non-empty UTF-8 sender, the lengths adding up) is checked here.
        """
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
        pkt = Packet(src, epoch, seq, kind, fields, payload, directed, reason is None)
        self._fast.learn(head, pkt)  # this sender's next packets take the fast path
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
