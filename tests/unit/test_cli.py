"""The ``gossipnet`` console script's own surface: --version and every --help text."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import gossipnet
from gossipnet import cli

ROOT = Path(__file__).resolve().parents[2]


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _option_blocks(text: str) -> list[str]:
    """Each option's help as one line: an entry starts two spaces in, its help wraps deeper."""
    blocks: list[str] = []
    for line in text.splitlines():
        if re.match(r"^  \S", line):
            blocks.append(line.strip())
        elif line.startswith("   ") and blocks:
            blocks[-1] += " " + line.strip()
    return blocks


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"gossipnet {gossipnet.__version__}\n"


def test_package_version_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert gossipnet.__version__ == project["version"]


@pytest.mark.parametrize("command", ["", *cli.COMMANDS])
def test_no_option_shows_its_default_twice(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    text = _help(capsys, *([command] if command else []))
    blocks = _option_blocks(text)
    assert any(b.startswith(("-h", "--help")) for b in blocks), text  # the parse found options
    doubled = [b for b in blocks if b.count("(default:") > 1]
    assert doubled == []


def test_flags_do_not_show_default_false(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert "(default: False)" not in _help(capsys, "demo")


def test_testbed_help_says_root_and_explains_cut_mode_and_mtu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    text = _help(capsys, "testbed")
    assert "Needs root" in text
    for tool in ("network namespaces", "nftables", "tc tbf"):
        assert tool in text
    blocks = {b.split()[0]: b for b in _option_blocks(text) if b.startswith("--")}
    assert "drop" in blocks["--cut-mode"]
    assert "down" in blocks["--cut-mode"]
    assert "MTU" in blocks["--mtu"]
    assert "(default: 1500)" in blocks["--mtu"]
    assert "NO-CARRIER" in text  # what "down" looks like from the host
    assert "tbf burst" in text  # what else --mtu changes


def test_top_level_help_lists_testbed_as_root_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert re.search(r"testbed\s+.*needs root", _help(capsys))
