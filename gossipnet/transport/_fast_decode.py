"""The common case of a receive drain, decoded with the per-sender work done once.

Why: a drain is mostly data packets from a few senders to us, and all of a
sender's packets to us carry the same tail after the fixed header (its UTF-8
id and the destination tags).  :meth:`.WireCodec._check_fixed` re-derives what
that tail means for every packet (the id decoded, our tag searched among the
tags, the id compared with ours) and each packet first passes three buffer
casts and a dozen range checks.  Here a packet whose frames are plain byte
views, whose header is a fixed one of the version and run we expect, and whose
tail the codec has already accepted once (:meth:`FixedFastPath.learn`) is
checked with one dictionary lookup for the tail and the remaining per-packet
tests inline; every other packet returns :data:`SLOW` *before any side effect*
and takes the codec's full path, which counts its reject reason as always.

The tail also names the sender's session (its pairwise keys), so the key id
closing the MAC frame is compared, not looked up.  What stays per packet, as on
the full path: the MAC (or, for local frames, the pair's local token), the
sender's key id and incarnation, the epoch and sequence bounds, the dtype and count against
the payload length, and the replay window; a rejected packet is counted with
the same reason the full path gives (tests/unit/test_fast_decode.py checks
both against each other, packet by packet).

Why not one vectorised parse of the batch's headers: ``struct`` parses one
fixed header in 0.1-0.3 us, and the replay window is sequential per sender;
measured on 32 headers, joining them and parsing with numpy cost 0.9 us a
header with the ``tolist`` back to ints.  The cost was the checks, not the parse.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from typing import Any, Final

from gossipnet.transport import _data_header as _fixed
from gossipnet.transport._dest import TAG_BYTES
from gossipnet.transport._packet import Packet
from gossipnet.transport._replay import INT64_MAX
from gossipnet.transport.base import Buffer, LocalFrames
from gossipnet.transport.identity import KEY_ID_BYTES, Session

__all__ = ("SLOW", "FixedFastPath", "tag_in")

#: Returned where a packet needs the codec's full path (nothing was changed).
SLOW: Final = object()
#: Tails remembered at most (senders times destination sets); then forgotten.
_MAX_TAILS = 4096
_HEAD = _fixed.FIXED.size
_ITEMSIZES = (4, 2, 2, 8, 8, 4, 1)  # per _fixed.DTYPE_ORDER
_DIRECTED = _fixed.HAS_DST


class FixedFastPath:
    """The fast path of one codec (its keys, replay window and reject counter).

    Args:
        own_tag: our destination tag (finds our MAC in a frame for several peers).
        sig: one MAC tag's size (the signer's ``size``).
        limits: ``(max_header_bytes, max_payload_bytes)``.
        ident: ``(wire version, run tag)``.
        replay: the replay window's ``check(src, epoch, seq)``.
        reject: the codec's ``reject(reason, src)`` counter.
    """

    def __init__(
        self,
        own_tag: bytes,
        sig: int,
        limits: tuple[int, int],
        ident: tuple[int, int],
        replay: Callable[[str, int, int], str | None],
        reject: Callable[[str, str | None], None],
    ) -> None:
        self._own, self._sig = own_tag, sig
        self._one = sig + KEY_ID_BYTES  # a one-peer MAC frame's length
        self._max_head, self._max_payload = limits
        self._version, self._run = ident
        self._replay, self._reject = replay, reject
        #: accepted tails: bytes after the fixed header -> (src, src_len, ndst, session)
        self._tails: dict[bytes, tuple[str, int, int, Session]] = {}
        self.fast = 0  # packets decided here (accepted or rejected), for tests and benches

    def learn(self, head: memoryview, pkt: Packet, session: Session) -> None:
        """Remember the tail of a directed fixed header the full path accepted under
        ``session``'s key."""
        src_len, ndst = head[8], head[9]
        if not ndst:
            return
        if len(self._tails) >= _MAX_TAILS:
            self._tails.clear()
        self._tails[bytes(head[_HEAD:])] = (pkt.src, src_len, ndst, session)

    def forget(self) -> None:
        """Drop every remembered tail (a peer's keys changed)."""
        self._tails.clear()

    def decode(self, frames: Sequence[Buffer]) -> Packet | object | None:
        """``frames`` decoded as the full path would, or :data:`SLOW` (no side effect)."""
        if len(frames) != 3:
            return SLOW
        head, payload, mac = frames
        if not (
            type(head) is memoryview
            and type(payload) is memoryview
            and type(mac) is memoryview
            and head.format == payload.format == mac.format == "B"
            and head.ndim == payload.ndim == mac.ndim == 1
        ):
            return SLOW
        size = len(head)
        if not (
            _HEAD < size <= self._max_head
            and len(payload) <= self._max_payload
            and head[0] == _fixed.MAGIC
        ):
            return SLOW
        known = self._tails.get(bytes(head[_HEAD:]))
        if known is None:
            return SLOW
        src, src_len, ndst, session = known
        if mac[-KEY_ID_BYTES:] != session.key_id:
            return SLOW  # another key (or none): the full path decides
        f = _fixed.FIXED.unpack_from(head)
        if not (
            f[1] == self._version  # the FIXED fields: version, flags, src_len, ndst, run
            and f[10] == self._run
            and f[6] & _DIRECTED
            and f[7] == src_len
            and f[8] == ndst
            and f[4] < len(_ITEMSIZES)  # dtype
            and f[11] == session.epoch
        ):
            return SLOW
        tag = mac[: self._sig] if len(mac) == self._one else tag_in(mac, self._sig, self._own)
        if tag is None:
            return SLOW
        # Past here every packet is decided: as the full path would, in its order.
        self.fast += 1
        if not (
            (type(frames) is LocalFrames and hmac.compare_digest(tag, session.token_in))
            or session.recv.verify(head, payload, tag)
        ):
            self._reject("mac", src)
            return None
        return self._accept(f, src, payload)

    def _accept(self, f: tuple[Any, ...], src: str, payload: memoryview) -> Packet | None:
        """The checks after the tail's: bounds, count, replay; then the packet."""
        (_, _, kind, mode, dt, x, flags, _, _, z, _, epoch, seq, r, lay, b, c, n, w) = f
        if epoch > INT64_MAX or seq > INT64_MAX:
            self._reject("header_fields", src)
            return None
        if n * _ITEMSIZES[dt] != len(payload):
            self._reject("count", src)
            return None
        reason = self._replay(src, epoch, seq)
        if reason:
            self._reject(reason, src)
            return None
        code = _fixed.DTYPE_ORDER[dt]
        fields = _fixed.fields_of(mode, code, r, lay, b, c, n, flags, w, x, z)
        return Packet(src, epoch, seq, kind, fields, payload, True, reason is None)


def tag_in(mac: memoryview, sig: int, own: bytes) -> memoryview | None:
    """Our tag in a MAC frame for ``k >= 2`` peers (``tags(4k) || tags(sig*k) || kid``),
    or None: no frame of that shape, or our destination tag is not among its tags."""
    k, rest = divmod(len(mac) - KEY_ID_BYTES, sig + TAG_BYTES)
    if rest or k < 2:
        return None
    tags = bytes(mac[: TAG_BYTES * k])
    i = tags.find(own)
    while i > 0 and i % TAG_BYTES:
        i = tags.find(own, i + 1)
    if i < 0:
        return None
    start = TAG_BYTES * k + (i // TAG_BYTES) * sig
    return mac[start : start + sig]
