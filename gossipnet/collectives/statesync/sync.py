"""State transfer for late joiners and restarts: chunked, checksummed, resumable.

A peer that joins late or comes back after a crash must not start from its
own random initialisation: its first Moshpit rounds would pull its group far
from everyone else.  Instead it downloads the current parameters and
optimizer state from a live peer (hivemind's "late joiners copy state from an
advertiser"), with no central checkpoint.

Protocol (kinds ``STATE_REQ`` / ``STATE_DATA``; plain packets, the client
retries):

- ``man``: the client asks for a manifest; the server answers with its latest
  *snapshot*: size, chunk size, a BLAKE2b-128 digest per chunk and a
  BLAKE2b-256 of the whole.  A snapshot published more than ``max_age_s``
  before the client's first request (or none) is answered ``wait`` and raises
  :attr:`StateSync.wanted`, so the training thread publishes a fresh one at
  its next step (the trainer owns the tensors; the loop thread never reads
  them mid-step).  ``max_age_s=0`` thus asks for state at most one step old.
- ``get``: the client asks for a run of chunks of snapshot ``sid``; each
  arrives in its own packet, is checked against its digest, and is written
  in place.  Missing chunks are asked again; a source that makes no progress
  for ``stall_timeout_s`` (dead, partitioned, serving corrupt data) is left
  for the next one.
- Resume: chunks whose digest is the same in the new source's manifest are
  kept, so a transfer moves to another source without starting over (after a
  Moshpit average, peers' snapshots are often identical: nothing is redone).

Trust: a manifest is validated field by field (types, ranges, a
size at most ``max_state_bytes`` or the caller's own bound, digests that match the
chunking) before anything is kept from it; a bad one is a counted reject
(``StateSync.rejects["manifest"]``, ``["oversize"]``) and the source is left, never an
exception out of :meth:`StateSync.download`.  Chunks are kept as they arrive, each
checked against its digest, so memory follows the data received, never the size a
manifest claims.  A reply from another peer than the one
asked is dropped (``rejects["foreign_reply"]``).  Where a second live donor
exists its manifest is asked too and the whole-state digests compared
(``TransferReport.second_donor``, ``donors_agree``): agreement confirms the
state; a disagreement is logged and reported but the download goes on from the
first donor, because replicas may honestly differ by a step.  A caller that must
not take one peer's word (the optimizer's realignment, ``training._realign``)
asks many peers for a snapshot at the same *target* step
(:meth:`StateSync.manifests`), compares the claims and chunk digests their
manifests carry, and only then downloads the chunks enough of them agree on
(:meth:`StateSync.fetch_chunks`).

Layout: :class:`StateSync` is one object for the node, made of the serving
side (:mod:`.server`) and the downloading side (:mod:`.client`); snapshots and
their digests are :mod:`.snapshot`, manifest checks :mod:`.manifest`.
``save_atomic`` (:mod:`.checkpoint`) writes an optional local checkpoint (temp file, fsync,
``os.replace``): a crash leaves the old file or the new one, never half.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gossipnet.collectives.statesync.checkpoint import (
    load_checkpoint,
    pack_state,
    save_atomic,
    unpack_state,
)
from gossipnet.collectives.statesync.client import (
    MAX_STATE_BYTES,
    Manifests,
    StateClient,
    TransferReport,
)
from gossipnet.collectives.statesync.server import StateServer
from gossipnet.collectives.statesync.snapshot import Snapshot
from gossipnet.runtime.node import Node

__all__ = (
    "MAX_STATE_BYTES",
    "Manifests",
    "Snapshot",
    "StateSync",
    "TransferReport",
    "load_checkpoint",
    "pack_state",
    "save_atomic",
    "unpack_state",
)


class StateSync:
    """Serves this peer's published state and downloads others'; loop thread only.

    Args: those of :class:`StateClient` (``window_chunks`` also paces the server).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(
        self,
        node: Node,
        *,
        window_chunks: int = 64,
        retry_s: float = 0.25,
        stall_timeout_s: float = 2.0,
        max_state_bytes: int = MAX_STATE_BYTES,
    ) -> None:
        if window_chunks < 1 or retry_s <= 0 or stall_timeout_s <= 0 or max_state_bytes < 0:
            raise ValueError(
                "window_chunks >= 1, retry_s > 0, stall_timeout_s > 0 and "
                "max_state_bytes >= 0 required"
            )
        self.node = node
        self.server = StateServer(node, window_chunks=window_chunks)
        self.client = StateClient(
            node,
            window_chunks=window_chunks,
            retry_s=retry_s,
            stall_timeout_s=stall_timeout_s,
            max_state_bytes=max_state_bytes,
        )

    # ------------------------------------------------------------------ server
    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk of the snapshots we publish."""
        return self.server.chunk_bytes

    @property
    def snapshots(self) -> list[Snapshot]:
        """The snapshots served now (the latest last)."""
        return self.server.snapshots

    @property
    def wanted(self) -> bool:
        """A peer asked for state we do not have fresh: the trainer should publish."""
        return self.server.wanted

    @property
    def on_wanted(self) -> Callable[[], None] | None:
        """Called (loop thread, must not block) whenever a peer asks for fresh state."""
        return self.server.on_wanted

    @on_wanted.setter
    def on_wanted(self, hook: Callable[[], None] | None) -> None:
        self.server.on_wanted = hook

    def wanted_at(self, kind: int) -> int | None:
        """The lowest step a peer asked a snapshot of ``kind`` for that we have not
        published yet (None: none asked)."""
        return self.server.wanted_at(kind)

    @property
    def served_chunks(self) -> int:
        """Chunks sent to other peers so far."""
        return self.server.served_chunks

    def publish(self, data: bytes, meta: dict[str, Any] | None = None) -> Snapshot:
        """Make ``data`` (e.g. :func:`pack_state`) the state served to others."""
        return self.server.publish(data, meta)

    def install(self, snap: Snapshot) -> None:
        """Serve ``snap`` (built with :meth:`Snapshot.of` off the loop thread)."""
        self.server.install(snap)

    # ------------------------------------------------------------------ client
    @property
    def rejects(self) -> collections.Counter[str]:
        """Replies dropped, by reason (``"manifest"``, ``"oversize"``, ``"foreign_reply"``)."""
        return self.client.rejects

    async def download(
        self,
        *,
        sources: Sequence[str] | None = None,
        timeout_s: float = 30.0,
        max_age_s: float | None = 5.0,
        max_bytes: int | None = None,
    ) -> tuple[bytes | None, TransferReport]:
        """Fetch the state of a live peer; ``(None, report)`` if none could serve it.

        See :meth:`.client.StateClient.download`; never raises for what peers send.
        """
        return await self.client.download(
            sources=sources, timeout_s=timeout_s, max_age_s=max_age_s, max_bytes=max_bytes
        )

    async def manifests(
        self,
        sources: Sequence[str],
        targets: Sequence[tuple[int, int]],
        *,
        timeout_s: float,
        enough: Callable[[Manifests], bool],
        max_bytes: int | None = None,
    ) -> Manifests:
        """Ask every source for a snapshot at every ``(kind, step)`` target; what came
        by ``timeout_s`` or once ``enough`` (see :meth:`.client.StateClient.manifests`)."""
        return await self.client.manifests(
            sources, targets, timeout_s=timeout_s, enough=enough, max_bytes=max_bytes
        )

    async def fetch_chunks(
        self,
        wanted: Mapping[int, bytes],
        holders: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        timeout_s: float,
    ) -> tuple[dict[int, bytes], TransferReport]:
        """The chunks ``wanted`` (index -> digest), each from a holder whose manifest
        lists that digest (see :meth:`.client.StateClient.fetch_chunks`)."""
        return await self.client.fetch_chunks(wanted, holders, timeout_s=timeout_s)
