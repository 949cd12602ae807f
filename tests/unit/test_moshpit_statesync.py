"""State transfer for late joiners (chunked, checksummed, resumable) and atomic checkpoints.

Nodes on a MemoryNetwork under a FakeClock; 1 KiB chunks so a few hundred
KiB make hundreds of chunks, and a small request window so a transfer is
still under way when its source dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipnet import Config, FakeClock
from gossipnet.collectives.statesync.kinds import StateKind
from gossipnet.collectives.statesync.sync import (
    StateSync,
    load_checkpoint,
    pack_state,
    save_atomic,
    unpack_state,
)

CHUNK = 1024
NET = {"heartbeat_interval_s": 0.1, "failure_timeout_s": 0.6, "control_timeout_s": 1.0}


@pytest.fixture
def cfg() -> Config:
    return Config(**NET, chunk_bytes=CHUNK)


def blob(nbytes: int, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8).numpy())


def syncs(nodes: list[Any], **kw: Any) -> list[StateSync]:
    return [StateSync(n, **kw) for n in nodes]


@pytest.mark.timeout(30)
def test_download_is_chunked_checksummed_and_exact(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            ss = syncs(nodes)
            data = blob(300 * CHUNK + 17)
            snap = ss[0].publish(data, {"step": 41})
            assert snap.nchunks == 301
            got, rep = await drive(clock, ss[2].download(sources=["p0"], timeout_s=5))
            assert got == data
            assert rep.ok
            assert rep.source == "p0"
            assert rep.meta == {"step": 41}
            assert rep.chunks == 301
            assert rep.nbytes == len(data)
            assert rep.chunks_resumed == 0
            assert rep.chunks_corrupt == 0
            assert ss[0].served_chunks == 301  # nothing sent twice on a lossless network

    run_async(main())


@pytest.mark.timeout(30)
def test_transfer_resumes_from_another_source_when_the_first_dies(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p0 dies (no goodbye) after 100 of 400 chunks; p1 serves the same snapshot
    (peers hold identical state after an exact average): only the rest moves."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            ss = syncs(nodes, window_chunks=8, stall_timeout_s=0.5)
            data = blob(400 * CHUNK, seed=1)
            ss[0].publish(data)
            ss[1].publish(data)
            send = nodes[0].send
            served = 0
            tasks: list[asyncio.Future[None]] = []

            def dying_send(peer: str, kind: int, fields: Any = None, payload: Any = b"") -> bool:
                nonlocal served
                if kind == StateKind.DATA and fields and fields.get("op") == "chunk":
                    served += 1
                    if served == 101:  # crash: no goodbye, no more heartbeats
                        tasks.append(asyncio.ensure_future(nodes[0].close(announce=False)))
                    if served > 100:
                        return False
                return send(peer, kind, fields, payload)

            nodes[0].send = dying_send  # type: ignore[method-assign]
            got, rep = await drive(clock, ss[2].download(sources=["p0", "p1"], timeout_s=10))
            assert got == data
            assert rep.ok
            assert rep.source == "p1"
            assert rep.sources_tried == ("p0", "p1")
            assert rep.chunks_resumed == 100
            assert ss[1].served_chunks == 300

    run_async(main())


@pytest.mark.timeout(30)
def test_corrupt_chunks_are_refused_and_the_source_abandoned(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """A source whose bytes no longer match its digests (memory corruption, a bug)."""

    async def main() -> None:
        clock = FakeClock()
        async with cluster(3, config=cfg, clock=clock) as nodes:
            ss = syncs(nodes, window_chunks=16, stall_timeout_s=0.5)
            data = blob(64 * CHUNK, seed=2)
            snap = ss[0].publish(data)
            bad = bytearray(data)
            bad[5 * CHUNK + 3] ^= 0xFF
            ss[0].snapshots[-1] = dataclasses.replace(snap, data=bytes(bad))
            ss[1].publish(data)
            got, rep = await drive(clock, ss[2].download(sources=["p0", "p1"], timeout_s=10))
            assert got == data
            assert rep.ok
            assert rep.source == "p1"
            assert rep.chunks_corrupt >= 1
            assert rep.chunks_resumed == 63  # every good chunk from p0 was kept

    run_async(main())


@pytest.mark.timeout(30)
def test_stale_or_missing_state_asks_the_trainer_for_a_fresh_one(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config, wait_until: Any
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=cfg, clock=clock) as nodes:
            ss = syncs(nodes)
            ss[0].publish(b"old state", {"step": 1})
            clock.advance(10.0)  # older than max_age_s
            fut = asyncio.ensure_future(drive(clock, ss[1].download(timeout_s=5, max_age_s=2.0)))
            await wait_until(lambda: ss[0].wanted, 2, clock=clock)
            ss[0].publish(b"new state", {"step": 2})  # what the training thread does
            got, rep = await fut
            assert got == b"new state"
            assert rep.meta == {"step": 2}
            assert not ss[0].wanted

    run_async(main())


@pytest.mark.timeout(30)
def test_no_source_gives_none_within_the_deadline(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=cfg, clock=clock) as nodes:
            ss = syncs(nodes, stall_timeout_s=0.3)
            t0 = clock.now()
            got, rep = await drive(clock, ss[1].download(timeout_s=2, max_age_s=None))
            assert got is None
            assert not rep.ok
            assert "p0" in rep.sources_tried
            assert clock.now() - t0 <= 2.0 + 0.3

    run_async(main())


# --------------------------------------------------------------------------- bytes and files
def test_pack_unpack_round_trip_is_weights_only() -> None:
    state = {
        "params": [torch.randn(3, 4), torch.arange(5)],
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}}},
        "step": 7,
    }
    out = unpack_state(pack_state(state))
    assert out["step"] == 7
    assert torch.equal(out["params"][0], state["params"][0])
    assert torch.equal(out["optim"]["state"][0]["exp_avg"], torch.ones(2))

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("true",))

    with pytest.raises(Exception, match=r"Weights only load failed|Unsupported"):
        unpack_state(pack_state({"x": Evil()}))


def test_save_atomic_replaces_whole_files_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    assert load_checkpoint(path) is None
    save_atomic(path, b"first")
    save_atomic(path, b"second")
    assert load_checkpoint(path) == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_crash_while_saving_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pt"
    save_atomic(path, b"good")

    def boom(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        save_atomic(path, b"half")
    assert load_checkpoint(path) == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
