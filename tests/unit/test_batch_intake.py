"""Per-drain delivery (``PacketIO.on_batch``) against per-packet delivery: same bits.

The backends that read a socket in drains (ZeroMQ, UDP) hand the node a drain's
packets at once; the lossy engine then adds a drain's chunks together
(``ShardReducer.accumulate_batch``).  Here the memory transport's deliveries are
grouped into drains of a seeded random size, in arrival order, and every result,
count and drop must equal the per-packet run's exactly.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from gossipnet import Config, FakeClock, FaultPlan
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.runtime.kinds import NodeKind
from gossipnet.runtime.node import Node
from gossipnet.testing.cluster import cluster

N = 4


def _batched(node: Node, seed: int, calls: list[int]) -> None:
    """Deliver ``node``'s packets in drains of 1..40, in arrival order, via ``on_batch``."""
    transport: Any = node.transport
    rng = random.Random(seed)
    queue: list[list[memoryview]] = []

    def flush() -> None:
        while queue:
            size = rng.randrange(1, 41)
            batch, queue[:] = queue[:size], queue[size:]
            calls.append(len(batch))
            node.io.on_batch(batch)

    def handler(views: list[memoryview]) -> None:
        if not queue:
            asyncio.get_running_loop().call_soon(flush)
        queue.append(views)

    transport._handler = handler


async def _rounds(
    drive: Any, cfg: Config, batched: bool, seed: int, loss: float
) -> tuple[list[list[torch.Tensor]], list[Any], list[dict[str, int]], list[int]]:
    clock = FakeClock()
    calls: list[int] = []
    faults = FaultPlan(loss=loss, seed=seed) if loss else None
    async with cluster(N, config=cfg, clock=clock, faults=faults) as nodes:
        if batched:
            for i, node in enumerate(nodes):
                _batched(node, seed + i, calls)
        engines = [LossyAllReduce(node) for node in nodes]
        gen = torch.Generator().manual_seed(seed)
        outs, reports = [], []
        for r in range(3):
            bufs = [
                [torch.randn(5000, generator=gen), torch.randn(77, generator=gen).double()]
                for _ in range(N)
            ]
            weights = [1.0, 0.5, 2.0, 1.0] if r == 1 else [1.0] * N
            runs = [
                e.run(b, RoundOptions(weight=w, timeout_s=2.0))
                for e, b, w in zip(engines, bufs, weights, strict=True)
            ]
            reports.append(await drive(clock, asyncio.gather(*runs), timeout_s=10))
            outs.append([t for b in bufs for t in b])
        drops = [dict(e.dropped) for e in engines]
    return outs, reports, drops, calls


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("seed", "loss"), [(1, 0.0), (2, 0.0), (3, 0.1)])
def test_drains_give_bit_identical_rounds(
    run_async: Any, drive: Any, fast_config: Config, seed: int, loss: float
) -> None:
    cfg = fast_config.replace(chunk_bytes=1024, parity_group=3 if loss else 0)

    async def main() -> None:
        one = await _rounds(drive, cfg, False, seed, loss)
        many = await _rounds(drive, cfg, True, seed, loss)
        assert max(many[3]) > 1  # drains of several packets did happen
        for r, (x, y) in enumerate(zip(one[0], many[0], strict=True)):
            assert _same(x, y), f"round {r} differs"
        for rep_one, rep_many in zip(one[1], many[1], strict=True):
            for a, b in zip(rep_one, rep_many, strict=True):
                assert (a.packets_received, a.chunks_stale, a.contributors) == (
                    b.packets_received,
                    b.chunks_stale,
                    b.contributors,
                )
        if not loss:
            assert one[2] == many[2]
        else:  # a drain is delivered a few callbacks later: a packet may miss a cut
            assert [{k: v for k, v in d.items() if k != "late"} for d in one[2]] == [
                {k: v for k, v in d.items() if k != "late"} for d in many[2]
            ]

    run_async(main())


def test_runs_keep_arrival_order_across_handlers(run_async: Any, fast_config: Config) -> None:
    """A drain [B, B, A, B, bad, B]: B's batch handler gets [B, B], then A's handler
    its packet, then B's the rest as one run (a rejected packet ends no run)."""
    from gossipnet.testing import MemoryNetwork

    calls: list[Any] = []

    async def main() -> None:
        async with cluster(2, config=fast_config, network=MemoryNetwork()) as nodes:
            rx, tx = nodes[0], nodes[1]
            rx.subscribe(901, lambda p: calls.append(("A", p.fields["i"])))
            rx.subscribe_batch(902, lambda ps: calls.append(("B", [p.fields["i"] for p in ps])))
            kinds = [902, 902, 901, 902, None, 902]
            batch = []
            for i, kind in enumerate(kinds):
                if kind is None:  # a forged packet: counted, dropped, ends nothing
                    frames = [memoryview(b"\x80"), memoryview(b""), memoryview(bytes(36))]
                else:
                    frames = [memoryview(bytes(f)) for f in tx.encode_for(["p0"], kind, {"i": i})]
                batch.append(frames)
            before = rx.codec.rejects["unknown_key"]
            rx.io.on_batch(batch)
            assert rx.codec.rejects["unknown_key"] == before + 1
            assert calls == [("B", [0, 1]), ("A", 2), ("B", [3, 5])]
            calls.clear()
            frames = [memoryview(bytes(f)) for f in tx.encode_for(["p0"], 902, {"i": 9})]
            rx.io.on_frames(frames)  # per packet: a run of one
            assert calls == [("B", [9])]

    run_async(main())


def test_a_drain_refreshes_each_senders_liveness_once(run_async: Any, fast_config: Config) -> None:
    """Per drain, a sender's data packets refresh its liveness once (same time, no
    address); one after a control packet (which may change the membership)
    refreshes it again, a node-control packet's address moves it, a data packet's
    ``addr`` field moves nothing; per-packet delivery still refreshes each time."""
    from gossipnet.testing import MemoryNetwork

    async def main() -> list[tuple[str, str | None]]:
        async with cluster(2, config=fast_config, network=MemoryNetwork()) as nodes:
            rx, tx = nodes[0], nodes[1]
            rx.subscribe(901, lambda p: None)
            rx.subscribe_batch(902, lambda ps: None)
            members: Any = rx.io.membership
            heard: list[tuple[str, str | None]] = []
            real = members.heard_from

            def spy(peer: str, epoch: int, address: str | None, now: float) -> None:
                heard.append((peer, address))
                real(peer, epoch, address, now)

            members.heard_from = spy

            def frames(kind: int, fields: dict[str, Any]) -> list[memoryview]:
                return [memoryview(bytes(f)) for f in tx.encode_for(["p0"], kind, fields)]

            rx.io.on_batch([frames(902, {"i": i}) for i in range(5)])
            assert heard == [("p1", None)]
            heard.clear()
            addr = {"i": 0, "addr": "mem://p1"}
            rx.io.on_batch(
                [frames(902, {"i": 1}), frames(902, addr), frames(901, {"i": 2}),
                 frames(902, {"i": 3}), frames(902, {"i": 4})]
            )  # fmt: skip
            # i=1; (a data packet's addr: ignored); (the control packet); i=3 after it
            assert heard == [("p1", None), ("p1", None)]
            heard.clear()
            rx.io.on_batch([frames(902, {"i": 5}), frames(NodeKind.HEARTBEAT, {"addr": "mem://p1"})])
            assert heard == [("p1", None), ("p1", "mem://p1")]
            heard.clear()
            for i in range(3):
                rx.io.on_frames(frames(902, {"i": i}))
            return heard

    assert run_async(main()) == [("p1", None)] * 3
