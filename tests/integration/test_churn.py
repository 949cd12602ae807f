"""Churn on real ZeroMQ sockets: Moshpit averaging, SIGTERM departures, restarts with state.

Peers run as threads of this process on 127.0.0.1 (each owns its loop
thread); the SIGTERM test runs one peer in a child process, as a
preemptible worker would be.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gossipnet

pytestmark = pytest.mark.timeout(60)

NET: dict[str, Any] = {
    "heartbeat_interval_s": 0.1,
    "failure_timeout_s": 1.0,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 10.0,
    "collective_timeout_s": 3.0,
}


def start(addresses: list[str], ids: list[str], **kw: Any) -> list[gossipnet.Peer]:
    with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
        futures = [
            pool.submit(
                gossipnet.join,
                peers=addresses,
                listen=a,
                peer_id=i,
                handle_sigterm=False,
                **{**NET, **kw},
            )
            for a, i in zip(addresses, ids, strict=True)
        ]
        return [f.result(timeout=30) for f in futures]


def test_moshpit_average_over_zmq_is_exact_on_a_full_grid(
    free_tcp_ports: Callable[[int], list[int]],
) -> None:
    addresses = [f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(4)]
    peers = start(addresses, [f"z{i}" for i in range(4)])
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(50_000, generator=gen) + i for i in range(4)]
        ys = [torch.randn(3, 7, generator=gen, dtype=torch.float64) for _ in range(4)]
        want = torch.stack(xs).double().mean(0), torch.stack(ys).mean(0)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # group_size=2 with 4 peers: a 2x2 grid, two rounds
            reps = list(
                pool.map(lambda i: peers[i].average([xs[i], ys[i]], group_size=2), range(4))
            )
        for x, y in zip(xs, ys, strict=True):
            torch.testing.assert_close(x.double(), want[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(y, want[1], rtol=1e-12, atol=1e-12)
        for rep in reps:
            assert rep.method == "moshpit"
            assert rep.extra["rounds"] == 2
            assert rep.extra["mean_group_size"] == 2
    finally:
        for p in peers:
            p.leave()


CHILD = textwrap.dedent(
    """
    import signal, sys
    import gossipnet
    net = gossipnet.join([sys.argv[1]], listen="tcp://127.0.0.1:0", peer_id="child",
                         heartbeat_interval_s=0.1, failure_timeout_s=5.0, join_timeout_s=20.0)
    print("ready", flush=True)
    while True:
        signal.pause()  # idle until the parent's SIGTERM
    """
)


def test_sigterm_announces_departure_and_exits_within_a_second(
    free_tcp_ports: Callable[[int], list[int]],
    wait_until_sync: Callable[..., float],
) -> None:
    """A preempted worker: LEAVE reaches the others at once (long before the 5 s
    failure timeout), and the process still dies of SIGTERM, promptly."""
    address = f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    parent = gossipnet.join(
        peers=[],
        listen=address,
        peer_id="parent",
        handle_sigterm=False,
        **{**NET, "failure_timeout_s": 5.0},
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, address], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        assert parent.wait_for_peers(2, timeout_s=10)
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=5)
        exited = time.monotonic() - t0
        assert code == -signal.SIGTERM  # the default action, after our handler
        assert exited < 1.5
        wait_until_sync(lambda: "child" not in parent.alive_peers(), 1.0, what="LEAVE")
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait(timeout=5)
        if child.stdout is not None:
            child.stdout.close()
        parent.leave()


def train(opt: Any, model: torch.nn.Module, steps: int, seed: int, until: Any = None) -> list[Any]:
    """``steps`` steps (or until ``until()``), each with 20 ms standing in for compute:
    peers are paced by their compute, as in training, not by the averaging alone."""
    gen = torch.Generator().manual_seed(seed)
    reports = []
    for _ in range(steps):
        if until is not None and until():
            break
        x = torch.randn(32, 4, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        time.sleep(0.02)  # simulated compute time of a real step, not a wait on a condition
        reports.append(opt.step())
        opt.zero_grad()
    return reports


def test_restarted_peer_downloads_state_and_is_averaging_again(
    free_tcp_ports: Callable[[int], list[int]],
) -> None:
    """Moshpit optimizer, 4 peers; one is killed (no goodbye) and comes back under
    its id: it gets parameters, Adam state and step count from a live peer, and
    averages in groups again, ending with its group's parameters."""
    addresses = [f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(4)]
    ids = [f"r{i}" for i in range(4)]
    peers = start(addresses, ids)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        torch.manual_seed(0)
        models = [torch.nn.Linear(4, 1) for _ in range(4)]  # different inits on purpose

        def make(i: int) -> Any:
            base = torch.optim.Adam(models[i].parameters(), lr=0.05)
            return peers[i].optimizer(base, strategy="moshpit", average_every=2, group_size=2)

        opts = list(pool.map(make, range(4)))
        # a fresh cluster adopts the first peer's state: identical replicas
        assert all(torch.equal(m.weight, models[0].weight) for m in models)
        list(pool.map(lambda i: train(opts[i], models[i], 4, i), range(4)))
        assert all(o.step_count == 4 for o in opts)

        peers[3].close(announce=False)  # SIGKILL-like
        list(pool.map(lambda i: train(opts[i], models[i], 2, 10 + i), range(3)))
        peers[3] = gossipnet.join(
            peers=addresses, listen=addresses[3], peer_id="r3", handle_sigterm=False, **NET
        )
        models[3] = torch.nn.Linear(4, 1)  # a new process: fresh, wrong weights
        back: list[Any] = []

        def rejoin() -> None:
            base = torch.optim.Adam(models[3].parameters(), lr=0.05)
            opt = peers[3].optimizer(base, strategy="moshpit", average_every=2, group_size=2)
            back.append(opt)

        fut = pool.submit(rejoin)
        # the others keep training; the newcomer's download is served between steps
        list(pool.map(lambda i: train(opts[i], models[i], 400, 20 + i, fut.done), range(3)))
        fut.result(timeout=30)
        opts[3] = back[0]
        sync = opts[3].last_sync
        assert sync is not None
        assert sync.ok
        # state from after its request: the others' step count, not their first one
        assert opts[3].step_count >= 6, (sync, opts[3].step_count)
        assert opts[3].base.state_dict()["state"]  # Adam moments came along
        # everyone trains to the same step (the newcomer is a few steps behind: the
        # others waited at averaging, as they would for any straggler)
        target = (max(o.step_count for o in opts) + 9) // 2 * 2  # ends with an averaging
        results = list(
            pool.map(
                lambda i: train(opts[i], models[i], target - opts[i].step_count, 30 + i),
                range(4),
            )
        )
        averaged = [r for r in results[3] if r.method == "moshpit"]
        assert averaged[-1].extra["alone_rounds"] == 0, averaged
        last = peers[3]._moshpit.last_rounds[-1]  # type: ignore[union-attr]
        assert len(last.participants) >= 2
        for p in last.participants:  # its parameters are its group's
            assert torch.equal(models[ids.index(p)].weight, models[3].weight)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for p in peers:
            with contextlib.suppress(Exception):
                p.leave()
