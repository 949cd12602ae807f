"""Destination tags: which peers a packet is for, in 4 bytes per peer.

Why a destination (the ``"@"`` field, or the fixed header's tag section, and the
tags opening a MAC frame for several peers): a packet encoded once for many peers
(a broadcast chunk stays one encoding) carries one MAC per destination, each under
that pair's key, and a receiver finds its own by its tag; the header's tags let a
receiver drop a packet for others before it reads further.  Tags are keyed hashes
of the peer ids, so they name no peer to an outsider.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ("TAG_BYTES", "DestTags")

#: Bytes of one destination tag.
TAG_BYTES = 4


def _tag(key: bytes, peer_id: str) -> bytes:
    """A peer's destination tag: short, keyed (it names no peer to an outsider)."""
    return hashlib.blake2b(
        peer_id.encode(), key=key, digest_size=TAG_BYTES, person=b"gossipnet-dst"
    ).digest()


class DestTags:
    """The tags of one run key: ours, and the ones we address (cached, bounded).

    Args:
        key: the run key.
        me: our peer id; :attr:`own` is its tag.
    """

    def __init__(self, key: bytes, me: str) -> None:
        self._key = key
        self._tags: dict[str, bytes] = {}
        self._groups: dict[tuple[str, ...], bytes] = {}
        self.own = _tag(key, me)

    def of(self, dst: str | Sequence[str]) -> bytes:
        """The concatenated tags of ``dst`` (one peer id or several)."""
        tags = self._tags
        if isinstance(dst, str):
            return tags.get(dst) or self._new(dst)
        key = tuple(dst)  # a broadcast names the same group chunk after chunk
        joined = self._groups.get(key)
        if joined is None:
            if len(self._groups) > 1024:
                self._groups.clear()
            joined = b"".join(tags.get(p) or self._new(p) for p in key)
            self._groups[key] = joined
        return joined

    def _new(self, peer_id: str) -> bytes:
        if len(self._tags) > 65536:  # peers come and go: bounded, rebuilt on demand
            self._tags.clear()
        tag = self._tags[peer_id] = _tag(self._key, peer_id)
        return tag

    def for_us(self, to: object) -> bool:
        """Whether a tag field names us: it is our tag, or one of its aligned tags is."""
        own = self.own
        if to == own:
            return True
        if type(to) is not bytes or len(to) % TAG_BYTES:
            return False
        i = to.find(own)
        while i > 0 and i % TAG_BYTES:
            i = to.find(own, i + 1)
        return i >= 0 and not i % TAG_BYTES
