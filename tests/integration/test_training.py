"""End to end: real peer processes train a real (tiny) language model over lossy TCP.

Why here and not in unit tests: the unit tests prove the all-reduce unbiased and
the drift bounded on synthetic tensors; this proves the composition trains,
i.e. that a run at 10% packet loss follows the lossless run's curve, as
Weintraub et al. (2025) report (<= 0.8% perplexity change at 10% loss).
"""

from __future__ import annotations

import csv
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gossipnet.demo.harness import DemoConfig, run_demos

pytestmark = pytest.mark.slow

# 3 peers, 120 steps of a 1-block, d=32 model: ~8 s on 2 idle cores, start-up included.
# timeout_s: no peer may be cut from a round for being slow, since the test compares
# what packet loss does, not what a starved CPU does: on a loaded machine a peer
# process starved past the demo's 2 s was cut from a round and then paired its steps
# with the others' next ones (issue 19 part 1).  No round reaches 30 s at 10% loss.
SMALL = DemoConfig(
    peers=3,
    steps=120,
    batch=8,
    context=32,
    d_model=32,
    layers=1,
    heads=2,
    lr=3e-3,
    warmup_steps=10,
    eval_every=40,
    eval_windows=128,
    chunk_bytes=4096,
    timeout_s=30.0,
)
#: A hang, not slowness: two runs take ~8 s on 2 idle cores, ~5x that at a load of 8.
RUNS_BOUND_S = 240.0

# Tolerance on the final eval loss of the 10%-loss run minus the lossless run's,
# in nats/char.  Measured with SMALL (2 cores, 10 data seeds, fault seeds 7-11):
# the gap is +0.002 to +0.016 (mean +0.007): by design, since a peer that misses a
# parameter broadcast computes its next gradient on one-step-stale values.  The
# same seeds repeated move a lossy run by < 0.001 (which packets a heartbeat
# shifts), a lossless run not at all; changing the data seed moves a lossless
# run by ~0.015 (sd).  0.04 is 2.5x the largest gap seen, so honest noise does
# not fail the test; what it catches is the composition going wrong: e.g. peers
# whose collectives pair up out of step (a parameter average meeting a gradient
# average cost +0.8 nats when it happened), or stale chunks that never heal.
# A gradient bias alone (dividing by N instead of by the contributions that
# arrived) is largely undone by Adam's normalisation; the unit tests own that.
TOLERANCE_NATS = 0.04


@pytest.mark.timeout(RUNS_BOUND_S + 30)  # run_demos' own bound fires first, naming it
def test_lossy_training_tracks_lossless() -> None:
    lossless, lossy = run_demos(
        [SMALL, dataclasses.replace(SMALL, loss=0.1, seed=7)], timeout_s=RUNS_BOUND_S
    )

    assert lossy.lost_fraction > 0.05, "the fault plan must really drop packets"
    assert lossless.lost_fraction < 0.02  # loopback TCP: only deadline cut-offs
    first = lossless.eval_curve()[0][1]
    assert lossless.final_eval_loss < first - 0.1, "the lossless run must learn"
    assert lossy.final_eval_loss < first - 0.1, "the lossy run must learn too"
    gap = lossy.final_eval_loss - lossless.final_eval_loss
    assert abs(gap) < TOLERANCE_NATS, (
        f"10% loss moved the final eval loss by {gap:+.4f} nats "
        f"(lossless {lossless.final_eval_loss:.4f}, lossy {lossy.final_eval_loss:.4f})"
    )
    # bounded drift: the replicas agree closely at the end of the lossy run
    finals = [e.eval_loss for e in lossy.evals if e.step == SMALL.steps]
    assert len(finals) == SMALL.peers
    assert max(finals) - min(finals) < 0.01  # measured: < 0.0003


# ~6 s on 2 idle cores (three processes importing torch, 12 steps).  The demo bounds
# itself (run_demos: 120 s + 2 s a step) and exits non-zero past it; the subprocess
# limit above that bounds a demo that hangs past its own bound.
@pytest.mark.timeout(220)
def test_cli_demo_writes_csv_and_png(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [
        sys.executable, "-m", "gossipnet.cli", "demo", "--peers", "2", "--steps", "12",
        "--eval-every", "6", "--d-model", "32", "--layers", "1", "--context", "32",
        "--batch", "4", "--loss", "0.1", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    assert "perplexity" in proc.stdout
    with (out / "steps.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * 12
    assert {r["rank"] for r in rows} == {"0", "1"}
    assert sum(1 for r in rows if r["eval_loss"]) == 2 * 2
    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
