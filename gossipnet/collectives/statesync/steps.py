"""The steps every download is made of: ask a manifest, adopt it, pull its chunks.

Split from :mod:`.client` to keep modules small: :class:`TransferSteps` is the base
of :class:`~.client.StateClient`, which sets the attributes declared here and
handles the packets that fill a :class:`~.transfer.Transfer`; these methods drive
one (loop thread only).
"""

from __future__ import annotations

import collections
import logging
import secrets
from typing import Any

from gossipnet.collectives.statesync.kinds import StateKind
from gossipnet.collectives.statesync.manifest import DIGEST_BYTES
from gossipnet.collectives.statesync.snapshot import whole_digest
from gossipnet.collectives.statesync.transfer import Transfer, TransferReport, runs, wait_event
from gossipnet.runtime.node import Node

__all__ = ("TransferSteps",)

log = logging.getLogger(__name__)

_DIGEST = DIGEST_BYTES


class TransferSteps:
    """Manifest, adoption and chunk steps of a download (see the module doc)."""

    node: Node
    window: int
    retry_s: float
    stall_timeout_s: float
    max_state_bytes: int
    rejects: collections.Counter[str]
    _xfers: dict[str, Transfer]

    def _open(self, max_bytes: int | None) -> Transfer:
        limit = self.max_state_bytes if max_bytes is None else min(max_bytes, self.max_state_bytes)
        xfer = Transfer(secrets.token_hex(6), max(0, limit))
        self._xfers[xfer.xid] = xfer
        return xfer

    def _alive(self, peer: str) -> bool:
        return bool(self.node.membership.is_alive(peer))  # type: ignore[union-attr]

    def _close(self, xfer: Transfer, rep: TransferReport, tried: list[str], t0: float) -> None:
        self._xfers.pop(xfer.xid, None)
        xfer.parts.clear()
        rep.sources_tried = tuple(tried)
        rep.chunks_corrupt = xfer.corrupt
        rep.elapsed_s = self.node.clock.now() - t0

    async def _ask_manifest(
        self,
        src: str,
        xfer: Transfer,
        deadline: float,
        want: dict[str, Any],
        rep: TransferReport,
        *,
        patient: bool = False,
    ) -> dict[str, Any] | None:
        """Ask ``src`` for a manifest until one valid arrives; None on a stall.

        ``want``: ``{"a": (max snapshot age, time after which any age will do)}`` or
        ``{"t": (kind, step)}`` (a target, see :mod:`.server`).  A source that answers
        ``wait`` is preparing a snapshot and gets a longer allowance (4 x
        ``stall_timeout_s``, or up to ``deadline`` when ``patient``: a target may be
        steps away) than a silent one.
        """
        clock = self.node.clock
        start = clock.now()
        stop = min(deadline, start + self.stall_timeout_s)
        xfer.src, xfer.manifest, xfer.gone, xfer.waiting = src, None, False, False
        while xfer.manifest is None:
            now = clock.now()
            if now >= stop or xfer.gone or not self._alive(src):
                return None
            if xfer.waiting:  # preparing a snapshot: ask again later, not at once
                xfer.waiting = False
                stop = deadline if patient else min(deadline, start + 4 * self.stall_timeout_s)
                await clock.sleep(min(self.retry_s, max(0.0, stop - now)))
                continue
            fields: dict[str, Any] = {"op": "man", "x": xfer.xid}
            if "t" in want:
                fields["t"] = list(want["t"])
            else:
                max_age, relax_at = want["a"]
                fields["a"] = max_age if max_age is not None and now < relax_at else -1.0
            self.node.send(src, StateKind.REQ, fields)
            rep.requests += 1
            xfer.wake.clear()
            await wait_event(clock, xfer.wake, min(self.retry_s, stop - now))
        return xfer.manifest

    def _adopt(self, xfer: Transfer, man: dict[str, Any], rep: TransferReport) -> None:
        """Make ``man`` the transfer's manifest, keeping the chunks whose digest it shares."""
        old = xfer.adopted
        n = len(man["d"]) // _DIGEST
        if old is None or old["sz"] != man["sz"] or old["cb"] != man["cb"]:
            xfer.parts.clear()
        else:
            new_d, old_d = man["d"], old["d"]
            for c in [c for c in xfer.parts if new_d[c * _DIGEST : (c + 1) * _DIGEST]
                      != old_d[c * _DIGEST : (c + 1) * _DIGEST]]:  # fmt: skip
                del xfer.parts[c]
            rep.chunks_resumed += len(xfer.parts)
        xfer.adopted, xfer.digests, xfer.nchunks = man, man["d"], n
        rep.nbytes, rep.chunks = man["sz"], n

    async def _fetch_whole(
        self, src: str, xfer: Transfer, deadline: float, rep: TransferReport
    ) -> bytes | None:
        """Pull the chunks from ``src`` and check the whole digest; the bytes, or None."""
        if not await self._fetch(src, xfer, deadline, rep):
            return None
        man = xfer.adopted
        assert man is not None
        data = xfer.assemble()  # nothing kept to resume from, whatever the check says
        if whole_digest(data) == man["w"]:
            rep.ok, rep.source, rep.meta = True, src, dict(man["m"])
            return data
        log.warning("peer %s: state from %s failed the whole check", self.node.peer_id, src)
        return None

    async def _fetch(self, src: str, xfer: Transfer, deadline: float, rep: TransferReport) -> bool:
        """Pull the missing chunks of the adopted manifest from ``src``; True when complete."""
        clock, node = self.node.clock, self.node
        assert xfer.adopted is not None
        sid = xfer.adopted["sid"]
        asked: dict[int, float] = {}
        progress = clock.now()
        done = len(xfer.parts)
        while not xfer.complete:
            now = clock.now()
            if xfer.gone or now >= deadline or now - progress > self.stall_timeout_s:
                return False
            if not self._alive(src):
                return False
            for c in [c for c, t in asked.items() if c in xfer.parts or now - t > self.retry_s]:
                del asked[c]
            missing = [c for c in xfer.missing() if c not in asked]
            for first, count in runs(missing[: max(0, self.window - len(asked))]):
                fields = {"op": "get", "x": xfer.xid, "sid": sid, "c": first, "n": count}
                node.send(src, StateKind.REQ, fields)
                rep.requests += 1
                for c in range(first, first + count):
                    asked[c] = now
            xfer.wake.clear()
            await wait_event(clock, xfer.wake, min(self.retry_s, deadline - now))
            if len(xfer.parts) > done:
                done, progress = len(xfer.parts), clock.now()
        return True
