"""One download's bookkeeping and its report, and the waits the client uses.

Split from :mod:`.client` (the downloading side) to keep modules small: the
client's methods drive a :class:`Transfer`; packets fill it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ("Transfer", "TransferReport", "runs", "settle", "wait_event")


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
class Transfer:
    """Client-side state of one download (survives a change of source).

    ``parts`` holds the chunks that arrived and matched their digests, by index:
    memory grows with the data received, never with the size a manifest claims.
    """

    xid: str
    #: the largest state this transfer accepts (bytes; a larger manifest is refused)
    limit: int
    src: str | None = None  # the peer asked now: replies from others are dropped
    manifest: dict[str, Any] | None = None  # the last one the peer asked sent
    adopted: dict[str, Any] | None = None  # the one whose chunks ``parts`` holds
    waiting: bool = False
    gone: bool = False
    parts: dict[int, bytes] = field(default_factory=dict)
    nchunks: int = 0
    #: the chunks wanted (None: all of the adopted manifest's)
    need: frozenset[int] | None = None
    digests: bytes = b""
    corrupt: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        if self.need is None:
            return len(self.parts) == self.nchunks
        return all(c in self.parts for c in self.need)

    def missing(self) -> list[int]:
        """The wanted chunks not received yet, in order."""
        wanted = range(self.nchunks) if self.need is None else sorted(self.need)
        return [c for c in wanted if c not in self.parts]

    def assemble(self) -> bytes:
        """The chunks in order, as one bytes; forgets them and the adopted manifest."""
        data = b"".join(self.parts[c] for c in range(self.nchunks))
        self.parts.clear()
        self.adopted, self.nchunks = None, 0
        return data


def runs(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted chunk indices as (first, count) runs of consecutive indices."""
    out: list[tuple[int, int]] = []
    for c in chunks:
        if out and out[-1][0] + out[-1][1] == c:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((c, 1))
    return out


async def settle(clock: Any, task: asyncio.Future[Any] | None, grace_s: float) -> None:
    """Give ``task`` up to ``grace_s`` more to finish, then cancel it."""
    if task is None:
        return
    if not task.done():
        done = asyncio.Event()
        task.add_done_callback(lambda _t: done.set())
        await wait_event(clock, done, grace_s)
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_event(clock: Any, event: asyncio.Event, timeout_s: float) -> None:
    """Wait for ``event`` at most ``timeout_s`` seconds on ``clock``."""
    waiter = asyncio.ensure_future(event.wait())
    sleeper = asyncio.ensure_future(clock.sleep(max(0.0, timeout_s)))
    try:
        await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        sleeper.cancel()
