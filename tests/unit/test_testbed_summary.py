"""bench/testbed.py's busy loops and summary (bench/_testbed_busy.py): no root, no network.

The bench itself needs root and minutes; its arithmetic and its busy processes
do not, so they are checked here on made-up rows.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BUSY_PATH = Path(__file__).resolve().parents[2] / "bench" / "_testbed_busy.py"


@pytest.fixture(scope="module")
def busy_mod() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_testbed_busy", BUSY_PATH)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_testbed_busy", mod)
    spec.loader.exec_module(mod)
    return mod


def _cell(s: float, cpu: float | None, timed_out: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"s": s, "timed_out": timed_out}
    if cpu is not None:
        out["cpu_s"] = cpu
    return out


def _row(loss: float, cap: float | None, busy: int, gn_s: float, gl_s: float) -> dict[str, Any]:
    return {
        "loss": loss,
        "cap_mbit": cap,
        "busy": busy,
        "gossipnet_step": _cell(gn_s, 0.4),
        "gloo_step": _cell(gl_s, 0.2),
        "gossipnet_allreduce": _cell(gn_s, 0.3),
        "gloo_allreduce": _cell(gl_s, None, timed_out=True),  # timed out: no CPU figure
    }


def test_summary_gives_the_issue_keys_and_targets(busy_mod: ModuleType) -> None:
    rows = [
        _row(0.0, None, 0, 1.0, 0.8),
        _row(0.05, None, 0, 1.0, 6.0),
        _row(0.1, None, 0, 1.1, 16.0),
        _row(0.05, None, 1, 2.0, 5.0),
        _row(0.0, 100.0, 0, 3.0, 2.0),
    ]
    out = busy_mod.summary(rows, 100.0, 1)
    assert out["cpu_vs_gloo_0pct"] == 2.0
    assert out["cpu_vs_gloo_0pct_allreduce"] is None  # gloo timed out: no ratio
    assert out["gloo_vs_gossipnet_5pct"] == 6.0
    assert out["gloo_vs_gossipnet_5pct_busy"] == 2.5
    assert out["gloo_vs_gossipnet_0pct_capped"] == pytest.approx(0.667)
    assert "gloo_vs_gossipnet_5pct_allreduce_busy" in out["lower_bounds"]
    met = out["targets_met"]
    assert met == {
        "cpu_vs_gloo_0pct <= 2.5": True,
        "gloo_vs_gossipnet_0pct >= 0.769": True,
        "gloo_vs_gossipnet_5pct >= 5": True,
        "gloo_vs_gossipnet_5pct_busy >= 3": False,
        "gossipnet_10pct_vs_0pct <= 1.2": True,
    }
    assert "gloo_vs_gossipnet_5pct_busy" not in busy_mod.summary(rows, 100.0, 0)


def test_busy_processes_run_inside_the_block_and_are_gone_after(busy_mod: ModuleType) -> None:
    with busy_mod.Busy(2) as busy:
        procs = list(busy._procs)
        assert len(procs) == 2
        assert all(p.poll() is None for p in procs)  # still spinning
    assert all(p.returncode is not None for p in procs)
    with busy_mod.Busy(0) as none:
        assert none._procs == []
