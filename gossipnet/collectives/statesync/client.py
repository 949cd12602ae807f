"""The downloading side of state transfer: manifests, chunks, resume, a second donor.

Split from :mod:`.sync` (the protocol is described there).  A download asks a
source for its manifest (validated by :func:`.manifest.parse_manifest`, and its
size against the transfer's bound, before anything is kept from it), then pulls
the missing chunks in windows, re-asking what did not come; a source that makes
no progress for ``stall_timeout_s`` is left for the next, keeping the chunks whose
digest the next one shares.  Chunks are kept as they arrive, each checked against
its digest: memory follows the data received, not the size a manifest claims.

Two ways in: :meth:`StateClient.download` (any live source, a second donor's
manifest compared beside the fetch, reported) and, for a caller that must
compare several peers' claims before it takes anything,
:meth:`StateClient.manifests` (ask many peers, stop when the caller has enough)
then :meth:`StateClient.fetch_chunks` (the chunks the caller chose, each from a
peer whose manifest lists the digest the caller expects for it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gossipnet.collectives.statesync.kinds import StateKind
from gossipnet.collectives.statesync.manifest import DIGEST_BYTES, chunk_size, parse_manifest
from gossipnet.collectives.statesync.snapshot import chunk_digest
from gossipnet.collectives.statesync.steps import TransferSteps
from gossipnet.collectives.statesync.transfer import Transfer, TransferReport, settle
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("MAX_STATE_BYTES", "Manifests", "StateClient", "TransferReport")

log = logging.getLogger(__name__)

_DIGEST = DIGEST_BYTES
#: Default bound of a state we accept to download (a manifest's claimed size);
#: a caller that knows what it expects passes its own (``max_bytes``).
MAX_STATE_BYTES = 16 << 30
#: Manifests gathered by :meth:`StateClient.manifests`: (peer, target) -> manifest.
Manifests = dict[tuple[str, tuple[int, int]], dict[str, Any]]


class StateClient(TransferSteps):
    """Downloads other peers' published state; loop thread only.

    Args:
        node: the started node.
        window_chunks: chunks asked for at once (flow control without acks).
        retry_s: re-ask for outstanding chunks after this long without progress.
        stall_timeout_s: leave a source that made no progress this long.
        max_state_bytes: a manifest claiming a larger state is rejected (a peer
            must not make us allocate what it likes); each call may lower it.
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
        #: replies dropped, by reason: "manifest" (every refused manifest), "oversize"
        #: (those among them larger than the transfer's bound), "foreign_reply"
        self.rejects: collections.Counter[str] = collections.Counter()
        self._xfers: dict[str, Transfer] = {}
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
            sz = pkt.fields.get("sz")
            if type(sz) is int and sz > xfer.limit:
                self.rejects["manifest"] += 1
                self.rejects["oversize"] += 1
                log.warning(
                    "peer %s: %s offers %d B of state, more than the %d B expected",
                    self.node.peer_id, pkt.src, sz, xfer.limit,
                )  # fmt: skip
                xfer.gone = True  # leave this source
                xfer.wake.set()
                return
            manifest = parse_manifest(
                pkt.fields,
                pkt.payload,
                max_bytes=xfer.limit,
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

    def _on_chunk(self, xfer: Transfer, pkt: Packet) -> None:
        man, c = xfer.adopted, pkt.fields.get("c")
        if man is None or pkt.fields.get("sid") != man["sid"] or type(c) is not int:
            return
        if not 0 <= c < xfer.nchunks or c in xfer.parts:
            return
        if xfer.need is not None and c not in xfer.need:
            return
        if len(pkt.payload) != chunk_size(man, c) or (
            chunk_digest(pkt.payload) != xfer.digests[c * _DIGEST : (c + 1) * _DIGEST]
        ):
            xfer.corrupt += 1
            return
        xfer.parts[c] = bytes(pkt.payload)
        xfer.wake.set()

    # ------------------------------------------------------------------ any source
    async def download(
        self,
        *,
        sources: Sequence[str] | None = None,
        timeout_s: float = 30.0,
        max_age_s: float | None = 5.0,
        max_bytes: int | None = None,
    ) -> tuple[bytes | None, TransferReport]:
        """Fetch the state of a live peer; ``(None, report)`` if none could serve it.

        Never raises for what peers send: a bad or oversized manifest or a foreign
        reply is counted in :attr:`rejects` and the source is left.

        Args:
            sources: peers to try in order (default: every alive peer but us).
            timeout_s: bound of the whole download.
            max_age_s: during the first half of the timeout, accept only a snapshot
                published at most this long before our first request (0: after it;
                None: any age), so a joiner gets current state.
            max_bytes: the largest state accepted (default: ``max_state_bytes``);
                a caller that knows its model's size passes a bound from it.
        """
        node, clock = self.node, self.node.clock
        t0 = clock.now()
        deadline = t0 + timeout_s
        xfer = self._open(max_bytes)
        rep = TransferReport()
        tried: list[str] = []
        try:
            while clock.now() < deadline:
                pool = list(sources) if sources is not None else node.alive_peers()
                pool = [p for p in pool if p != node.peer_id and self._alive(p)]
                fresh = [p for p in pool if p not in tried] or pool
                if not fresh:
                    await clock.sleep(min(self.retry_s, max(0.0, deadline - clock.now())))
                    continue
                src = fresh[0]
                tried.append(src)
                relax_at = t0 + timeout_s / 2 if max_age_s is not None else t0
                age = (max_age_s, relax_at)
                man = await self._ask_manifest(src, xfer, deadline, {"a": age}, rep)
                if man is None:  # silent, refused or gone: do not ask again at once
                    await clock.sleep(min(self.retry_s, max(0.0, deadline - clock.now())))
                    continue
                self._adopt(xfer, man, rep)
                second = next((p for p in pool if p != src and p != rep.second_donor), None)
                # the cross-check runs beside the fetch, not before it: a second donor
                # that is mid-step answers late, and a peer realigning must not fall
                # further behind for a check whose mismatch is only reported
                check = (
                    asyncio.ensure_future(self._cross_check(second, xfer, deadline, age, rep))
                    if second is not None
                    else None
                )
                data = await self._fetch_whole(src, xfer, deadline, rep)
                await settle(clock, check, self.retry_s)
                if data is not None:
                    return data, rep
                # do not ask again at once (a liar would keep us spinning)
                await clock.sleep(min(self.retry_s, max(0.0, deadline - clock.now())))
            return None, rep
        finally:
            self._close(xfer, rep, tried, t0)

    async def _cross_check(
        self,
        donor: str,
        xfer: Transfer,
        deadline: float,
        age: tuple[float | None, float],
        rep: TransferReport,
    ) -> None:
        """Ask ``donor`` for its manifest too and compare whole-state digests.

        Why not refuse on a mismatch: two honest replicas differ while one is a
        step ahead, so a mismatch is reported (and logged), not fatal.
        """
        assert xfer.adopted is not None
        mine = xfer.adopted
        other = self._open(xfer.limit)
        try:
            theirs = await self._ask_manifest(donor, other, deadline, {"a": age}, rep)
        finally:
            del self._xfers[other.xid]
        if theirs is None:
            return
        rep.second_donor = donor
        rep.donors_agree = theirs["w"] == mine["w"] and theirs["sz"] == mine["sz"]
        if not rep.donors_agree:
            log.warning(
                "peer %s: state manifests of %s and %s differ (a step apart, or one is wrong)",
                self.node.peer_id, xfer.src, donor,
            )  # fmt: skip

    # ------------------------------------------------------------------ compared claims
    async def manifests(
        self,
        sources: Sequence[str],
        targets: Sequence[tuple[int, int]],
        *,
        timeout_s: float,
        enough: Callable[[Manifests], bool],
        max_bytes: int | None = None,
    ) -> Manifests:
        """Ask every source for a snapshot at every target; what came, once ``enough``.

        A target is ``(kind, step)`` (see :mod:`.server`): a source that has no such
        snapshot yet answers ``wait`` and publishes one when its trainer gets there,
        so it is asked again until ``timeout_s``.  ``enough`` is called with what
        has arrived after each new manifest; True ends the wait.  Never raises for
        what peers send (bad or oversized manifests are counted and left out).
        """
        clock = self.node.clock
        deadline = clock.now() + timeout_s
        got: Manifests = {}
        rep = TransferReport()
        asks: dict[asyncio.Future[dict[str, Any] | None], tuple[str, tuple[int, int]]] = {}
        xfers: list[Transfer] = []
        for src in sources:
            for target in targets:
                xfer = self._open(max_bytes)
                xfers.append(xfer)
                ask = self._ask_manifest(src, xfer, deadline, {"t": target}, rep, patient=True)
                asks[asyncio.ensure_future(ask)] = (src, target)
        try:
            pending = set(asks)
            while pending and clock.now() < deadline:
                timer = asyncio.ensure_future(clock.sleep(max(0.0, deadline - clock.now())))
                done, _ = await asyncio.wait(pending | {timer}, return_when=asyncio.FIRST_COMPLETED)
                timer.cancel()
                finished = [fut for fut in pending if fut in done]
                for fut in finished:
                    pending.discard(fut)
                    man = fut.result()
                    if man is not None:
                        got[asks[fut]] = man
                if finished and enough(got):
                    break
            return got
        finally:
            for fut in asks:
                fut.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
            for xfer in xfers:
                self._xfers.pop(xfer.xid, None)

    async def fetch_chunks(
        self,
        wanted: Mapping[int, bytes],
        holders: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        timeout_s: float,
    ) -> tuple[dict[int, bytes], TransferReport]:
        """The chunks ``wanted`` (index -> digest) from ``holders`` (peer, its manifest
        from :meth:`manifests`), each from the first holder whose manifest lists that
        digest for it and serves it; what arrived (index -> bytes, each checked
        against its digest), possibly not all.  Never raises for what peers send."""
        clock = self.node.clock
        t0 = clock.now()
        deadline = t0 + timeout_s
        got: dict[int, bytes] = {}
        rep = TransferReport()
        tried: list[str] = []
        for src, man in holders:
            left = {c for c in wanted if c not in got}
            span = [(c, man["d"][c * _DIGEST : (c + 1) * _DIGEST]) for c in sorted(left)]
            mine = frozenset(c for c, d in span if d == wanted[c])
            if not mine or clock.now() >= deadline:
                continue
            if src == self.node.peer_id or not self._alive(src):
                continue
            tried.append(src)
            xfer = self._open(None)
            xfer.src, xfer.need = src, mine
            self._adopt(xfer, dict(man), rep)
            try:
                await self._fetch(src, xfer, deadline, rep)
                got.update(xfer.parts)
                rep.chunks_corrupt += xfer.corrupt
            finally:
                self._xfers.pop(xfer.xid, None)
        rep.ok = len(got) == len(wanted)
        rep.sources_tried = tuple(tried)
        rep.nbytes = sum(len(b) for b in got.values())
        rep.chunks = len(got)
        rep.source = tried[0] if tried else None
        rep.elapsed_s = clock.now() - t0
        return got, rep
