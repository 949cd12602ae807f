"""The README's checkable facts stay true: its code parses, its Config table matches
``Config``'s defaults, and its error table names every error gossipnet defines."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import gossipnet
from gossipnet import errors

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def _table_rows(text: str) -> list[list[str]]:
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row] for row in rows]


def test_python_blocks_parse() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for block in blocks:
        ast.parse(block)


def test_config_table_names_real_fields_with_their_defaults() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(gossipnet.Config)}
    rows = _table_rows(_section("Configuration"))
    assert len(rows) >= 8
    for row in rows:
        names = re.findall(r"`(\w+)`", row[0])
        shown = [part.split()[0].strip('"') for part in row[1].split(", ")]
        assert len(names) == len(shown), row
        for name, value in zip(names, shown, strict=True):
            assert name in defaults, name
            assert str(defaults[name]) == value, (name, defaults[name], value)


def test_error_table_covers_every_gossipnet_error() -> None:
    table = _section("Errors and what to do")
    named = set(re.findall(r"`(?:gossipnet\.errors\.)?(\w+)`", table))
    defined = {name for name in errors.__all__ if name != "GossipError"}
    assert defined <= named, sorted(defined - named)
