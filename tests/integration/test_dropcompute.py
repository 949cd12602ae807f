"""DropCompute end to end on real ZeroMQ sockets (127.0.0.1, threads).

Three peers train a tiny model with ``net.microbatches(..., tau="auto")``;
compute time is the noise plan's sleeps on the real clock.  Invariants, not
timings: every peer gets a tau after the timed window, every step's report
carries tau and the drop rate, the timing gather reached everyone, and the
replicas stay identical (loopback loses nothing).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing.noise import LogNormalDelay, NoisePlan
from gossipnet.training.autotau import AutoTau, AutoTauConfig

pytestmark = pytest.mark.timeout(40)

NET: dict[str, Any] = {
    "heartbeat_interval_s": 0.1,
    "failure_timeout_s": 2.0,
    "join_timeout_s": 8.0,
    "collective_timeout_s": 3.0,
}
K = 6
STEPS = 14


def test_auto_tau_over_zeromq(free_tcp_ports: Callable[[int], list[int]]) -> None:
    addresses = [f"tcp://127.0.0.1:{port}" for port in free_tcp_ports(3)]
    plan = NoisePlan(base_s=0.002, lognormal=LogNormalDelay(delay_factor=4.0, sigma=1.5), seed=2)
    cfg = AutoTauConfig(
        warmup_steps=1, window_steps=5, reestimate_every_steps=4, min_microbatches=2
    )
    done = threading.Barrier(3, timeout=30)

    def worker(rank: int) -> dict[str, Any]:
        with gossipnet.join(addresses, listen=addresses[rank], peer_id=f"d{rank}", **NET) as net:
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            opt = net.optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
            auto = AutoTau(cfg)
            data = torch.Generator().manual_seed(rank)
            extras = []
            for step in range(STEPS):
                times = plan.times(rank, step, K)
                batches = [torch.randn(8, 4, generator=data) for _ in range(K)]
                for i, x in enumerate(net.microbatches(batches, K, tau=auto)):
                    model(x).pow(2).mean().backward()
                    time.sleep(float(times[i]))  # the injected compute time itself, not a wait
                extras.append(dict(opt.step().extra))
                opt.zero_grad()
            opt.resync()
            done.wait()
            return {
                "extras": extras,
                "choices": auto.choices,
                "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
            }

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        out = [f.result(timeout=35) for f in [pool.submit(worker, r) for r in range(3)]]
    for res in out:
        extras = res["extras"]
        assert all("tau_s" in e and "mb_drop_rate" in e for e in extras)
        assert [e["tau_s"] for e in extras[:6]] == [float("inf")] * 6
        assert all(0 < e["tau_s"] < float("inf") for e in extras[6:])
        assert [s for s, _ in res["choices"]] == [6, 10, 14]
        torch.testing.assert_close(res["params"], out[0]["params"])
        # the same gathered timings everywhere -> the same search range on every peer
        for (_, mine), (_, first) in zip(res["choices"], out[0]["choices"], strict=True):
            assert (mine.grid_lo_s, mine.grid_hi_s) == pytest.approx(
                (first.grid_lo_s, first.grid_hi_s), rel=1e-5
            )
