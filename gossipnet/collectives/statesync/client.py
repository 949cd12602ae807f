"""The downloading side of state transfer: manifests, chunks, resume, a second donor.

Split from :mod:`.sync` (the protocol is described there).  A download asks a
source for its manifest (validated by :func:`.manifest.parse_manifest` before
anything is allocated), then pulls the missing chunks in windows, re-asking
what did not come; a source that makes no progress for ``stall_timeout_s`` is
left for the next, keeping the chunks whose digest the next one shares.  A
second donor's manifest is compared beside the fetch (reported, not fatal).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gossipnet.collectives.statesync.kinds import StateKind
from gossipnet.collectives.statesync.manifest import DIGEST_BYTES, chunk_size, parse_manifest
from gossipnet.collectives.statesync.snapshot import chunk_digest, whole_digest
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("MAX_STATE_BYTES", "StateClient", "TransferReport")

log = logging.getLogger(__name__)

_DIGEST = DIGEST_BYTES
#: Default bound of a state we accept to download (a manifest's claimed size).
MAX_STATE_BYTES = 16 << 30


@dataclass(slots=True)
class TransferReport:
    """What a download did: where from, how much was resumed or re-sent."""

    ok: bool = False
    source: str | None = None
    sources_tried: tuple[str, ...] = ()
    nbytes: int = 0
    chunks: int = 0
    chunks_resumed: int = 0
    chunks_corrupt: int = 0
    requests: int = 0
    elapsed_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    #: the donor whose manifest was compared with the source's (None: no other)
    second_donor: str | None = None
    #: whether its whole-state digest matched (None: not compared)
    donors_agree: bool | None = None


@dataclass
class _Transfer:
    """Client-side state of one download (survives a change of source)."""

    xid: str
    src: str | None = None  # the peer asked now: replies from others are dropped
    manifest: dict[str, Any] | None = None
    waiting: bool = False
    gone: bool = False
    buf: bytearray = field(default_factory=bytearray)
    have: list[bool] = field(default_factory=list)
    digests: bytes = b""
    corrupt: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class StateClient:
    """Downloads other peers' published state; loop thread only.

    Args:
        node: the started node.
        window_chunks: chunks asked for at once (flow control without acks).
        retry_s: re-ask for outstanding chunks after this long without progress.
        stall_timeout_s: leave a source that made no progress this long.
        max_state_bytes: a manifest claiming a larger state is rejected (a peer
            must not make us allocate what it likes).
    """

    def __init__(
        self,
        node: Node,
        *,
        window_chunks: int,
        retry_s: float,
        stall_timeout_s: float,
        max_state_bytes: int,
    ) -> None:
        self.node = node
        self.window = window_chunks
        self.retry_s = retry_s
        self.stall_timeout_s = stall_timeout_s
        self.max_state_bytes = max_state_bytes
        #: replies dropped, by reason ("manifest", "foreign_reply")
        self.rejects: collections.Counter[str] = collections.Counter()
        self._xfers: dict[str, _Transfer] = {}
        node.subscribe(StateKind.DATA, self._on_data)

    def _on_data(self, pkt: Packet) -> None:
        xid = pkt.fields.get("x")
        xfer = self._xfers.get(xid) if isinstance(xid, str) else None
        if xfer is None:
            return
        if pkt.src != xfer.src:  # a transfer id leaked or guessed: not the peer we asked
            self.rejects["foreign_reply"] += 1
            return
        op = pkt.fields.get("op")
        if op == "chunk":
            self._on_chunk(xfer, pkt)
            return
        if op == "man":
            manifest = parse_manifest(
                pkt.fields,
                pkt.payload,
                max_bytes=self.max_state_bytes,
                max_chunk=self.node.config.max_payload_bytes,
            )
            if manifest is None:
                self.rejects["manifest"] += 1
                log.warning("peer %s: bad state manifest from %s", self.node.peer_id, pkt.src)
                return
            xfer.manifest = manifest
        elif op == "wait":
            xfer.waiting = True
        elif op == "gone":
            xfer.gone = True
        xfer.wake.set()

    def _on_chunk(self, xfer: _Transfer, pkt: Packet) -> None:
        man, c = xfer.manifest, pkt.fields.get("c")
        if man is None or pkt.fields.get("sid") != man["sid"] or type(c) is not int:
            return
        if not 0 <= c < len(xfer.have) or xfer.have[c]:
            return
        if len(pkt.payload) != chunk_size(man, c) or (
            chunk_digest(pkt.payload) != xfer.digests[c * _DIGEST : (c + 1) * _DIGEST]
        ):
            xfer.corrupt += 1
            return
        start = c * man["cb"]
        xfer.buf[start : start + len(pkt.payload)] = pkt.payload
        xfer.have[c] = True
        xfer.wake.set()

    async def download(
        self,
        *,
        sources: Sequence[str] | None = None,
        timeout_s: float = 30.0,
        max_age_s: float | None = 5.0,
    ) -> tuple[bytes | None, TransferReport]:
        """Fetch the state of a live peer; ``(None, report)`` if none could serve it.

        Never raises for what peers send: a bad manifest or a foreign reply is
        counted in :attr:`rejects` and the source is left.

        Args:
            sources: peers to try in order (default: every alive peer but us).
            timeout_s: bound of the whole download.
            max_age_s: during the first half of the timeout, accept only a snapshot
                published at most this long before our first request (0: after it;
                None: any age), so a joiner gets current state.
        """
        node, clock = self.node, self.node.clock
        t0 = clock.now()
        deadline = t0 + timeout_s
        xfer = _Transfer(secrets.token_hex(6))
        self._xfers[xfer.xid] = xfer
        rep = TransferReport()
        tried: list[str] = []
        try:
            while clock.now() < deadline:
                pool = list(sources) if sources is not None else node.alive_peers()
                pool = [p for p in pool if p != node.peer_id and node.membership.is_alive(p)]  # type: ignore[union-attr]
                fresh = [p for p in pool if p not in tried] or pool
                if not fresh:
                    await clock.sleep(min(self.retry_s, max(0.0, deadline - clock.now())))
                    continue
                src = fresh[0]
                tried.append(src)
                relax_at = t0 + timeout_s / 2 if max_age_s is not None else t0
                age = (max_age_s, relax_at)
                if not await self._manifest(src, xfer, deadline, age, rep):
                    continue
                second = next((p for p in pool if p != src and p != rep.second_donor), None)
                xfer.src = src
                # the cross-check runs beside the fetch, not before it: a second donor
                # that is mid-step answers late, and a peer realigning must not fall
                # further behind for a check whose mismatch is only reported
                check = (
                    asyncio.ensure_future(self._cross_check(second, xfer, deadline, age, rep))
                    if second is not None
                    else None
                )
                fetched = await self._fetch(src, xfer, deadline, rep)
                await _settle(clock, check, self.retry_s)
                if fetched:
                    data = bytes(xfer.buf)
                    assert xfer.manifest is not None
                    if whole_digest(data) == xfer.manifest["w"]:
                        rep.ok, rep.source, rep.meta = True, src, dict(xfer.manifest["m"])
                        return data, rep
                    log.warning("peer %s: state from %s failed the whole check", node.peer_id, src)
                    # its chunks match its digests but not its whole: keep none of them,
                    # and do not ask again at once (a liar would keep us spinning)
                    xfer.manifest = None
                    await clock.sleep(min(self.retry_s, max(0.0, deadline - clock.now())))
            return None, rep
        finally:
            del self._xfers[xfer.xid]
            rep.sources_tried = tuple(tried)
            rep.chunks_corrupt = xfer.corrupt
            rep.elapsed_s = clock.now() - t0

    async def _cross_check(
        self,
        donor: str,
        xfer: _Transfer,
        deadline: float,
        age: tuple[float | None, float],
        rep: TransferReport,
    ) -> None:
        """Ask ``donor`` for its manifest too and compare whole-state digests.

        Why not refuse on a mismatch: two honest replicas differ while one is a
        step ahead, so a mismatch is reported (and logged), not fatal.
        """
        assert xfer.manifest is not None
        other = _Transfer(secrets.token_hex(6))
        self._xfers[other.xid] = other
        try:
            theirs = await self._ask_manifest(donor, other, deadline, age, rep)
        finally:
            del self._xfers[other.xid]
        if theirs is None:
            return
        rep.second_donor = donor
        rep.donors_agree = theirs["w"] == xfer.manifest["w"] and theirs["sz"] == xfer.manifest["sz"]
        if not rep.donors_agree:
            log.warning(
                "peer %s: state manifests of %s and %s differ (a step apart, or one is wrong)",
                self.node.peer_id,
                xfer.src,
                donor,
            )

    async def _ask_manifest(
        self,
        src: str,
        xfer: _Transfer,
        deadline: float,
        age: tuple[float | None, float],
        rep: TransferReport,
    ) -> dict[str, Any] | None:
        """Ask ``src`` for a manifest until one valid arrives; None on a stall.

        ``age`` is (max snapshot age, time after which any age will do).  A source
        that answers ``wait`` is preparing a fresh snapshot and gets a longer
        allowance (4 x ``stall_timeout_s``) than a silent one.
        """
        clock = self.node.clock
        start = clock.now()
        stop = min(deadline, start + self.stall_timeout_s)
        xfer.src, xfer.manifest, xfer.gone, xfer.waiting = src, None, False, False
        while xfer.manifest is None:
            now = clock.now()
            if now >= stop or not self.node.membership.is_alive(src):  # type: ignore[union-attr]
                return None
            if xfer.waiting:  # preparing a snapshot: ask again later, not at once
                xfer.waiting = False
                stop = min(deadline, start + 4 * self.stall_timeout_s)
                await clock.sleep(min(self.retry_s, max(0.0, stop - now)))
                continue
            max_age = age[0] if age[0] is not None and now < age[1] else -1.0
            self.node.send(src, StateKind.REQ, {"op": "man", "x": xfer.xid, "a": max_age})
            rep.requests += 1
            xfer.wake.clear()
            await _wait_event(clock, xfer.wake, min(self.retry_s, stop - now))
        return xfer.manifest

    async def _manifest(
        self,
        src: str,
        xfer: _Transfer,
        deadline: float,
        age: tuple[float | None, float],
        rep: TransferReport,
    ) -> bool:
        """Ask ``src`` for a manifest; adopt it, keeping chunks whose digest is unchanged."""
        old = xfer.manifest
        man = await self._ask_manifest(src, xfer, deadline, age, rep)
        if man is None:
            xfer.manifest = old
            return False
        n = len(man["d"]) // _DIGEST
        if old is None or old["sz"] != man["sz"] or old["cb"] != man["cb"]:
            try:
                xfer.buf, xfer.have = bytearray(man["sz"]), [False] * n
            except MemoryError:  # within max_state_bytes, yet more than this host has
                self.rejects["manifest"] += 1
                log.warning("peer %s: no memory for %d B of state", self.node.peer_id, man["sz"])
                xfer.manifest = old
                return False
        else:
            new_d, old_d = man["d"], old["d"]
            span = [slice(c * _DIGEST, (c + 1) * _DIGEST) for c in range(n)]
            keep = [h and new_d[span[c]] == old_d[span[c]] for c, h in enumerate(xfer.have)]
            rep.chunks_resumed += sum(keep)
            xfer.have = keep
        xfer.digests = man["d"]
        rep.nbytes, rep.chunks = man["sz"], n
        return True

    async def _fetch(self, src: str, xfer: _Transfer, deadline: float, rep: TransferReport) -> bool:
        """Pull the missing chunks of the adopted manifest from ``src``; True when complete."""
        clock, node = self.node.clock, self.node
        assert xfer.manifest is not None
        sid = xfer.manifest["sid"]
        asked: dict[int, float] = {}
        progress = clock.now()
        done = sum(xfer.have)
        while not all(xfer.have):
            now = clock.now()
            if xfer.gone or now >= deadline or now - progress > self.stall_timeout_s:
                return False
            if not node.membership.is_alive(src):  # type: ignore[union-attr]
                return False
            for c in [c for c, t in asked.items() if xfer.have[c] or now - t > self.retry_s]:
                del asked[c]
            missing = [c for c, h in enumerate(xfer.have) if not h and c not in asked]
            for first, count in _runs(missing[: max(0, self.window - len(asked))]):
                fields = {"op": "get", "x": xfer.xid, "sid": sid, "c": first, "n": count}
                node.send(src, StateKind.REQ, fields)
                rep.requests += 1
                for c in range(first, first + count):
                    asked[c] = now
            xfer.wake.clear()
            await _wait_event(clock, xfer.wake, min(self.retry_s, deadline - now))
            now_done = sum(xfer.have)
            if now_done > done:
                done, progress = now_done, clock.now()
        return True


def _runs(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted chunk indices as (first, count) runs of consecutive indices."""
    out: list[tuple[int, int]] = []
    for c in chunks:
        if out and out[-1][0] + out[-1][1] == c:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((c, 1))
    return out


async def _settle(clock: Any, task: asyncio.Future[None] | None, grace_s: float) -> None:
    """Give ``task`` up to ``grace_s`` more to finish, then cancel it."""
    if task is None:
        return
    if not task.done():
        done = asyncio.Event()
        task.add_done_callback(lambda _t: done.set())
        await _wait_event(clock, done, grace_s)
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _wait_event(clock: Any, event: asyncio.Event, timeout_s: float) -> None:
    waiter = asyncio.ensure_future(event.wait())
    sleeper = asyncio.ensure_future(clock.sleep(max(0.0, timeout_s)))
    try:
        await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        sleeper.cancel()
