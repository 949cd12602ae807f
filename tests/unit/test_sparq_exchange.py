"""SPARQ-SGD's exchange over nodes: estimates resync after loss, consensus, forged packets.

Three nodes on a MemoryNetwork under a FakeClock (waits cost no real time), every
link lossy through a seeded ``FaultPlan`` until the test turns loss off.  What
must hold: under loss the copies fall behind and are repaired (NACK, replay or
refresh); once loss stops, every copy equals its sender's estimate bit for bit
within a bounded number of rounds and the replicas' spread shrinks; forged or
malformed packets are counted drops that change nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from gossipnet import Config, FakeClock, FaultPlan, SparQ
from gossipnet.collectives.sparq.codec import Layout
from gossipnet.collectives.sparq.exchange import SparqExchange
from gossipnet.collectives.sparq.kinds import SparqKind

N, D = 3, 6000


def spread(xs: list[torch.Tensor]) -> float:
    mean = torch.stack(xs).mean(0)
    return max(float((x - mean).norm()) for x in xs)


async def rounds(
    exs: list[SparqExchange], xs: list[torch.Tensor], first: int, count: int, drive: Any,
    clock: FakeClock, gamma: float, step: float, gen: torch.Generator,
) -> None:  # fmt: skip
    """``count`` rounds: a local move of ``step`` per peer, then a SPARQ round each."""
    for rnd in range(first, first + count):
        for x in xs:
            x.add_(torch.randn(D, generator=gen), alpha=step)
        others = [{q.node.peer_id: 1.0 / N for q in exs if q is not e} for e in exs]
        runs = [
            e.round(rnd, x, w, trigger=True, timeout_s=1.0)
            for e, x, w in zip(exs, xs, others, strict=True)
        ]
        outs = await drive(clock, asyncio.gather(*runs), timeout_s=30.0)
        for x, out in zip(xs, outs, strict=True):
            x.add_(out.mix, alpha=gamma)


def in_sync(exs: list[SparqExchange]) -> bool:
    """Every copy equals its sender's estimate, bit for bit."""
    for e in exs:
        for other in exs:
            if other is e:
                continue
            held = e.held.get(other.node.peer_id)
            if held is None or not torch.equal(held.vec, other.own.vec):
                return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [1, 2])
def test_copies_resync_and_replicas_converge_after_loss_stops(
    seed: int, run_async: Any, cluster: Any, drive: Any, fast_config: Config
) -> None:
    lossy = [True]
    plan = FaultPlan(seed=seed, link_loss=lambda s, d, t: 0.2 if lossy[0] else 0.0)
    settings = SparQ(density=0.2, gamma=0.5, history=2, repair_wait_s=0.2)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=fast_config, clock=clock, faults=plan) as nodes:
            layout = Layout.for_payload(D, settings.density, 1024)
            gen = torch.Generator().manual_seed(seed)
            xs = [torch.randn(D, generator=gen) * (i + 1) for i in range(N)]
            exs = [SparqExchange(n, layout, settings, x) for n, x in zip(nodes, xs, strict=True)]
            await rounds(exs, xs, 0, 12, drive, clock, settings.gamma, 0.05, gen)
            resync = sum((e.resync for e in exs), start=type(exs[0].resync)())
            assert resync["gap"] > 0
            assert resync["nacks_sent"] > 0
            assert resync["blocks_replay"] + resync["blocks_refresh"] > 0  # ...and repaired
            assert not any(e.drops for e in exs)  # loss is no malformed packet
            lossy[0] = False
            at_stop = spread(xs)
            for k in range(3):  # bounded: copies are exact within 3 lossless rounds
                await rounds(exs, xs, 12 + k, 1, drive, clock, settings.gamma, 0.0, gen)
                if in_sync(exs):
                    break
            assert in_sync(exs), "copies still differ 3 rounds after loss stopped"
            await rounds(exs, xs, 15, 25, drive, clock, settings.gamma, 0.0, gen)
            assert spread(xs) < 0.1 * at_stop, (at_stop, spread(xs))

    run_async(main())


@pytest.mark.timeout(30)
def test_forged_packets_are_counted_drops_and_change_nothing(
    run_async: Any, cluster: Any, drive: Any, wait_until: Any, fast_config: Config
) -> None:
    settings = SparQ(density=0.1, repair_wait_s=0.0)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(2, config=fast_config, clock=clock) as nodes:
            layout = Layout.for_payload(D, settings.density, 1024)
            xs = [torch.full((D,), float(i)) for i in range(2)]
            exs = [SparqExchange(n, layout, settings, x) for n, x in zip(nodes, xs, strict=True)]
            runs = [e.round(0, x, {o: 0.5}, trigger=False, timeout_s=1.0)
                    for e, x, o in zip(exs, xs, ("p1", "p0"), strict=True)]  # fmt: skip
            await drive(clock, asyncio.gather(*runs))
            await wait_until(lambda: in_sync(exs), 5.0, clock=clock, what="first refresh")
            held = exs[0].held["p1"].vec.clone()
            forger, p = nodes[1], "p0"
            forged: list[tuple[SparqKind, dict[str, Any], bytes]] = [
                (SparqKind.DELTA, {"b": 10**6, "u": 0, "n": 1, "r": 0}, b"\0" * 7),
                (SparqKind.DELTA, {"b": 0, "u": 0, "n": 2, "r": 0}, b"\0" * 7),
                (SparqKind.DELTA, {"b": 0, "u": "x", "n": 1, "r": 0}, b"\0" * 7),
                (SparqKind.REFRESH, {"b": 0, "u": 5, "o": 3, "n": 1}, b"\0" * 4),
                (SparqKind.REFRESH, {"b": 0, "u": 5, "o": 0, "n": 256},
                 np.full(256, np.nan, "<f4").tobytes()),
                (SparqKind.END, {"r": 1, "t": 0, "d": D + 1}, b"\0" * 4),
                (SparqKind.END, {"r": -1, "t": 0, "d": D}, b""),
                (SparqKind.NACK, {"r": 1}, b"\xff" * 8),
                (SparqKind.NACK, {"r": 1}, b"\0" * 5),
            ]  # fmt: skip
            for kind, fields, payload in forged:
                forger.send(p, kind, fields, payload)
            await wait_until(lambda: sum(exs[0].drops.values()) == len(forged), 5.0, clock=clock)
            assert exs[0].drops == {"delta": 3, "refresh": 2, "end": 2, "nack": 2}
            assert torch.equal(exs[0].held["p1"].vec, held)
            assert in_sync(exs)

    run_async(main())
