"""A sender that goes quiet mid-stream: cut once, then waited for (a learned window).

Why: a phase cuts a sender whose packets stopped once nobody delivered for
``phase_min_wait_s``; on a crowded machine a live peer can pause longer than
that (measured on 2 cores: 0.16-0.22 s mid reduce-scatter), and cutting it left
its contributions out of the round at 0% loss.  Its packets then arrive late,
which teaches the engine how long it was quiet (``cut.StallWindow``); later
phases wait that long before cutting, and its heartbeats tell its peers.  Pure
loss never teaches it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from gossipnet.collectives.lossy.cut import StallWindow, cut_time
from gossipnet.collectives.lossy.round import Phase
from gossipnet.config import Config
from gossipnet.testing import FaultPlan

from .test_allreduce import N, allreduce, engines_of

STALL_S = 0.3  # longer than phase_min_wait_s (0.1), shorter than failure_timeout_s


@pytest.fixture
def cfg(fast_config: Config) -> Config:
    return fast_config.replace(chunk_bytes=1024, heartbeat_interval_s=0.1, failure_timeout_s=5.0)


def _stall_after(node: Any, sends: int) -> None:
    """From now on, ``node`` sends ``sends`` packets, then nothing for ``STALL_S``, then
    everything it held, in order: what peers see of a descheduled process."""
    transport = node.transport
    send, send_batch = transport.send, transport.send_batch
    held: list[tuple[str, Sequence[Any]]] = []
    left = [sends]

    def release() -> None:
        transport.send, transport.send_batch = send, send_batch
        for dst, frames in held:
            send(dst, frames)

    def holding_send(
        dst: str, frames: Sequence[Any], *, urgent: bool = False, group_bytes: int = 0
    ) -> bool:
        if left[0] > 0:
            left[0] -= 1
            return bool(send(dst, frames, urgent=urgent, group_bytes=group_bytes))
        if not held:
            asyncio.get_running_loop().call_later(STALL_S, release)
        held.append((dst, [bytes(f) for f in frames]))  # what a socket buffer would hold
        return True

    def holding_batch(dst: str, packets: Sequence[Sequence[Any]], *, group_bytes: int = 0) -> int:
        return sum(holding_send(dst, frames, group_bytes=group_bytes) for frames in packets)

    transport.send, transport.send_batch = holding_send, holding_batch


@pytest.mark.timeout(60)
def test_a_stalled_sender_is_cut_once_then_waited_for(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """p1 pauses 0.3 s after its first packets in rounds 1 and 2.  Round 1: an owner
    that already had p1's first packet cuts it (its contributions arrive late: the
    stall did bite; owners that had nothing from it wait, as for a late starter); the
    late packets teach those owners the stall, so round 2 waits: nothing lost."""

    async def main() -> list[list[Any]]:
        async with cluster(N, config=cfg) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(3)
            reports = []
            for r in range(3):
                if r in (1, 2):
                    _stall_after(nodes[1], 6)
                inputs = [[torch.randn(8192, generator=gen)] for _ in range(N)]
                reports.append(await allreduce(drive, None, engines, inputs, timeout_s=5.0))
                await asyncio.sleep(STALL_S)  # the held packets are out before the next round
            cut = [i for i, rep in enumerate(reports[1]) if rep.packets_lost]
            assert cut  # the stall is longer than phase_min_wait_s: some owner cut p1
            for i in cut:  # and each of them learned it from p1's late packets
                assert engines[i].dropped["late"] > 0
                # wall time: a loaded host shortens what is measured, never to nothing
                assert engines[i]._stalls.own(engines[i].next_round) >= 0.5 * STALL_S
            # their heartbeats told the others, who never had to cut p1 to learn it
            for e in engines:
                assert e._stalls.allowance(e.next_round) >= STALL_S
            return reports

    reports = run_async(main())
    lost = [sum(rep.packets_lost for i, rep in enumerate(rnd) if i != 1) for rnd in reports]
    assert lost[0] == 0
    assert lost[1] > 0, lost  # cut: the stall is longer than phase_min_wait_s
    assert lost[2] == 0, lost  # learned: waited out
    assert all(set(rep.contributors) == {f"p{i}" for i in range(N)} for rep in reports[2])


@pytest.mark.timeout(60)
def test_pure_loss_teaches_no_stall(
    run_async: Callable[..., Any], cluster: Any, drive: Any, cfg: Config
) -> None:
    """Lost packets never arrive late: the window stays 0, lossy rounds stay short."""

    async def main() -> list[Any]:
        def faults(i: int) -> FaultPlan:
            return dataclasses.replace(FaultPlan(loss=0.2, seed=4), seed=4 + i)

        async with cluster(N, config=cfg, faults=faults) as nodes:
            engines = engines_of(nodes)
            gen = torch.Generator().manual_seed(5)
            stale = 0
            for _ in range(6):
                inputs = [[torch.randn(8192, generator=gen)] for _ in range(N)]
                reps = await allreduce(drive, None, engines, inputs, timeout_s=5.0)
                stale += sum(r.chunks_stale for r in reps)
            assert stale > 0  # the loss did bite
            return engines

    engines = run_async(main())
    assert all(e._stalls.allowance(e.next_round) == 0.0 for e in engines)


def test_window_is_learned_capped_and_forgotten() -> None:
    w = StallWindow(cap_s=0.5, memory_rounds=4)
    assert w.allowance(0) == 0.0
    w.observe(0.2, round_=3)
    assert w.allowance(3) == pytest.approx(0.3)
    w.observe(10.0, round_=4)  # an outage, not a stall: capped
    assert w.allowance(5) == 0.5
    assert w.allowance(9) == 0.0  # nothing seen within the last 4 rounds
    with pytest.raises(ValueError, match="cap_s"):
        StallWindow(cap_s=-1.0)


def test_peers_announcements_count_and_are_forgotten() -> None:
    w = StallWindow(cap_s=0.5, memory_rounds=4)
    w.heard("b", 0.2)
    assert w.own(0) == 0.0  # never announced back: no echo between peers
    assert w.allowance(0) == pytest.approx(0.3)
    w.heard("c", 9.0)  # capped
    assert w.allowance(0) == 0.5
    w.forget("c")
    w.heard("b", 0.0)  # b's own observation aged out
    assert w.allowance(0) == 0.0


def test_cut_time_waits_the_learned_silence() -> None:
    cfg = Config()
    phase = Phase(expected={"a"})
    phase.arrived("a", 1.0)
    short = cut_time(cfg, phase, "a", 1e-4, 10)
    assert short == pytest.approx(1.0 + cfg.phase_min_wait_s)
    assert cut_time(cfg, phase, "a", 1e-4, 10, silence=0.4) == pytest.approx(1.4)
