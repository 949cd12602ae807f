"""Blink islands across processes (one process per GPU), on CPU with a fake topology.

The island members' buffers are CPU tensors in ``/dev/shm`` files, the same code path
as CUDA IPC up to the mapping itself; the fake topology is a 3-"GPU" NVLink island.
Thread tests (MemoryNetwork, one process) cover the protocol quickly; the process test
runs four real processes over ZeroMQ, as torchrun would, and kills a leader.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.collectives.island.averager import island_label, plan_islands
from gossipnet.collectives.island.proto import IslandInfo
from gossipnet.testing import run_peers

from ._island_worker import NET, TIMEOUT_S, TOPOLOGY, values

ROOT = Path(__file__).resolve().parents[2]


def _mean(ranks: list[int], call: int) -> list[torch.Tensor]:
    per = [values(r, call) for r in ranks]
    return [torch.stack([p[j].double() for p in per]).mean(0) for j in range(len(per[0]))]


def _assert_values(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- pure planning
def test_plan_groups_by_host_and_label_and_leaves_the_rest_alone() -> None:
    a = {
        "p0": IslandInfo("h1", True, 0, 0),
        "p1": IslandInfo("h1", True, 1, 0),
        "p2": IslandInfo("h1", True, 1, 0),  # same GPU as p1: alone
        "p3": IslandInfo("h2", True, 0, 0),  # other machine
        "p4": IslandInfo("h2", True, 1, 0),
        "p5": IslandInfo("h1", False, -1, -1),  # no GPU
    }
    assert plan_islands(a) == [("p0", "p1"), ("p2",), ("p3", "p4"), ("p5",)]
    assert island_label(TOPOLOGY, 2, cuda=False) == 0
    assert island_label(TOPOLOGY, 5, cuda=False) == -1
    assert island_label(None, 0, cuda=False) == -1


# ---------------------------------------------------------------------- threads, mem://
@pytest.mark.timeout(30)
def test_island_of_three_plus_one_alone_gives_the_global_mean() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> tuple[list[torch.Tensor], Any]:
        ts = values(rank, 0)
        dev = rank if rank < 3 else None
        rep = peer.island_average(ts, TIMEOUT_S, topology=TOPOLOGY, device=dev)
        return ts, rep

    out = run_peers(4, body, timeout_s=20, **NET)
    want = _mean([0, 1, 2, 3], 0)
    for ts, _ in out:
        _assert_values(ts, want)
    reps = [rep for _, rep in out]
    for leader in (reps[0], reps[3]):  # only p0 and p3 crossed the lossy all-reduce
        assert leader.participants == ("p0", "p3")
        assert leader.contributors == ("p0", "p3")
        assert leader.packets_sent > 0
    assert reps[0].extra["island_weight"] == 3.0
    assert reps[0].extra["island_blink"] == 1.0  # Blink trees, not the plain-copy fallback
    assert reps[3].extra["island_size"] == 1.0
    for member in reps[1:3]:
        assert member.packets_sent == 0
        assert member.participants == ("p0", "p1", "p2")
        assert member.extra["leader_lost"] == 0.0
        assert member.round == reps[0].round


@pytest.mark.timeout(30)
def test_without_topology_every_peer_runs_the_plain_lossy_all_reduce() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> tuple[list[torch.Tensor], Any]:
        ts = values(rank, 1)
        reps = [peer.island_average(ts, TIMEOUT_S)]  # CPU tensors, no topology: alone
        ts2 = values(rank, 2)
        reps.append(peer.all_reduce(ts2, TIMEOUT_S))  # rounds stay in step with it
        return [*ts, *ts2], reps

    out = run_peers(3, body, timeout_s=20, **NET)
    want = _mean([0, 1, 2], 1) + _mean([0, 1, 2], 2)
    for ts, reps in out:
        _assert_values(ts, want)
        assert reps[0].participants == ("p0", "p1", "p2")
        assert reps[0].extra["island_size"] == 1.0
        assert reps[1].ok


# ---------------------------------------------------------------------- real processes
def _run_workers(tmp_path: Path, scenario: str, ports: list[int]) -> list[subprocess.Popen[str]]:
    addresses = ",".join(f"tcp://127.0.0.1:{p}" for p in ports)
    # fmt: off
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integration._island_worker", str(r), addresses,
             str(tmp_path), scenario],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for r in range(4)
    ]
    # fmt: on
    return procs


def _finish(procs: list[subprocess.Popen[str]], live: list[int]) -> None:
    try:
        for r in live:  # each prints "done" once its rounds are over
            out = procs[r].stdout
            assert out is not None
            assert out.readline().strip() == "done", f"rank {r} failed"
        for r in live:
            stdin = procs[r].stdin
            assert stdin is not None
            stdin.write("bye\n")
            stdin.flush()
        for r in live:
            assert procs[r].wait(timeout=15) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


def _load(tmp_path: Path, rank: int, call: int) -> dict[str, Any]:
    data: dict[str, Any] = torch.load(tmp_path / f"rank{rank}-call{call}.pt")
    return data


# four processes importing torch: ~5 s on 2 idle cores, 22 s at a load of 12: a hang bound
@pytest.mark.timeout(180)
def test_processes_average_through_shared_memory_and_survive_a_dead_leader(
    tmp_path: Path, free_tcp_ports: Callable[[int], list[int]]
) -> None:
    procs = _run_workers(tmp_path, "kill", free_tcp_ports(4))
    _finish(procs, [1, 2, 3])
    assert procs[0].returncode == 0  # exited on its own, between rounds
    # call 0: exact global mean everywhere; only the leaders r0 and r3 sent data
    want = _mean([0, 1, 2, 3], 0)
    for r in range(4):
        res = _load(tmp_path, r, 0)
        _assert_values(res["tensors"], want)
    lead = _load(tmp_path, 0, 0)["report"]
    assert lead["participants"] == ("r0", "r3")
    assert lead["extra"]["island_weight"] == 3.0
    for r in (1, 2):
        rep = _load(tmp_path, r, 0)["report"]
        assert rep["packets_sent"] == 0
        assert rep["extra"]["leader_lost"] == 0.0
        # members sent control packets only: far fewer bytes than the leader's data
        assert rep["stats"]["sent_bytes"] < lead["stats"]["sent_bytes"] / 4
    # call 1: the leader is dead; members return within the deadline with their own values
    for r in (1, 2):
        res = _load(tmp_path, r, 1)
        _assert_values(res["tensors"], [t.double() for t in values(r, 1)])
        rep = res["report"]
        assert rep["extra"]["leader_lost"] == 1.0
        assert rep["timed_out"]
        assert rep["missing"] == ("r0",)
        assert rep["elapsed_s"] < TIMEOUT_S + NET["control_timeout_s"] + 1.0
    # call 2: r1 leads the survivors' island; the mean of r1, r2, r3 is exact again
    want = _mean([1, 2, 3], 2)
    for r in (1, 2, 3):
        _assert_values(_load(tmp_path, r, 2)["tensors"], want)
    assert _load(tmp_path, 1, 2)["report"]["participants"] == ("r1", "r3")


def test_handle_payloads_never_resolve_globals() -> None:
    """A handle is plain values; a pickle naming any class or function is refused."""
    import os
    import pickle

    from gossipnet.collectives.island.share import load_handles, open_handles

    with pytest.raises(ValueError, match="plain values"):
        load_handles(pickle.dumps([(os.system, ("true",))]))
    with pytest.raises(ValueError, match="not a gossipnet file"):  # refused by name first
        open_handles([("file", "/etc/passwd", 3, "f32")], [(3, torch.float32)])
    assert load_handles(pickle.dumps([("file", "/dev/shm/gossipnet-x", 3, "f32")]))


def test_bucket_files_of_killed_processes_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILLed creator never unlinks its /dev/shm files; the next creator on the
    machine removes them, and never a live process's file or a file not ours."""
    import os
    import signal

    from gossipnet.collectives.island import share

    # a process that waits for a signal (the SIGKILL below) and does nothing else
    victim = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    dead = tmp_path / f"gossipnet-{victim.pid}-0123456789ab"
    live = tmp_path / f"gossipnet-{os.getppid()}-0123456789ab"
    foreign = tmp_path / "gossipnet-notapid-x"
    for f in (dead, live, foreign):
        f.write_bytes(b"\0" * 64)
    monkeypatch.setattr(share, "_SHM_DIR", str(tmp_path))
    share._sweep_once.cache_clear()

    buckets = share.SharedBuckets([(16, torch.float32)], torch.device("cpu"))

    assert not dead.exists()
    assert live.exists()
    assert foreign.exists()
    assert [os.path.dirname(p) for p in buckets.paths] == [str(tmp_path)]
    assert share.sweep_stale(str(tmp_path)) == []  # our own fresh file is kept
