"""Every packet of a lossy round tells the transport its round's chunk size.

Why it matters: a transport with two channels to one peer (``ZmqTransport``
with ``local_stream``: the loop-served stream and ZeroMQ's alias) picks the
channel from ``Transport.send``'s ``group_bytes`` alone, so a round stays in
order only if all its packets, data, ENDs, parity, copies, repair requests and
repair answers, carry the same value.  One packet that forgot it would take the
other channel and could overtake (or trail) the rest of its round.  Checked on
a MemoryNetwork with a FakeClock, as ``test_allreduce_parity.py``: the sender's
transport records each packet's hint by content, the receiver's decoder looks
it up by the same content and checks it against the packet's kind.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from gossipnet import Config, FakeClock
from gossipnet.collectives.chunks import ChunkPlan, ShardMap
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.collectives.lossy.kinds import KIND_RANGE, LossyKind
from gossipnet.runtime.node import Node
from gossipnet.transport.base import Buffer
from gossipnet.transport.wire import Packet

N = 4
CHUNK_BYTES = 1024
NUMEL = 4096 * 3  # 48 chunks of 256 float32, 12 per owner
IDS = tuple(f"p{i}" for i in range(N))


def _key(frames: Sequence[Buffer]) -> bytes:
    return b"".join(bytes(f) for f in frames)


class _Hints:
    """Each sent packet's ``group_bytes`` by content; each received packet's kind and hint."""

    def __init__(self) -> None:
        self.sent: dict[bytes, set[int]] = collections.defaultdict(set)
        self.seen: list[tuple[int, bool, int]] = []  # (kind, is parity, group_bytes)

    def wrap_sender(self, node: Node) -> None:
        transport = node.io.transport
        assert transport is not None
        send = transport.send

        def recording_send(
            dst: str, frames: Sequence[Buffer], *, urgent: bool = False, group_bytes: int = 0
        ) -> bool:
            self.sent[_key(frames)].add(group_bytes)
            return send(dst, frames, urgent=urgent, group_bytes=group_bytes)

        transport.send = recording_send  # type: ignore[method-assign]

    def wrap_receiver(self, node: Node, lost: Callable[[Packet], bool]) -> None:
        decode = node.codec.decode

        def checking_decode(frames: Any, *, local: bool = False) -> Packet | None:
            pkt = decode(frames, local=local)
            if pkt is None:
                return None
            (hint,) = self.sent[_key(frames)]  # one value per packet, however often sent
            self.seen.append((pkt.kind, "g" in pkt.fields, hint))
            return None if lost(pkt) else pkt

        node.codec.decode = checking_decode  # type: ignore[method-assign]


@pytest.mark.timeout(20)
def test_data_ends_parity_copies_and_repairs_carry_the_rounds_chunk_bytes(
    run_async: Callable[..., Any], cluster: Any, drive: Any, fast_config: Config
) -> None:
    """A repaired round with parity and two copies of every data packet; p0 loses
    two broadcast chunks of p2 and p2's parity, so it asks p2 again (REPAIR) and
    p2 answers.  Every packet of the collective's kinds carries the round's chunk
    size, and every other packet (membership, heartbeats) none."""
    cfg = fast_config.replace(chunk_bytes=CHUNK_BYTES, parity_group=3, parity_always=True)
    smap = ShardMap(ChunkPlan(NUMEL, torch.float32, CHUNK_BYTES), IDS)
    chosen = set(smap.chunks_of("p2")[:2])
    hints = _Hints()

    def lost(pkt: Packet) -> bool:
        """p2's first broadcast of ``chosen`` (copies then replay-dropped) and its parity."""
        if pkt.kind != LossyKind.AG_DATA or pkt.src != "p2":
            return False
        if "g" in pkt.fields:
            return True
        c = pkt.fields.get("c")
        if c in chosen:
            chosen.discard(c)  # the repair answer, a new packet, gets through
            return True
        return False

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            for node in nodes:
                hints.wrap_sender(node)
                hints.wrap_receiver(node, lost if node is nodes[0] else lambda _pkt: False)
            engines = [LossyAllReduce(n) for n in nodes]
            inputs = [torch.full((NUMEL,), float(i)) for i in range(N)]
            opts = RoundOptions(timeout_s=1.0, repair=True, redundancy=2)
            runs = [e.run([x], opts) for e, x in zip(engines, inputs, strict=True)]
            reports = await drive(clock, asyncio.gather(*runs), timeout_s=6.0)
            assert all(bool((x == 1.5).all()) for x in inputs)  # repaired: exact
            assert reports[0].chunks_stale == 0
            assert not chosen  # both losses happened

    run_async(main())
    lossy = [(k, parity, hint) for k, parity, hint in hints.seen if k in KIND_RANGE]
    other = [hint for k, _, hint in hints.seen if k not in KIND_RANGE]
    kinds = {k for k, _, _ in lossy}
    assert {LossyKind.RS_DATA, LossyKind.AG_DATA, LossyKind.REPAIR} <= kinds, kinds
    assert {LossyKind.RS_END, LossyKind.AG_END} & kinds, kinds  # ENDs of the first round
    assert any(parity for _, parity, _ in lossy)
    assert {hint for _, _, hint in lossy} == {CHUNK_BYTES}
    assert other
    assert set(other) == {0}
