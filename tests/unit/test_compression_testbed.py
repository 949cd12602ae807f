"""bench/compression.py's arithmetic: /proc/net/dev parsing, time to target,
the stop rule and the speedup bounds (bench/_compression_testbed.py,
bench/_compression_tb_worker.py), the bench's ``--help``, Accordion's comparison
with the static settings, and bench/topk_sim.py's density schedules.

The timing run itself needs root and minutes on the namespace testbed; what turns
its measurements into figures does not, so it is checked here on made-up numbers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

NET_DEV = (
    "Inter-|   Receive     |  Transmit\n"
    " face |bytes packets errs drop fifo frame compressed multicast|bytes packets ...\n"
    "    lo: 100 2 0 0 0 0 0 0 100 2 0 0 0 0 0 0\n"
    "  eth0: 5000000 4000 0 0 0 0 0 0 7000123 5000 0 3 0 0 0 0\n"
)


@pytest.fixture(scope="module")
def tb() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        import _compression_testbed

        return _compression_testbed
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def worker(tb: ModuleType) -> ModuleType:
    return sys.modules["_compression_tb_worker"]


def test_parse_net_dev_reads_rx_and_tx_bytes(worker: ModuleType) -> None:
    parsed = worker.parse_net_dev(NET_DEV)
    assert parsed == {"lo": (100, 100), "eth0": (5_000_000, 7_000_123)}


def test_parse_net_dev_rejects_a_short_line(worker: ModuleType) -> None:
    with pytest.raises(ValueError, match="eth0"):
        worker.parse_net_dev(NET_DEV + "  eth0: 1 2 3\n")


def test_time_to_target_takes_the_slowest_host_and_first_hit(tb: ModuleType) -> None:
    # two hosts, segments [step, seconds, cpu, loss]; mean loss hits 1.2 at step 10
    a = [[5, 1.0, 0.1, 1.5], [10, 1.0, 0.1, 1.1], [15, 9.0, 0.1, 1.0]]
    b = [[5, 2.0, 0.3, 1.5], [10, 0.5, 0.3, 1.2], [15, 9.0, 0.3, 1.0]]
    out = tb.time_to_target([a, b], target=1.2)
    assert out["reached"] is True
    assert out["steps"] == 10
    assert out["seconds"] == pytest.approx(3.0)  # max(1, 2) + max(1, 0.5)
    assert out["s_per_step"] == pytest.approx(0.3)
    assert out["cpu_per_step"] == pytest.approx(0.4 / 10)
    assert out["loss"] == pytest.approx(1.15)


def test_time_to_target_missed_is_a_lower_bound(tb: ModuleType) -> None:
    a = [[5, 1.0, 0.1, 2.0], [10, 1.0, 0.1, 1.9]]
    out = tb.time_to_target([a, a], target=1.2)
    assert out["reached"] is False
    assert (out["steps"], out["seconds"]) == (10, pytest.approx(2.0))


def test_stop_rule_is_the_same_numbers_for_every_rank(worker: ModuleType) -> None:
    evals = [{"loss": 1.1, "s": 3.0}, {"loss": 1.4, "s": 4.0}]
    assert not worker.should_stop(evals, 10, target=1.2, max_steps=100, max_s=60.0)
    assert worker.should_stop(evals, 10, target=1.25, max_steps=100, max_s=60.0)
    assert worker.should_stop(evals, 100, target=1.2, max_steps=100, max_s=60.0)
    assert worker.should_stop(evals, 10, target=1.2, max_steps=100, max_s=4.0)  # slowest rank


def test_speedup_marks_bounds(tb: ModuleType) -> None:
    ours = {"seconds": 5.0, "reached": True}
    assert tb.speedup({"seconds": 20.0, "reached": True}, ours) == {"value": 4.0, "bound": "exact"}
    assert tb.speedup({"seconds": 20.0, "reached": False}, ours)["bound"] == ">="
    missed = {"seconds": 10.0, "reached": False}
    assert tb.speedup({"seconds": 20.0, "reached": True}, missed)["bound"] == "<="
    assert tb.speedup({"seconds": 20.0, "reached": False}, missed)["value"] is None
    assert tb.speedup(None, ours)["value"] is None


def test_cell_summary_median_and_range(tb: ModuleType) -> None:
    def run(s: float) -> dict[str, float | bool]:
        return {"seconds": s, "steps": 10, "s_per_step": s / 10, "cpu_per_step": 0.01,
                "wire_bytes_per_step": 1e5, "load": 4.0, "reached": True, "loss": 1.1}  # fmt: skip

    cell = tb.cell_summary([run(3.0), run(5.0), {"error": "timeout"}])
    assert cell["seconds"] == 4.0
    assert cell["seconds_range"] == [3.0, 5.0]
    assert cell["errors"] == ["timeout"]
    assert cell["reps"] == 3


@pytest.mark.timeout(60)
def test_compression_bench_help_lists_the_testbed_flags() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "compression.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in ("--testbed", "--caps", "--tb-losses", "--methods", "--target", "--tb-reps"):
        assert flag in out
    for flag in ("--optim", "--lr", "--values"):
        assert flag in out


def test_optimizer_defaults_per_name_and_lr_override(tb: ModuleType, worker: ModuleType) -> None:
    """Every method trains with the same optimizer: Adam 1e-3 by default (old commands
    reproduce), SGD momentum 0.9 lr 0.1, ``--lr`` overriding either."""
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    tb.add_testbed_args(parser)
    settings = tb.optim_settings(parser.parse_args([]))
    assert settings == {"name": "adam", "lr": 1e-3, "momentum": 0.0}
    settings = tb.optim_settings(parser.parse_args(["--optim", "sgd"]))
    assert settings == {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    assert tb.optim_settings(parser.parse_args(["--optim", "sgd", "--lr", "0.05"]))["lr"] == 0.05
    with pytest.raises(SystemExit):
        parser.parse_args(["--optim", "lamb"])
    with pytest.raises(SystemExit):
        tb.optim_settings(parser.parse_args(["--lr", "0"]))
    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = worker.make_optimizer(params, settings)
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.param_groups[0]["momentum"] == 0.9
    adam = worker.make_optimizer(params, {"name": "adam", "lr": 1e-3, "momentum": 0.0})
    assert isinstance(adam, torch.optim.Adam)
    with pytest.raises(ValueError, match="lamb"):
        worker.make_optimizer(params, {"name": "lamb", "lr": 1.0, "momentum": 0.0})


def test_summary_headline_keys_are_theirs_over_arctopk_at_20_mbit_1pct(tb: ModuleType) -> None:
    def run(method: str, s: float, cap: float = 20.0) -> dict[str, object]:
        return {"cap": cap, "loss_rate": 0.01, "method": method, "seconds": s, "steps": 10,
                "s_per_step": s / 10, "cpu_per_step": 0.01, "wire_bytes_per_step": 1.0,
                "load": 1.0, "reached": True, "loss": 1.0}  # fmt: skip

    runs = [run("gn_arctopk", 2.0), run("gn_dct", 1.0), run("gloo", 12.0), run("powersgd1", 5.0)]
    runs.append(run("gloo", 1.0, cap=100.0))  # another cap: not the headline
    out = tb.summarise_tb(runs)
    assert out["speedup_vs_gloo_capped_1pct"] == pytest.approx(6.0)
    assert out["speedup_vs_powersgd_capped_1pct"] == pytest.approx(2.5)
    assert out["by_method_capped_1pct"]["gn_dct"]["vs_gloo"]["value"] == pytest.approx(12.0)


@pytest.fixture(scope="module")
def quality_bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        import compression

        return compression
    finally:
        sys.path.remove(str(BENCH))


def _row(q: float, b: float) -> dict[str, float]:
    return {"quality_median": q, "bytes_per_step": b}


def test_accordion_ratio_by_the_grid_rule_and_interpolated(quality_bench: ModuleType) -> None:
    """The grid rule takes the cheapest static row within 1% of Accordion's quality;
    the interpolated figure finds the static bytes at exactly Accordion's quality
    (log bytes, linear in quality), so a coarse grid cannot inflate it."""
    rows = {
        "demo/arctopk@0.04/0": _row(14.0, 50_000.0),
        "demo/arctopk@0.05/0": _row(13.0, 64_000.0),
        "demo/arctopk@0.06/0": _row(12.0, 80_000.0),
        "demo/arctopk-plain/0": _row(11.0, 10_000.0),  # stock AdamW: not a static peer
        "demo/accordion@0.1/0.015/20/0": _row(12.5, 50_000.0),
        "demo/dense/0": _row(10.0, 1e6),
    }
    out = quality_bench.accordion_ratios(rows, "demo")
    hit = out["accordion@0.1/0.015/20"]
    assert hit["vs"] == "demo/arctopk@0.06/0"  # 13.0 is more than 1% worse than 12.5
    assert hit["ratio"] == pytest.approx(80_000 / 50_000)
    halfway = (64_000 * 80_000) ** 0.5  # quality 12.5 is halfway from 13 to 12
    assert hit["ratio_interp"] == pytest.approx(halfway / 50_000)
    # better than every static row: no equal static setting, no interpolation
    rows["demo/accordion/0"] = _row(11.5, 40_000.0)
    assert quality_bench.accordion_ratios(rows, "demo")["accordion"] == {
        "ratio": None, "vs": None, "ratio_interp": None,
    }  # fmt: skip


def test_topk_sim_density_schedules() -> None:
    """``0.1@30>0.01``: 0.1 before step 30, then 0.01; a plain density holds throughout."""
    sys.path.insert(0, str(BENCH))
    try:
        import topk_sim
    finally:
        sys.path.remove(str(BENCH))
    plan = topk_sim.schedule("0.1@30>0.02@200>0.05")
    assert [topk_sim.density_at(plan, s) for s in (0, 29, 30, 199, 200, 10**6)] == [
        0.1, 0.1, 0.02, 0.02, 0.05, 0.05,
    ]  # fmt: skip
    assert topk_sim.density_at(topk_sim.schedule("0.03"), 299) == 0.03


def test_tally_sums_what_loss_did_to_the_rounds(quality_bench: ModuleType) -> None:
    from gossipnet.reports import CollectiveReport

    seen = dict.fromkeys(quality_bench.LOSS_KEYS, 0.0)
    rep = CollectiveReport(
        packets_received=9, packets_lost=1, chunks_total=10, chunks_stale=2, timed_out=True,
        extra={"index_mismatch": 1.0, "arrived_behind": 3.0},
    )  # fmt: skip
    quality_bench.tally(seen, rep)
    quality_bench.tally(seen, CollectiveReport(chunks_total=10, packets_received=10))
    assert (seen["chunks"], seen["stale"], seen["timed_out"]) == (20, 2, 1)
    assert (seen["packets_lost"], seen["packets_expected"]) == (1, 20)
    assert (seen["index_mismatch"], seen["arrived_behind"], seen["ef_unresolved"]) == (1, 3, 0)
