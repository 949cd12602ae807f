"""The testbed's pure parts: the exact kernel rules it asks for, bounds, names.

No root needed (so not marked ``netns``): these pin what the namespace tests
then show the kernel doing.
"""

from __future__ import annotations

import argparse
import json

import pytest

from gossipnet.testbed import LinkState, TestbedConfig, binomial_bounds
from gossipnet.testbed import cli as testbed_cli
from gossipnet.testbed._registry import NAME_RE, _stale_owner
from gossipnet.testbed._shaping import (
    LOSS_SCALE,
    parse_counters,
    render_ruleset,
    tbf_args,
    tbf_burst_bytes,
)


def test_ruleset_is_an_atomic_replace_on_the_bridge_forward_hook() -> None:
    text = render_ruleset([LinkState(host="h0", port="p0", loss_out=0.1)])
    lines = text.splitlines()
    assert lines[0] == "add table bridge gntb"
    assert lines[1] == "flush table bridge gntb"
    assert "type filter hook forward priority 0; policy accept;" in text
    assert f'iifname "p0" numgen random mod {LOSS_SCALE} < 100000 counter drop' in text


def test_loss_rules_per_direction_and_extremes() -> None:
    links = [
        LinkState(host="h0", port="p0"),
        LinkState(host="h1", port="p1", loss_in=0.05),
        LinkState(host="h2", port="p2", loss_out=1.0),
        LinkState(host="h3", port="p3", loss_out=0.3, cut=True),
    ]
    text = render_ruleset(links)
    assert "h0 loss" not in text  # lossless: counters only
    rule = 'oifname "p1" numgen random mod 1000000 < 50000 counter drop comment "h1 loss-in"'
    assert rule in text
    assert 'iifname "p2" counter drop comment "h2 loss-out"' in text  # p = 1: no numgen
    assert 'iifname "p3" counter drop comment "h3 cut-out"' in text
    assert 'oifname "p3" counter drop comment "h3 cut-in"' in text
    assert "h3 loss-out" not in text  # a cut overrides the loss rule
    for h in ("h0", "h1", "h2", "h3"):
        assert f'"{h} seen-out"' in text
        assert f'"{h} seen-in"' in text
    assert "oversize" not in text  # no MTU given: no size counter
    sized = render_ruleset(links[:1], mtu=9000)
    assert 'iifname "p0" meta length > 9000 counter comment "h0 oversize-out"' in sized
    assert "drop" not in sized  # a counter only, never a verdict


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_link_state_rejects_non_probabilities(bad: float) -> None:
    with pytest.raises(ValueError, match="probability"):
        LinkState(host="h0", port="p0", loss_out=bad)


def test_counters_parsed_by_comment() -> None:
    doc = {
        "nftables": [
            {"metainfo": {"version": "1.0.6"}},
            {"table": {"family": "bridge", "name": "gntb"}},
            {
                "rule": {
                    "comment": "h0 seen-out",
                    "expr": [{"match": {}}, {"counter": {"packets": 12, "bytes": 900}}],
                }
            },
            {
                "rule": {
                    "comment": "h0 loss-out",
                    "expr": [{"counter": {"packets": 3, "bytes": 9}}, {"drop": None}],
                }
            },
            {"rule": {"expr": [{"counter": {"packets": 1, "bytes": 1}}]}},
        ]
    }
    assert parse_counters(json.dumps(doc)) == {"h0 seen-out": 12, "h0 loss-out": 3}


def test_tbf_arguments() -> None:
    args = tbf_args("eth0", 20.0, 50.0, 1500)
    assert args[:7] == ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf"]
    assert args[args.index("rate") + 1] == "20000kbit"
    assert args[args.index("latency") + 1] == "50ms"
    assert int(args[args.index("burst") + 1]) == tbf_burst_bytes(20.0, 1500) >= 4 * 1514
    assert tbf_burst_bytes(1000.0, 1500) == 250_000  # 2 ms at 1 Gbit/s
    with pytest.raises(ValueError, match="> 0"):
        tbf_args("eth0", 0.0, 50.0, 1500)


def test_binomial_bounds() -> None:
    assert binomial_bounds(5000, 0.0) == (0.0, 0.5 / 5000)  # lossless: not one packet
    low, high = binomial_bounds(5000, 1.0)
    assert high == 1.0
    assert low == pytest.approx(1.0 - 0.5 / 5000)
    low, high = binomial_bounds(5000, 0.1)
    assert 0.08 < low < 0.082  # 4.5 sigma = 1.9 points
    assert 0.118 < high < 0.12
    with pytest.raises(ValueError, match="n must be"):
        binomial_bounds(0, 0.1)


def test_config_validation() -> None:
    assert TestbedConfig().subnet == "10.77.0.0/24"
    bad_values = ({"hosts": 0}, {"subnet": "8.8.8.0/24"}, {"subnet": "10.77.0.0/16"}, {"mtu": 100})
    for bad in bad_values:
        with pytest.raises(ValueError, match="must be"):
            TestbedConfig(**bad)  # type: ignore[arg-type]


def test_stale_names_carry_their_owner_pid() -> None:
    assert NAME_RE.match("gntb123x0-h1") is not None
    assert NAME_RE.match("other-ns") is None
    assert _stale_owner("gntb123x4-sw", alive=lambda pid: False) == 123
    assert _stale_owner("gntb123x4-sw", alive=lambda pid: True) is None
    assert _stale_owner("myns", alive=lambda pid: False) is None


def _cli_parse(argv: list[str]) -> argparse.Namespace:
    """Parse like ``gossipnet.cli.main`` does: subcommand name in ``args.command``."""
    parser = argparse.ArgumentParser(prog="gossipnet")
    sub = parser.add_subparsers(dest="command", required=True)
    testbed_cli.add_parser(sub)
    return parser.parse_args(argv)


def test_cli_parses_without_clobbering_the_subcommand_name() -> None:
    args = _cli_parse(["testbed", "--loss", "h1=0.1", "--cut", "h3@5", "--", "echo", "{ip}"])
    assert args.command == "testbed"
    assert args.cmd[-2:] == ["echo", "{ip}"]
    assert testbed_cli._per_host(args.loss, ["h0", "h1"]) == {"h0": 0.0, "h1": 0.1}
    assert testbed_cli._per_host("0.05", ["h0", "h1"]) == {"h0": 0.05, "h1": 0.05}
    assert testbed_cli._cuts(args.cut) == [(5.0, "h3")]
    with pytest.raises(ValueError, match="unknown host"):
        testbed_cli._per_host("h9=0.1", ["h0"])


def test_cli_says_why_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gossipnet.testbed as tb_pkg

    monkeypatch.setattr(tb_pkg, "unavailable_reason", lambda: "the testbed needs root")
    args = _cli_parse(["testbed", "--train"])
    assert args.func(args) == testbed_cli.EXIT_UNAVAILABLE
    assert "needs root" in capsys.readouterr().out
