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

What stays per packet, as on the full path: the MAC (or, for local frames, the
key fingerprint), the epoch and sequence bounds, the dtype and count against
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
from gossipnet.transport._packet import Packet
from gossipnet.transport._replay import INT64_MAX
from gossipnet.transport.base import Buffer, LocalFrames

__all__ = ("SLOW", "FixedFastPath")

#: Returned where a packet needs the codec's full path (nothing was changed).
SLOW: Final = object()
#: Tails remembered at most (senders times destination sets); then forgotten.
_MAX_TAILS = 4096
_HEAD = _fixed.FIXED.size
_ITEMSIZES = (4, 2, 2, 8, 8, 4, 1)  # per _fixed.DTYPE_ORDER
_DIRECTED = _fixed.HAS_DST


class FixedFastPath:
    """The fast path of one codec (its signer, keys, replay window and reject counter).

    Args:
        verify: the signer's ``verify(head, payload, tag)``.
        fingerprint: the key fingerprint closing every MAC frame.
        mac_bytes: the MAC frame's length.
        limits: ``(max_header_bytes, max_payload_bytes)``.
        ident: ``(wire version, run tag)``.
        replay: the replay window's ``check(src, epoch, seq)``.
        reject: the codec's ``reject(reason, src)`` counter.
        suspect: the codec's ``note_suspect(reason, head, same_key)`` (MAC failures).
    """

    def __init__(
        self,
        verify: Callable[[Buffer, Buffer, memoryview], bool],
        fingerprint: bytes,
        mac_bytes: int,
        limits: tuple[int, int],
        ident: tuple[int, int],
        replay: Callable[[str, int, int], str | None],
        reject: Callable[[str, str | None], None],
        suspect: Callable[[str, memoryview, bool], None],
    ) -> None:
        self._verify, self._fp, self._mac_bytes = verify, fingerprint, mac_bytes
        self._max_head, self._max_payload = limits
        self._version, self._run = ident
        self._replay, self._reject, self._suspect = replay, reject, suspect
        #: accepted tails: bytes after the fixed header -> (src, src_len, ndst, directed)
        self._tails: dict[bytes, tuple[str, int, int, bool]] = {}
        self.fast = 0  # packets decided here (accepted or rejected), for tests and benches

    def learn(self, head: memoryview, pkt: Packet) -> None:
        """Remember the tail of a fixed header the full path accepted.

        Only headers shaped as the encoder makes them (tags flagged exactly when
        there are some), so an odd one cannot displace its sender's usual entry.
        """
        src_len, ndst = head[8], head[9]
        if pkt.directed != (ndst > 0):
            return
        if len(self._tails) >= _MAX_TAILS:
            self._tails.clear()
        self._tails[bytes(head[_HEAD:])] = (pkt.src, src_len, ndst, pkt.directed)

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
            and len(mac) == self._mac_bytes
            and head[0] == _fixed.MAGIC
        ):
            return SLOW
        known = self._tails.get(bytes(head[_HEAD:]))
        if known is None:
            return SLOW
        f = _fixed.FIXED.unpack_from(head)
        src, src_len, ndst, directed = known
        if not (
            f[1] == self._version  # the FIXED fields: version, flags, src_len, ndst, run
            and f[10] == self._run
            and f[6] & _DIRECTED == (_DIRECTED if directed else 0)
            and f[7] == src_len
            and f[8] == ndst
            and f[4] < len(_ITEMSIZES)  # dtype
        ):
            return SLOW
        # Past here every packet is decided: as the full path would, in its order.
        self.fast += 1
        cut = len(self._fp)
        same_key = hmac.compare_digest(mac[-cut:], self._fp)
        if not same_key or not (
            type(frames) is LocalFrames or self._verify(head, payload, mac[:-cut])
        ):
            self._reject("mac", None)
            self._suspect("mac", head, same_key)
            return None
        return self._accept(f, src, directed, payload)

    def _accept(
        self, f: tuple[Any, ...], src: str, directed: bool, payload: memoryview
    ) -> Packet | None:
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
        return Packet(src, epoch, seq, kind, fields, payload, directed, reason is None)
