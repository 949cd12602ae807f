"""``net.optimizer(adam, compress=...)`` compresses both directions, end to end.

Four joined peers (own loop threads) on a memory network train an MLP 64-128-10
(9,610 parameters) with Adam on a seeded synthetic classification task, once
dense and once with ``compress=ArcTopK(0.1, "int8")`` (the README's first
example; lossless also DCT and Int8).  The bytes are the transports' own
counters (every packet the peers sent, heartbeats included), so a parameter
broadcast left dense would show: it is half of a dense step's bytes, so a ratio
above 2 needs both directions compressed.  Lossless, every replica applies the
same decoded updates and stays bit-identical at every step; at seeded 10% loss,
``opt.resync()`` makes them identical again and ``replicas_agree()`` says so;
both train as dense does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing import run_peers as _run_peers

FAST = {
    "heartbeat_interval_s": 0.2,
    "failure_timeout_s": 2.0,
    "collective_timeout_s": 2.0,
}
STEPS = 60
SPEC = gossipnet.ArcTopK(density=0.1, values="int8")


def run_peers(n: int, body: Callable[[int, gossipnet.Peer], Any], **config: Any) -> list[Any]:
    return _run_peers(n, body, timeout_s=120, **{**FAST, **config})


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded 10-class task: one of 4 prototypes per class, scaled, plus noise."""
    protos = torch.randn(10, 4, 64, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(100 + rank)
    y = torch.randint(0, 10, (512,), generator=gen)
    which = torch.randint(0, 4, (512,), generator=gen)
    return protos[y, which] + 0.8 * torch.randn(512, 64, generator=gen), y


def _model() -> torch.nn.Module:
    """The same initial weights on every peer, drawn from a generator of its own (the
    peers are threads sharing torch's global RNG)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.rand(p.shape, generator=gen) - 0.5) * 0.2)
    return model


def _train(spec: Any, *, check_each_step: bool) -> Callable[[int, gossipnet.Peer], dict[str, Any]]:
    def body(rank: int, peer: gossipnet.Peer) -> dict[str, Any]:
        torch.set_num_threads(1)
        model = _model()
        opt = peer.optimizer(torch.optim.Adam(model.parameters(), lr=3e-3), compress=spec)
        x, y = _data(rank)
        x_eval, y_eval = _data(99)
        gen = torch.Generator().manual_seed(rank)
        sent0 = peer.stats()["transport"]["sent_bytes"]
        losses, flats, extras = [], [], []
        for _ in range(STEPS):
            idx = torch.randint(0, x.shape[0], (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            rep = opt.step()
            losses.append(float(loss.detach()))
            extras.append(dict(rep.extra))
            if check_each_step:
                flats.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        drifted = torch.cat([p.detach().flatten() for p in model.parameters()])
        opt.resync()
        sent = peer.stats()["transport"]["sent_bytes"] - sent0
        agree = bool(peer.replicas_agree(timeout=5.0))
        with torch.no_grad():
            acc = float((model(x_eval).argmax(dim=1) == y_eval).float().mean())
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        return {
            "sent": sent, "losses": losses, "flats": flats, "extras": extras, "acc": acc,
            "flat": flat, "drifted": drifted, "agree": agree,
        }  # fmt: skip

    return body


def _bytes(out: list[dict[str, Any]]) -> float:
    return sum(o["sent"] for o in out) / STEPS


@pytest.fixture(scope="module")
def dense_lossless() -> list[dict[str, Any]]:
    return run_peers(4, _train(None, check_each_step=False))


def _late_loss(out: list[dict[str, Any]]) -> float:
    """The mean training loss of the last 10 steps over the peers."""
    return sum(sum(o["losses"][-10:]) for o in out) / (10 * len(out))


@pytest.mark.timeout(240)  # ~10 s on 2 idle cores; bounds a hang
@pytest.mark.parametrize(
    ("spec", "least"),
    [(SPEC, 4.0), (gossipnet.DCT(density=0.1, values="int8"), 3.0), (gossipnet.Int8(), 2.5)],
    ids=str,
)
def test_lossless_both_directions_compressed_and_replicas_bit_identical(
    dense_lossless: list[dict[str, Any]], spec: Any, least: float
) -> None:
    dense = dense_lossless
    packed = run_peers(4, _train(spec, check_each_step=True))
    ratio = _bytes(dense) / _bytes(packed)
    # a dense parameter broadcast alone is half of a dense step: above 2x, both
    # directions are compressed (the gradient side alone gave 1.8x with ArcTopK,
    # at most 1.6x with Int8)
    assert ratio > least, (ratio, _bytes(dense), _bytes(packed))
    for o in packed:
        # every replica applied the same decoded updates: equal at every step, bit for bit
        for a, b in zip(o["flats"], packed[0]["flats"], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(o["flat"], packed[0]["flat"])
        assert o["agree"]
        grads = [x for x in o["extras"] if "compression_ratio" in x]
        assert len(grads) >= STEPS - 1  # every step but the dense step-0 resync
        assert sum(o["losses"][-10:]) < 0.5 * sum(o["losses"][:10]), o["losses"]
    if isinstance(spec, gossipnet.ArcTopK):
        # the owners took Adam's catch-up step (a peer that owns no chunk steps nothing)
        caught = [[x["catch_up"] for x in o["extras"] if "catch_up" in x] for o in packed]
        assert any(c and all(v == 1.0 for v in c) for c in caught), caught
    # trains as dense does (the same data and init; a lossless run of 60 steps)
    acc = sum(o["acc"] for o in packed) / 4
    acc_dense = sum(o["acc"] for o in dense) / 4
    assert acc > acc_dense - 0.05, (acc, acc_dense)
    assert _late_loss(packed) < 2.5 * _late_loss(dense), (_late_loss(packed), _late_loss(dense))


@pytest.mark.timeout(240)  # ~15 s on 2 idle cores; bounds a hang
def test_under_loss_compressed_and_identical_after_resync() -> None:
    faults = gossipnet.FaultPlan(loss=0.1, seed=3)
    dense = run_peers(4, _train(None, check_each_step=False), faults=faults)
    packed = run_peers(4, _train(SPEC, check_each_step=False), faults=faults)
    ratio = _bytes(dense) / _bytes(packed)
    assert ratio > 3.0, (ratio, _bytes(dense), _bytes(packed))
    # lost updates left the replicas apart until the resync, which made them one model
    assert any(not torch.equal(o["drifted"], packed[0]["drifted"]) for o in packed)
    stale = sum(x.get("estimated", 0.0) for o in packed for x in o["extras"])
    assert stale == 0  # a lost update is not estimated: it would never be overwritten
    for o in packed:
        assert torch.equal(o["flat"], packed[0]["flat"])
        assert o["agree"]
        assert sum(o["losses"][-10:]) < 0.5 * sum(o["losses"][:10]), o["losses"]
    acc = sum(o["acc"] for o in packed) / 4
    acc_dense = sum(o["acc"] for o in dense) / 4
    assert acc > acc_dense - 0.05, (acc, acc_dense)
