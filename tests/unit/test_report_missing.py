"""What a round's report says about the peers it heard: ``missing`` and ``ok``.

A peer is missing from a round only if it owed this peer data (its contribution to a
chunk this peer owns, or its broadcast of a chunk it owns) and nothing of it arrived.
With fewer chunks than peers (a small model is one chunk, owned by the first peer)
the peers that own nothing owe each other nothing: before, each of them named every
other such peer missing, so every lossless round of a small model read ``ok: False``
on all ranks but the owner.  Four nodes on a MemoryNetwork under a FakeClock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from gossipnet import CollectiveReport, Config, FakeClock
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions

N = 4
IDS = tuple(f"p{i}" for i in range(N))
#: 100 float32 (400 bytes) at 1 KiB chunks: one chunk, owned by p0.
SMALL = 100
#: 16 chunks of 1 KiB: every peer owns four.
LARGE = 4096


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    return fast_config.replace(chunk_bytes=1024)


async def _round(
    drive: Any, clock: FakeClock, engines: Sequence[LossyAllReduce], numel: int, seed: int
) -> list[CollectiveReport]:
    gen = torch.Generator().manual_seed(seed)
    runs = [
        e.run([torch.randn(numel, generator=gen)], RoundOptions(timeout_s=2.0)) for e in engines
    ]
    return list(await drive(clock, asyncio.gather(*runs), timeout_s=10.0))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("numel", [SMALL, LARGE], ids=["one-chunk", "every-peer-owns"])
def test_a_lossless_round_is_ok_on_every_peer(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, numel: int
) -> None:
    """Every peer of a lossless round reports ``ok`` and nobody missing, also where
    three of the four own no chunk (before: each named the other two missing)."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(node) for node in nodes]
            for seed in range(3):
                for rep in await _round(drive, clock, engines, numel, seed):
                    assert rep.participants == IDS
                    assert rep.missing == (), rep
                    assert rep.packets_lost == 0, rep
                    assert rep.chunks_stale == 0, rep
                    assert rep.ok, rep

    run_async(main())


@pytest.mark.timeout(30)
def test_a_silent_owner_is_missing_for_everyone(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p0 owns the one chunk and sends nothing: every other peer owed its broadcast
    names it missing and is not ok."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(node) for node in nodes]
            reports = await _round(drive, clock, engines[1:], SMALL, 0)
            for rep in reports:
                assert rep.missing == ("p0",), rep
                assert not rep.ok

    run_async(main())


@pytest.mark.timeout(30)
def test_a_silent_peer_that_owns_nothing_is_missing_for_the_owner(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p3 owns no chunk and sends nothing: the owner, p0, owed its contribution,
    names it missing; p1 and p2 were owed nothing by p3 and do not."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            engines = [LossyAllReduce(node) for node in nodes]
            reports = await _round(drive, clock, engines[:3], SMALL, 0)
            assert reports[0].missing == ("p3",), reports[0]
            assert not reports[0].ok
            for rep in reports[1:]:
                assert "p3" not in rep.contributors
                assert rep.missing == (), rep

    run_async(main())
