"""The testbed on a real kernel: hosts, measured loss, caps, cuts, and complete teardown.

Needs root, ``ip``/``tc``/``nft`` and working network namespaces; skipped with
the reason otherwise.  Every testbed is named ``gntb<pid>x<n>-...`` so parallel
runs never clash, and every test asserts that nothing of it is left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from gossipnet.testbed import (
    Testbed,
    TestbedError,
    check_tcp_frames,
    cleanup_stale,
    measure_links,
    measure_loss,
    measure_throughput,
    unavailable_reason,
)
from gossipnet.testbed._registry import netns_inode, processes_in
from gossipnet.testbed._sys import list_netns, pid_alive

REASON = unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def _root_links() -> set[str]:
    out = subprocess.run(
        ["ip", "-o", "link", "show"], check=True, timeout=10, capture_output=True, text=True
    ).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _ours(prefix: str) -> list[str]:
    return [ns for ns in list_netns() if ns.startswith(prefix)]


def _assert_gone(tb: Testbed, inodes: set[int], pids: list[int]) -> None:
    assert not tb.leftovers(), tb.leftovers()
    assert _ours(tb.name + "-") == []
    assert processes_in(inodes, tb.name) == []
    for pid in pids:
        assert not pid_alive(pid)


def test_hosts_connect_and_teardown_leaves_nothing() -> None:
    before = _root_links()
    with Testbed(hosts=3) as tb:
        inodes = {netns_inode(n) for n in [tb.switch, *(h.ns for h in tb.hosts)]}
        assert None not in inodes
        assert [h.ip for h in tb.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        sleeper = tb.hosts[2].popen(["sleep", "600"])
        m = measure_loss(tb, 0, 2, count=1000)
        assert m.ok, m
        assert m.received == 1000, m
        assert _root_links() == before  # nothing was created in the machine's own namespace
        assert tb._switch_interfaces() == ["br0", "p0", "p1", "p2"]
    assert sleeper.poll() is not None
    _assert_gone(tb, inodes, [sleeper.pid])  # type: ignore[arg-type]
    assert _root_links() == before


def _failing_run(tb: Testbed, seen: dict[str, Any]) -> None:
    with tb:
        seen["inodes"] = {netns_inode(h.ns) for h in tb.hosts}
        procs = [tb.hosts[0].popen(["sleep", "600"]), tb.hosts[1].start(time.sleep, 600)]
        seen["pids"] = [p.pid for p in procs]
        assert all(p.poll() is None for p in procs)
        raise RuntimeError("boom")


def test_teardown_after_a_failing_body_kills_everything() -> None:
    tb = Testbed(hosts=2)
    seen: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="boom"):
        _failing_run(tb, seen)
    _assert_gone(tb, seen["inodes"], seen["pids"])


_CHILD = """
import signal, sys, time
from gossipnet.testbed import Testbed
# a test run from a background job (`cmd &` in a script) inherits SIGINT ignored, and
# Python then installs no handler: Ctrl-C is what the SIGINT case stands for, so restore it
signal.signal(signal.SIGINT, signal.default_int_handler)
tb = Testbed(hosts=2).up()
tb.hosts[0].popen(["sleep", "600"])
print(tb.name, flush=True)
time.sleep(120)  # not a wait on a condition: lives until the test signals it; caps a stray child
"""


# ~1.5 s on 2 idle cores, 39 s at a load of 12 (the owner's set-up and teardown of two
# hosts); the owner's exit is waited 30 s: 150 s bounds a hang, not slowness.
@pytest.mark.timeout(150)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_interrupted_owner_leaves_nothing(signum: int) -> None:
    """SIGTERM/SIGINT: the owner's hooks tear down; SIGKILL: ``cleanup_stale`` does."""
    with subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        name = p.stdout.readline().strip()
        assert name.startswith("gntb"), name
        assert len(_ours(name + "-")) == 3
        p.send_signal(signum)
        p.wait(timeout=30)
    if signum == signal.SIGKILL:
        assert len(_ours(name + "-")) == 3  # nothing could run in the owner...
        assert sorted(cleanup_stale()) >= sorted(_ours(name + "-"))  # ...so the next run cleans
    assert _ours(name + "-") == []
    assert processes_in(set(), name) == []


def test_measured_loss_matches_the_set_rates() -> None:
    with Testbed(hosts=4) as tb:
        tb.set_loss(None, 0.10)
        ring = [(i, (i + 1) % 4) for i in range(4)]
        for m in measure_links(tb, ring, count=5000):
            assert m.ok, m
            assert m.switch_dropped == m.sent - m.received  # all of it on the switch
        tb.set_loss(None, 0.0)
        tb.set_loss(1, 0.05, direction="both")
        tb.set_loss(2, 0.20, direction="in")
        m = measure_loss(tb, 1, 2, count=5000)
        assert m.expected_rate == pytest.approx(1 - 0.95 * 0.80)
        assert m.ok, m
        for mode in ("drop", "down"):
            tb.cut(3, mode=mode)
            m = measure_loss(tb, 0, 3, count=300)
            assert m.received == 0, m
            assert m.expected_rate == 1.0
            tb.heal(3)
        m = measure_loss(tb, 3, 0, count=1000)
        assert m.received == 1000, m


def test_bandwidth_cap_limits_tcp_goodput() -> None:
    with Testbed(hosts=2) as tb:
        tb.set_rate(0, 20.0)
        capped = measure_throughput(tb, 0, 1, nbytes=2_000_000)
        assert 12.0 < capped < 21.0, capped  # tbf's token bucket allows a small burst
        tb.set_rate(0, None)
        assert measure_throughput(tb, 0, 1, nbytes=2_000_000) > 2 * capped


@pytest.mark.timeout(60)
def test_tcp_crosses_the_loss_rule_one_wire_frame_at_a_time() -> None:
    """No GSO super-packet reaches the loss rule, so one drop is one wire frame lost."""
    with Testbed(hosts=2, mtu=1500) as tb:
        check = check_tcp_frames(tb, 0, 1, nbytes=2_000_000)
        assert check.ok, check
        assert check.packets >= 2_000_000 // 1500  # segments of one MSS, not 64 KB
        assert 1000 < check.avg_bytes <= 1500, check


def test_worker_errors_and_deadlines_surface() -> None:
    with Testbed(hosts=1) as tb:
        h = tb.hosts[0]
        assert h.call(os.getenv, "GNTB_HOST", timeout_s=30) == "h0"
        with pytest.raises(TestbedError, match="ZeroDivisionError"):
            h.call(divmod, 1, 0, timeout_s=30)
        task = h.start(time.sleep, 60)
        with pytest.raises(TimeoutError, match="killed"):
            task.result(timeout_s=0.5)
        assert task.poll() is not None
        assert h.run(["ip", "-o", "addr", "show", "eth0"]).stdout.count("10.77.0.1/24") == 1


def test_cli_runs_a_command_in_every_host(capsys: pytest.CaptureFixture[str]) -> None:
    from gossipnet.testbed import cli

    parser = argparse.ArgumentParser(prog="gossipnet")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["testbed", "--hosts", "2", "--loss", "0.1", "--check", "1000", "--cut", "h1@30"]
    args = parser.parse_args([*argv, "--", "sh", "-c", "echo {rank} {ip} {n} {peers}"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "0 10.77.0.1 2 udp://10.77.0.1:7000,udp://10.77.0.2:7000" in out
    assert "1 10.77.0.2 2 " in out
    assert out.count(" ok; switch dropped") == 2  # both ring links checked
    assert "cut h1" not in out  # the commands ended before the scheduled cut
    name = out.split()[1].rstrip(":")
    assert name.startswith("gntb")
    assert _ours(name + "-") == []
