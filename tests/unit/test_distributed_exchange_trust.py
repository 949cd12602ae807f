"""What the torch backend's exact exchange takes in: parts from the group's ranks only,
for a collective within the window of the one running, within what it can need.

Why: ``broadcast_object_list`` and ``all_gather_object`` unpickle what these messages
carry, so a part taken from a peer outside the group, or kept for any collective,
without bound, is code run (and memory held) on a stranger's word.

Four nodes on a MemoryNetwork under a FakeClock (no sockets, waits cost no real time):
``p0``, ``p1``, ``p2`` are the group's ranks; ``p3`` is a peer that authenticates (it
holds the run's key) but is not one of them.  Every refused part must be a counted drop
by reason, and a legitimate collective must still complete with the right bytes.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from gossipnet import Config, FakeClock
from gossipnet.distributed.exchange import PART_OVERHEAD, Exchange
from gossipnet.distributed.kinds import DistKind
from gossipnet.runtime.node import Node

PART = 1024
#: A cap small enough to fill with a few parts, below the legitimate messages' size.
CAP = 8 * (PART + PART_OVERHEAD)
GROUP = ("p0", "p1", "p2")


async def _part(
    clock: FakeClock, drive: Any, node: Node, dst: str, op: int, i: int, n: int, payload: bytes
) -> None:
    """``node`` sends one part to ``dst`` (acknowledged by its node, taken in or not)."""
    fields = {"o": op, "i": i, "n": n}
    assert await drive(clock, node.send_reliable(dst, DistKind.PART, fields, payload, timeout_s=2))


def _exchanges(nodes: list[Node]) -> list[Exchange]:
    """An exchange per rank p0..p2, each taking in only the other two."""
    return [
        Exchange(n, PART, [m for m in GROUP if m != n.peer_id], max_buffered_bytes=CAP)
        for n in nodes[:3]
    ]


async def _allgather(
    clock: FakeClock, drive: Any, exs: list[Exchange], op: int, msgs: list[bytes]
) -> list[dict[str, bytes]]:
    """Collective ``op`` on the three ranks: each sends its message to the two others."""
    runs = [
        ex.run(
            op,
            dict.fromkeys(sorted(ex.members), msg),
            sorted(ex.members),
            5.0,
            expect=len(msg),
            excuse_dead=False,
        )
        for ex, msg in zip(exs, msgs, strict=True)
    ]
    return list(await drive(clock, asyncio.gather(*runs), timeout_s=30.0))


@pytest.mark.timeout(60)
def test_parts_from_outside_the_group_window_count_or_cap_are_counted_drops(
    run_async: Any, cluster: Any, drive: Any, fast_config: Config
) -> None:
    rng = random.Random(7)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(4, config=fast_config, clock=clock) as nodes:
            p1, p2, p3 = nodes[1], nodes[2], nodes[3]
            exs = _exchanges(nodes)
            ex0 = exs[0]
            assert ex0.window == 3  # the group's size: collectives 1..3 are taken in
            evil = rng.randbytes(64)
            await _part(clock, drive, p3, "p0", 1, 0, 1, evil)  # authenticated, not a rank
            await _part(clock, drive, p1, "p0", 0, 0, 1, evil)  # before the first collective
            await _part(clock, drive, p1, "p0", 4, 0, 1, evil)  # beyond the window
            await _part(clock, drive, p1, "p0", 2, 0, 1 << 31, evil)  # claims 2**31 parts
            await _part(clock, drive, p1, "p0", 3, 0, 2, evil)  # taken in (collective 3) ...
            await _part(clock, drive, p1, "p0", 3, 0, 2, evil)  # ... but only once
            for i in range(20):  # p2 runs ahead with more than the cap allows
                await _part(clock, drive, p2, "p0", 3, i, 20, rng.randbytes(PART))
            c = ex0.counters
            assert c["dropped_not_member"] == 1
            assert c["dropped_stale"] == 1
            assert c["dropped_ahead"] == 1
            assert c["dropped_count"] == 1
            assert c["dropped_duplicate"] == 1
            kept = (CAP - len(evil) - PART_OVERHEAD) // (PART + PART_OVERHEAD)
            assert c["dropped_over_cap"] == 20 - kept
            assert c["parts_in"] == 1 + kept
            assert ex0.buffered_bytes <= CAP

            # a legitimate collective, each message larger than the cap (the running one
            # is bounded by what it expects, not by the cap); then late and foreign parts
            msgs = [rng.randbytes(3 * CAP) for _ in GROUP]
            gathered = await _allgather(clock, drive, exs, 1, msgs)
            for me, got in enumerate(gathered):
                assert got == {GROUP[r]: msgs[r] for r in range(3) if r != me}
            await _part(clock, drive, p3, "p0", 2, 0, 1, evil)
            await _part(clock, drive, p1, "p0", 1, 0, 1, evil)  # collective 1 is over
            assert c["dropped_not_member"] == 2
            assert c["dropped_stale"] == 2
            assert c["malformed"] == 0

    run_async(main())


@pytest.mark.timeout(60)
def test_a_message_larger_than_the_collective_expects_is_refused_and_named(
    run_async: Any, cluster: Any, drive: Any, fast_config: Config
) -> None:
    """A rank's message for the running collective beyond its expected size (early or
    on time) is not taken in: the collective raises at once naming that rank."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=fast_config, clock=clock) as nodes:
            exs = _exchanges(nodes)
            # early: two parts of collective 1 buffered before it runs, 2 KiB in all
            await _part(clock, drive, nodes[1], "p0", 1, 0, 2, b"a" * PART)
            await _part(clock, drive, nodes[1], "p0", 1, 1, 2, b"b" * PART)
            with pytest.raises(ValueError, match=r"collective #1: p1 sent more than the 16"):
                await drive(clock, exs[0].run(1, {}, ["p1"], 5.0, expect=16, excuse_dead=False))
            # on time: collective 2 runs, p2's message is bigger than expected
            run = asyncio.ensure_future(
                exs[0].run(2, {}, ["p2"], 5.0, expect=16, excuse_dead=False)
            )
            await _part(clock, drive, nodes[2], "p0", 2, 0, 1, b"c" * 17)
            with pytest.raises(ValueError, match=r"collective #2: p2 sent more than the 16"):
                await drive(clock, run)
            assert exs[0].counters["dropped_size"] == 1
            assert exs[0].buffered_bytes == 0  # both collectives' parts were freed

    run_async(main())


@pytest.mark.timeout(60)
def test_the_running_collective_does_not_crowd_the_next_one_out_of_the_cap(
    run_async: Any, cluster: Any, drive: Any, fast_config: Config
) -> None:
    """While a collective larger than the cap is being collected, a rank that already
    finished it sends its part of the next one: that part is kept (the cap bounds what
    is held for collectives not running yet, not the running one's own bytes)."""
    rng = random.Random(11)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=fast_config, clock=clock) as nodes:
            ex0 = _exchanges(nodes)[0]
            big = rng.randbytes(3 * CAP)
            n = -(-len(big) // PART)
            run = asyncio.ensure_future(
                ex0.run(1, {}, ["p1", "p2"], 5.0, expect=len(big), excuse_dead=False)
            )
            for i in range(n):  # p1's whole message for collective 1
                chunk = big[i * PART : (i + 1) * PART]
                await _part(clock, drive, nodes[1], "p0", 1, i, n, chunk)
            assert ex0.buffered_bytes > CAP
            await _part(clock, drive, nodes[1], "p0", 2, 0, 1, b"next")  # kept
            assert ex0.counters["dropped_over_cap"] == 0
            for i in range(n):  # p2's, and collective 1 completes
                chunk = big[i * PART : (i + 1) * PART]
                await _part(clock, drive, nodes[2], "p0", 1, i, n, chunk)
            assert await drive(clock, run) == {"p1": big, "p2": big}
            got = await drive(clock, ex0.run(2, {}, ["p1"], 5.0, expect=4, excuse_dead=False))
            assert got == {"p1": b"next"}
            assert ex0.buffered_bytes == 0

    run_async(main())
