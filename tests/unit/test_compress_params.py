"""The optimizer's compressed parameter broadcast, one chunk at a time, and the residual.

No network: an owner's round and a receiver's round over the same replica
values.  In a parameter round the owner's broadcast of a chunk is its *update*
(the new parameters minus the chunk every replica holds), at the compressor's
blocks and in its value codec, so it costs what a broadcast of averages costs;
the receiver adds it to its own chunk and holds exactly the owner's bits.  An
update where averages belong (or the reverse), or one that would overflow the
receiver's parameters, is a counted drop.  The residual
(``gossipnet.training._residual``) keeps ``master - replica`` across steps,
ownership changes and resyncs.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import pytest
import torch

from gossipnet import DCT, ArcTopK, Int8
from gossipnet.clock import FakeClock
from gossipnet.collectives.compress import CompressSession
from gossipnet.collectives.lossy import gather, scatter
from gossipnet.collectives.lossy.round import Round
from gossipnet.training._residual import Residual
from gossipnet.transport.wire import Packet

IDS = ("p0", "p1", "p2", "p3")
CHUNK_BYTES = 1024  # 256 float32 values per chunk


class _Ctx:
    """The part of a PhaseContext the decoders touch."""

    def __init__(self) -> None:
        self.dropped: collections.Counter[str] = collections.Counter()
        self.node = type("N", (), {"clock": FakeClock()})()

    def note_after_end(self, rnd: Any, pkt: Any) -> None:
        pass

    def spans(self, phase: str) -> collections.deque[float]:
        return collections.deque()


def _round(spec: Any, me: str, replica: torch.Tensor, *, param_mode: bool = True) -> Round:
    """A round of ``me`` whose ``dst`` holds ``replica`` (the parameters), its
    gradients seeded alike on every peer."""
    grads = [torch.randn(4096, generator=torch.Generator().manual_seed(3))]
    rnd = Round(5, me, IDS, grads, [replica.clone()], 1.0, [CHUNK_BYTES])
    sess = CompressSession(spec)
    rnd.codec = sess
    sess.begin(rnd, param_mode)
    rnd.sending = False
    return rnd


def _pkt(src: str, c: int, z: int, payload: bytes) -> Packet:
    fields = {"r": 5, "m": 0, "L": 0, "b": 0, "c": c, "dt": "u8", "n": len(payload), "z": z,
              "w": 1.0}  # fmt: skip
    return Packet(src, 1, 1, 16, fields, memoryview(payload))


SPECS = [
    ArcTopK(density=0.1, values="int8"),
    ArcTopK(density=0.1),
    DCT(density=0.1, values="int8"),
    Int8(),
    "bf16",
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_update_is_compressed_and_every_replica_holds_the_owners_bits(spec: Any) -> None:
    replica = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    owner, receiver = _round(spec, "p0", replica), _round(spec, "p1", replica)
    c = owner.owned[0].start
    n = owner.plans[0].chunk(c)[1]
    off = owner.plans[0].chunk(c)[0]
    # the gradients still go as contributions (never flagged as updates): the owner
    # adds the receiver's
    ctx = _Ctx()
    rcodec = receiver.codec
    assert rcodec is not None
    rz, rpayload = rcodec.encode_rs(receiver, "p0", 0, c)
    scatter.on_rs(ctx, owner, _pkt("p1", c, rz, rpayload))  # type: ignore[arg-type]
    assert not ctx.dropped, ctx.dropped
    assert owner.reducers[0].has("p1", c)
    # the owner's new parameters: a large step on one block, a tiny one elsewhere
    update = 1e-6 * torch.randn(n, generator=torch.Generator().manual_seed(2))
    update[32:48] += 0.01 * torch.arange(1, 17, dtype=torch.float32)
    master = replica[off : off + n] + update
    codec = owner.codec
    assert codec is not None
    got = codec.encode_ag(owner, 0, c, master.clone(), lambda _p: True)
    assert got is not None  # never left dense
    z, payload, decoded = got
    sparse = isinstance(spec, (ArcTopK, DCT))
    # what travels: a tenth of the dense chunk (sparse), a quarter or half (quantisers)
    assert len(payload) < (0.25 if sparse else 0.55) * n * 4, len(payload)
    # the receiver adds the update to its own chunk: the owner's bits exactly
    gather.on_ag(ctx, receiver, _pkt("p0", c, z, payload))  # type: ignore[arg-type]
    assert not ctx.dropped, ctx.dropped
    assert bool(receiver.got_np[0][c])
    assert torch.equal(receiver.plans[0].view(receiver.dst[0], c), decoded)
    # the large step arrived (up to the value codec's rounding: fp32 exactly, the
    # others within 1%); elsewhere the replica moved by at most the tiny step
    moved = decoded - replica[off : off + n]
    exact = isinstance(spec, ArcTopK) and spec.values == "fp32"
    tol = 1e-5 if exact else 0.01
    assert torch.allclose(moved[32:48], update[32:48], rtol=tol, atol=1e-4)
    rest = torch.cat([moved[:32], moved[48:]])
    assert float(rest.abs().max()) < 1e-5


@pytest.mark.parametrize("spec", [ArcTopK(density=0.1, values="int8"), Int8()], ids=str)
def test_update_where_averages_belong_and_overflow_are_counted_drops(spec: Any) -> None:
    replica = torch.zeros(4096)
    owner = _round(spec, "p0", replica)
    c = owner.owned[0].start
    n = owner.plans[0].chunk(c)[1]
    codec = owner.codec
    assert codec is not None
    got = codec.encode_ag(owner, 0, c, torch.full((n,), 1e38), lambda _p: True)
    assert got is not None
    z, payload, _ = got
    # a receiver in an averaging round (the all-reduce) never takes it as averages
    averaging = _round(spec, "p1", replica, param_mode=False)
    ctx = _Ctx()
    gather.on_ag(ctx, averaging, _pkt("p0", c, z, payload))  # type: ignore[arg-type]
    assert ctx.dropped == {"compressed_kind": 1}
    # a receiver whose parameters the update would carry past float32: dropped
    huge = _round(spec, "p1", torch.full((4096,), 3e38))
    gather.on_ag(ctx, huge, _pkt("p0", c, z, payload))  # type: ignore[arg-type]
    assert ctx.dropped == {"compressed_kind": 1, "non_finite": 1}
    assert not bool(averaging.got_np[0][c])
    assert not bool(huge.got_np[0][c])
    assert bool((huge.dst[0] == 3e38).all())  # nothing written


def test_averages_where_an_update_belongs_are_counted_drops() -> None:
    spec = Int8()
    replica = torch.zeros(4096)
    averaging = _round(spec, "p0", replica, param_mode=False)
    c = averaging.owned[0].start
    n = averaging.plans[0].chunk(c)[1]
    codec = averaging.codec
    assert codec is not None
    got = codec.encode_ag(averaging, 0, c, torch.ones(n), lambda _p: True)
    assert got is not None
    z, payload, _ = got
    assert payload[0] == 2
    assert struct.unpack_from("<I", payload, 1)[0] == n
    ctx = _Ctx()
    params = _round(spec, "p1", replica)
    gather.on_ag(ctx, params, _pkt("p0", c, z, payload))  # type: ignore[arg-type]
    assert ctx.dropped == {"compressed_kind": 1}


def test_unsent_chunk_keeps_the_replica_on_the_owner() -> None:
    """A chunk no weight arrived for is not broadcast: the owner's replica keeps the
    value every receiver keeps (the update waits in the owner's residual)."""
    replica = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    owner = _round(ArcTopK(density=0.1, values="int8"), "p0", replica)
    owned = owner.owned[0]
    start = owner.plans[0].chunk(owned.start)[0]
    length = sum(owner.plans[0].chunk(c)[1] for c in owned)
    master = replica[start : start + length] + 0.5
    weights = torch.ones(len(owned))
    weights[0] = 0.0
    shard = type("S", (), {"bucket": 0, "start": start, "average": torch.zeros(length),
                           "weights": weights})()  # fmt: skip
    encoded = gather._encode_shard(owner, shard, master)
    assert owned.start not in encoded
    assert owned.start + 1 in encoded
    n0 = owner.plans[0].chunk(owned.start)[1]
    assert torch.equal(master[:n0], replica[start : start + n0])


# ------------------------------------------------------------------ the residual
def test_residual_keeps_what_was_not_sent() -> None:
    res = Residual()
    params = [torch.zeros(10)]
    keys = [(0, 2, 4)]
    res.enter(keys, params)
    params[0][2:6] += torch.tensor([1.0, 2.0, 3.0, 4.0])  # the optimizer's step
    (master,) = res.leave(keys, params)
    assert torch.equal(master, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    master.fill_(9.0)  # the caller's copy: the broadcast overwrites it with what it sent
    assert not bool(params[0].any())  # the replica values again
    params[0][2:6] += torch.tensor([1.0, 0.0, 3.0, 0.0])  # the broadcast carried half
    res.settle(params)
    assert res.norm() == pytest.approx((4.0 + 16.0) ** 0.5)
    # next step: the optimizer steps the master (replica + residual)
    res.enter(keys, params)
    assert torch.equal(params[0][2:6], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    res.leave(keys, params)
    res.settle(params)  # nothing sent this time: all of it still pending
    assert res.norm() == pytest.approx(20.0**0.5)


def test_residual_follows_ownership_and_absorbs_a_resync() -> None:
    res = Residual()
    params = [torch.zeros(10)]
    res.enter([(0, 0, 5)], params)
    params[0][0:5] = 1.0
    res.leave([(0, 0, 5)], params)
    res.settle(params)  # nothing sent: residual 1 on [0, 5)
    # the shard moves to [3, 8): the overlap [3, 5) keeps its residual, the rest starts at 0
    res.enter([(0, 3, 5)], params)
    assert torch.equal(params[0][3:8], torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]))
    res.leave([(0, 3, 5)], params)
    res.settle(params)
    # a resync moved the replica by -0.5 (receivers had lost updates): the master stays
    before = res.snapshot(params)
    params[0][3:8] -= 0.5
    res.absorb(before, params)
    res.enter([(0, 3, 5)], params)
    assert torch.equal(params[0][3:8], torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]))
    res.leave([(0, 3, 5)], params)
    res.clear()
    assert res.norm() == 0.0
