"""Real clients of the ``gossipnet`` torch.distributed backend, in real processes.

* the plain DDP script ``examples/ddp_backend.py`` under ``torch.distributed.run`` with 4
  processes: the same held-out loss as gloo lossless, within 2% in one run at 10%
  injected loss (the issue's 1% is the bench's median over seeds), every replica identical;
* PyTorch Lightning's ``DDPStrategy(process_group_backend="gossipnet")``: trains through
  the backend (its counters) to gloo's loss (lossless; loss is the DDP script's subject:
  Lightning's gradients take the same backend path);
* FSDP2 (``fully_shard``): the same losses as gloo;
* a rank killed with SIGKILL: the survivors finish their steps within a bound, agreeing;
* ranks with different secrets: a clear ``JoinError``, never a lone run.

Seeds are fixed in the scripts.  Each run's time limit bounds a hang (a run takes 3-10 s
on 2 idle cores and ~5x that at a load of 8), not its speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gossipnet.testing import free_tcp_ports

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: A run's hang bound (see the module docstring).
RUN_S = 240


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPNET_")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout, not another install
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


Run = tuple[Path, int, tuple[str, ...], dict[str, str]]  # script, nproc, args, env


def _torchrun_together(runs: list[Run], max_restarts: int = 0) -> list[list[dict[str, Any]]]:
    """Run each of ``runs`` under torch.distributed.run, all at once (each its own
    rendezvous port; the gossipnet ranks listen on ports the OS picks); per run,
    every JSON line it printed.  At once because a run spends most of its wall time
    starting processes and meeting, not computing: the runs compared here must
    agree whatever the load, and this keeps the suite short."""
    ports = free_tcp_ports(len(runs))
    procs = []
    for (script, nproc, args, env), port in zip(runs, ports, strict=True):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={port}",
            f"--max-restarts={max_restarts}",
            str(script),
            *args,
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(**env),
            start_new_session=True,  # a timeout kills torchrun's workers too, not only torchrun
        )
        procs.append((script, proc))
    outs = []
    try:
        for script, proc in procs:
            try:
                out, err = proc.communicate(timeout=RUN_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                raise AssertionError(f"{script.name} hung past {RUN_S} s:\n{err[-4000:]}") from None
            assert proc.returncode == 0, out[-3000:] + err[-3000:]
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            outs.append([dict(json.loads(ln)) for ln in lines])
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return outs


def _torchrun_all(
    script: Path, nproc: int, *args: str, max_restarts: int = 0, **env: str
) -> list[dict[str, Any]]:
    """Run ``script`` under torch.distributed.run; every JSON line it printed."""
    return _torchrun_together([(script, nproc, args, env)], max_restarts)[0]


def _torchruns(*runs: Run) -> list[dict[str, Any]]:
    """:func:`_torchrun_together`; per run, rank 0's JSON line (the only one)."""
    outs = _torchrun_together(list(runs))
    for lines in outs:
        assert len(lines) == 1, lines
    return [lines[0] for lines in outs]


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_S)
def test_ddp_script_under_torchrun_trains_as_well_as_gloo() -> None:
    script = ROOT / "examples" / "ddp_backend.py"
    gloo, clean, lossy = _torchruns(
        (script, 4, ("--backend", "gloo", "--json"), {}),
        (script, 4, ("--json",), {}),
        (script, 4, ("--json",), {"GOSSIPNET_LOSS": "0.1"}),
    )
    assert clean["test_loss"] == pytest.approx(gloo["test_loss"], rel=1e-4)
    assert clean["lossy_rounds"] == clean["steps"]
    assert clean["packets_lost"] == 0
    assert lossy["packets_lost"] > 0  # the loss happened, and was counted
    # One run at 10% loss, held to 2% as the Lightning test below and for its reason:
    # which packets are lost depends on timing, and the 1% is the bench's median
    # over seeds (bench/backend.py); single clean-clone CI runs read up to 1.0106 here.
    assert lossy["test_loss"] <= 1.02 * gloo["test_loss"]
    for run in (clean, lossy):  # repair keeps every replica the same
        assert len(set(run["test_loss_ranks"])) == 1, run


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_S)
def test_lightning_ddp_strategy_trains_through_gossipnet() -> None:
    pytest.importorskip("pytorch_lightning")
    script = HERE / "_lightning_worker.py"
    gloo, clean = _torchruns((script, 2, ("gloo",), {}), (script, 2, ("gossipnet",), {}))
    assert gloo["pg"] == "gloo"
    assert clean["pg"] == "gossipnet"
    assert clean["totals"]["lossy_rounds"] >= 40  # the gradients went through gossipnet
    assert clean["totals"]["calls_broadcast"] > 0
    assert clean["totals"]["calls_barrier"] > 0
    assert clean["test_loss"] == pytest.approx(gloo["test_loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_S)
def test_fsdp2_trains_over_gossipnet_as_over_gloo() -> None:
    """FSDP2's all_gather_single / reduce_scatter_single: the same losses as gloo."""
    script = HERE / "_fsdp_worker.py"
    gloo, ours = _torchruns((script, 2, ("gloo",), {}), (script, 2, ("gossipnet",), {}))
    assert ours["losses"] == pytest.approx(gloo["losses"], rel=1e-4)
    assert ours["totals"]["calls_allgather"] > 0  # FSDP's all-gathers came through us
    assert ours["totals"]["calls_reduce_scatter"] > 0


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_S)
def test_torchrun_max_restarts_restarts_the_group_which_meets_again() -> None:
    """Rank 1 dies at step 3 of its first attempt: torchrun stops the group and starts
    it again (``--max-restarts 1``); the new incarnation meets through the same agent
    store (keys carry the restart count) and finishes, every replica the same."""
    outs = _torchrun_all(HERE / "_ddp_churn_worker.py", 2, "10", "1", "3", max_restarts=1)
    assert sorted(o["rank"] for o in outs) == [0, 1]
    assert all(o["restart"] == 1 for o in outs)
    assert all(o["steps"] == 10 for o in outs)
    assert outs[0]["digest"] == outs[1]["digest"]


def _ranks(
    world: int, args: list[str], envs: list[dict[str, str]], script: str = "_ddp_churn_worker.py"
) -> list[subprocess.Popen[str]]:
    (port,) = free_tcp_ports(1)
    procs = []
    for rank in range(world):
        env = _env(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **envs[rank],
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


@pytest.mark.slow
@pytest.mark.timeout(RUN_S)
def test_a_killed_rank_does_not_hang_the_survivors() -> None:
    """Rank 2 dies (SIGKILL) before step 10 of 40: ranks 0 and 1 finish all 40 steps
    within 15 s of it (failure detection 1 s, then one bounded round), identical."""
    fast = {"GOSSIPNET_CONFIG": '{"failure_timeout_s": 1.0, "heartbeat_interval_s": 0.1}'}
    procs = _ranks(3, ["40", "2", "10"], [fast] * 3)
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=RUN_S))
    finally:
        for p in procs:
            p.kill()
    assert procs[2].returncode == -9
    results = []
    for p, (out, err) in zip(procs[:2], outs[:2], strict=True):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["steps"] == 40 for r in results)
    assert all(r["after_death_s"] < 15 for r in results), results
    assert any(r["rounds_missing_peers"] >= 1 for r in results)
    assert results[0]["digest"] == results[1]["digest"]


@pytest.mark.timeout(RUN_S)
def test_ranks_with_different_secrets_fail_clearly() -> None:
    """A wrong secret is a JoinError naming the cause, not a rank training alone."""
    conf = '{"join_timeout_s": 3.0}'
    envs = [
        {"GOSSIPNET_SECRET": "right", "GOSSIPNET_CONFIG": conf},
        {"GOSSIPNET_SECRET": "wrong", "GOSSIPNET_CONFIG": conf},
    ]
    procs = _ranks(2, ["5", "-1", "-1"], envs)
    try:
        errs = [p.communicate(timeout=RUN_S)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode != 0
        assert "JoinError" in err, err[-3000:]
        assert "secret" in err.lower(), err[-3000:]


@pytest.mark.timeout(RUN_S)
def test_object_collectives_are_exact_and_gather_is_named() -> None:
    """all_gather_object and broadcast_object_list (byte tensors through allgather and
    broadcast) return every object intact; gather_object names the unsupported call;
    init_process_group's pg_options reach the group."""
    procs = _ranks(3, [], [{}] * 3, script="_objects_worker.py")
    try:
        outs = [p.communicate(timeout=RUN_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    want = [{"rank": r, "text": "x" * (100 + 5000 * r), "nested": [r, [r * 2.5]]} for r in range(3)]
    assert got["gathered"] == want
    assert got["broadcast"] == [{"from": "root", "blob": list(range(2000))}, "second"]
    assert "gather is not supported" in got["gather_error"]
    assert (got["timeout"], got["exact"]) == (7.5, 64)  # pg_options reached the group
    assert got["refused"], got  # the exact collectives' drop counters, every one zero:
    assert not any(got["refused"].values()), got["refused"]
