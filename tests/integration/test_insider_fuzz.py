"""A member gone bad: seeded hostile packets of every kind while the others train.

Three honest peers train one model with the lossy optimizer while a fourth member
of the run (it holds the secret and its own key, as every peer does) sends, in
its own name, packets of every kind every protocol owns (node control, lossy
all-reduce, Moshpit, state sync, route, island, training, SPARQ, the torch
backend's exchange) with hostile header values (huge, negative, wrong types)
and random payloads, a seeded few hundred a second.  What must hold: no handler
of an honest peer raises (a handler failure is logged at ERROR), training ends
with finite losses and the honest replicas agreeing, and every honest peer is
still alive at the others.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import random
import threading
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing import run_peers

SEED = 37
HOSTILE: list[Any] = [
    0, 1, -1, 2**31, 2**53 - 1, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), 1e300, -1e300,
    float("nan"), float("inf"), 0.5, True, None, "", "x" * 40, b"\x00" * 8, b"\xff" * 33,
    [1, 2**64 - 1], [[1, 2], [3]], {"a": 1},
]  # fmt: skip
KEYS = ["r", "b", "c", "n", "w", "dt", "x", "z", "g", "rq", "ak", "op", "sid", "sz", "cb",
        "d", "ar", "st", "lay", "rv", "addr", "mpt", "sv", "step", "dg", "digest", "t"]  # fmt: skip


def _all_kinds() -> list[int]:
    kinds: list[int] = []
    for info in pkgutil.walk_packages(gossipnet.__path__, "gossipnet."):
        if info.name.rpartition(".")[2] == "kinds":
            kinds.extend(importlib.import_module(info.name).KIND_RANGE)
    return sorted(kinds)


@pytest.mark.timeout(120)
def test_an_insider_fuzzing_every_kind_breaks_no_honest_peer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="gossipnet")
    kinds = _all_kinds()
    assert len(kinds) > 100
    stop = threading.Event()
    sent = [0]

    def body(rank: int, net: gossipnet.Peer) -> Any:
        if rank == 3:
            return _fuzz(net, kinds, stop, sent)
        try:
            return _train(rank, net)
        finally:
            if rank == 0:
                stop.set()

    results = run_peers(
        4, body, timeout_s=100, heartbeat_interval_s=0.1, failure_timeout_s=1.0,
        collective_timeout_s=2.0, resync_every_steps=5,
    )  # fmt: skip
    honest = results[:3]
    assert sent[0] > 500
    for losses, _params, alive in honest:
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert {"p0", "p1", "p2"} <= set(alive)
    for _, params, _ in honest[1:]:
        torch.testing.assert_close(params, honest[0][1])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]


def _train(rank: int, net: gossipnet.Peer) -> tuple[list[float], torch.Tensor, list[str]]:
    torch.manual_seed(SEED)
    model = torch.nn.Linear(16, 1)
    opt = net.optimizer(torch.optim.SGD(model.parameters(), lr=0.05), strategy="allreduce")
    gen = torch.Generator().manual_seed(SEED + rank)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(SEED))
    losses = []
    for _ in range(30):
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.resync()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return losses, params, net.alive_peers()


def _fuzz(net: gossipnet.Peer, kinds: list[int], stop: threading.Event, sent: list[int]) -> None:
    """Seeded hostile packets of every kind to the others, in this peer's own name."""
    rng = random.Random(SEED)
    node = net._node
    targets = ["p0", "p1", "p2"]

    async def burst(n: int) -> None:
        for _ in range(n):
            kind = rng.choice(kinds)
            fields = {k: rng.choice(HOSTILE) for k in rng.sample(KEYS, rng.randrange(8))}
            payload = rng.randbytes(rng.choice([0, 3, 8, 64, 1024]))
            try:
                node.send(rng.choice(targets), kind, fields, payload)
            except (ValueError, TypeError, OverflowError):
                continue  # our own encoder refused it: nothing went out
            sent[0] += 1

    while not stop.wait(0.02):
        net._runtime.call(burst(8), timeout_s=5.0)
