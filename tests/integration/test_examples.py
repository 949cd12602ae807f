"""The newcomer's scripts in ``examples/`` run, end to end, in short settings.

Why: they are the first thing a user runs and nothing else imports them, so an
API change that breaks one would otherwise go unnoticed until someone tries it.
Each runs as a subprocess in a temporary directory (their ``runs/`` output goes
there), with a timeout, and must print what it promises, not just exit 0.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: A subprocess limit that bounds a hang, not slowness: these examples take 4-15 s on
#: 2 idle cores and 33-51 s at a load of 12 (three to five processes importing torch).
EXAMPLE_BOUND_S = 300


def run_example(tmp_path: Path, name: str, *args: str, timeout: float) -> tuple[int, str]:
    """Run ``examples/<name>`` with ``args`` in ``tmp_path``; (exit code, stdout+stderr)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def last_json(out: str) -> dict:
    """The last line of ``out`` that is a JSON object."""
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in:\n{out[-2000:]}")


@pytest.mark.timeout(EXAMPLE_BOUND_S + 20)
def test_train_lossy_peers_end_with_the_same_finite_held_out_loss(tmp_path: Path) -> None:
    args = ("--peers", "2", "--steps", "20", "--loss", "0.1")
    rc, out = run_example(tmp_path, "train_lossy.py", *args, timeout=EXAMPLE_BOUND_S)
    assert rc == 0, out[-2000:]
    losses = [float(m) for m in re.findall(r"peer \d+: held-out loss ([\d.]+)", out)]
    assert len(losses) == 2, out[-2000:]
    assert all(math.isfinite(v) for v in losses)
    assert max(losses) - min(losses) < 0.05  # parameter broadcasts kept the peers together


@pytest.mark.timeout(EXAMPLE_BOUND_S + 20)
def test_stragglers_reports_its_speed_up(tmp_path: Path) -> None:
    # 30 steps: AutoTau's warm-up (2) and first window (10) leave 18 steps with a tau
    rc, out = run_example(tmp_path, "stragglers.py", "--steps", "30", timeout=EXAMPLE_BOUND_S)
    assert rc == 0, out[-2000:]
    found = re.search(r"speed-up: ([\d.]+)x", out)
    assert found, out[-2000:]
    assert float(found.group(1)) > 0


@pytest.mark.timeout(EXAMPLE_BOUND_S + 20)
def test_vehicles_simulation_writes_its_plot(tmp_path: Path) -> None:
    rc, out = run_example(tmp_path, "vehicles.py", timeout=EXAMPLE_BOUND_S)
    assert rc == 0, out[-2000:]
    assert "route       accuracy" in out
    assert list(tmp_path.rglob("*.png")), out[-2000:]


@pytest.mark.timeout(EXAMPLE_BOUND_S + 20)
def test_vehicles_over_the_network_end_with_every_vehicles_weights(tmp_path: Path) -> None:
    rc, out = run_example(tmp_path, "vehicles_net.py", timeout=EXAMPLE_BOUND_S)
    assert rc == 0, out[-2000:]
    assert len(re.findall(r"^final v\d+ weights", out, flags=re.M)) >= 2, out[-2000:]


# The example's own bounds: start-up and the wait for restarts to start
# (preemptible.START_BOUND_S, 180 s each), 18 s of run, 40 s to leave.  Takes ~30 s
# on 2 idle cores; at a load of 12 restarts took 50-60 s each.
PREEMPTIBLE_BOUND_S = 2 * 180 + 18 + 40


@pytest.mark.timeout(PREEMPTIBLE_BOUND_S + 20)
def test_preemptible_restarts_resume_from_a_live_peer(tmp_path: Path) -> None:
    """Short run (18 s, kills from the 2nd second): every restarted peer resumed
    from a live peer's state.  The supervisor kills only while 12 s are left and
    restarts only while 8 s are left, so 18 s leave room for a kill or two and their
    restarts.  The loss-halving verdict needs the full 60 s, so the exit code is not
    asserted here, the JSON summary is."""
    rc, out = run_example(
        tmp_path,
        "preemptible.py",
        *("--peers", "4", "--duration", "18", "--warmup", "2", "--kill-every", "3"),
        *("--seed", "0", "--log-dir", "runs/p"),
        timeout=PREEMPTIBLE_BOUND_S,
    )
    summary = last_json(out)
    assert summary["kills"] + summary["sigterms"] >= 1, out[-2000:]
    assert summary["restarts"] >= 1, out[-2000:]
    assert summary["restarts_synced"] == summary["restarts"], out[-2000:]
    assert summary["loss_last_20pct"] < summary["loss_first_20pct"], out[-2000:]
    assert rc in (0, 1), out[-2000:]


@pytest.mark.timeout(EXAMPLE_BOUND_S + 20)
def test_compressed_wan_saves_bytes_and_learns(tmp_path: Path) -> None:
    # 40 steps learn enough (held-out MSE 0.05-0.09 against the bound of 0.25 here)
    args = ("--steps", "40", "--loss", "0.1")
    rc, out = run_example(tmp_path, "compressed_wan.py", *args, timeout=EXAMPLE_BOUND_S)
    assert rc == 0, out[-2000:]
    res = last_json(out)
    assert res["bytes_saved"]["ddp+arctopk"] > 5  # both directions compressed
    assert res["bytes_saved"]["opt+arctopk"] > 1.2  # gradients only
    for run in ("dense", "opt+arctopk", "ddp+arctopk"):
        assert math.isfinite(res[run]["test_mse"])
        assert res[run]["test_mse"] < 0.25  # learned: the untrained student scores 0.54
