"""Parsers for ``nvidia-smi topo -m`` / ``topo -mp`` and ``nvidia-smi nvlink -s`` text.

Why a tolerant parser: the text form is what users paste into issues and what
``detect()`` gets when NVML is unavailable, and published copies are damaged in
small ways (tabs turned into spaces, a header row with its tabs lost, trailing tabs,
``SOC`` from drivers before ``SYS`` was renamed). The header row is therefore never
trusted: the GPU columns are inferred from the rows, which always come first and
carry an ``X`` on the diagonal (GPU row r has its ``X`` in GPU column r).

Everything here is pure text -> plain data; :mod:`.topology` builds the
:class:`~gossipnet.collectives.blink.topology.GpuTopology`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from gossipnet.errors import TopologyError

__all__ = ("PCIE_PATHS", "ParsedMatrix", "parse_nvlink_status_text", "parse_matrix_text")

#: PCIe path kinds, nearest first (legend of ``nvidia-smi topo -m``). ``SOC`` (old
#: drivers) is read as ``SYS``; ``P2P`` is what the torch fallback records for a pair
#: that has peer access but an unknown path.
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS", "P2P")

_ROW_LABEL = re.compile(r"^GPU(\d+)$")
_NV_CELL = re.compile(r"^NV(\d+)$")
_SELF_CELL = "X"
_ALIASES = {"SOC": "SYS"}


class ParsedMatrix(NamedTuple):
    """GPU part of a topology matrix: labels, NVLink counts, PCIe path kinds."""

    gpus: tuple[int, ...]
    nvlinks: dict[tuple[int, int], int]
    pcie: dict[tuple[int, int], str]


def _cells(line: str) -> list[str]:
    """Split one row into stripped cells.

    Tab-separated rows keep empty cells (their positions matter only after the GPU
    columns, which are never empty); rows whose tabs were lost fall back to runs of
    whitespace, which is unambiguous for GPU cells (``X``, ``NV#``, ``PIX``...).
    """
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return line.split()


def _gpu_rows(text: str) -> list[tuple[int, list[str]]]:
    """Rows labelled ``GPU<n>`` that hold an ``X`` cell; the header and legend never do."""
    rows: list[tuple[int, list[str]]] = []
    for raw in text.splitlines():
        cells = _cells(raw.rstrip("\r\n"))
        if len(cells) < 2:
            continue
        match = _ROW_LABEL.match(cells[0])
        if match is None or _SELF_CELL not in cells[1:]:
            continue
        rows.append((int(match.group(1)), cells[1:]))
    return rows


def _parse_cell(cell: str, where: str) -> int | str:
    """``NV#`` -> link count (int); a PCIe path -> its canonical name (str)."""
    nv = _NV_CELL.match(cell)
    if nv is not None:
        count = int(nv.group(1))
        if count <= 0:
            raise TopologyError(f"{where}: NVLink count must be positive, got {cell!r}")
        return count
    path = _ALIASES.get(cell, cell)
    if path in PCIE_PATHS:
        return path
    raise TopologyError(
        f"{where}: unknown connection {cell!r}; expected X, NV<n> or one of "
        f"{', '.join(PCIE_PATHS[:-1])}, SOC"
    )


def parse_matrix_text(text: str) -> ParsedMatrix:
    """Parse the GPU-by-GPU block of ``nvidia-smi topo -m`` (or ``-mp``) output.

    NIC rows/columns (``mlx5_N``, ``NICn``), CPU/NUMA affinity columns, ``GPU NUMA ID``
    and the legend are ignored: GPU columns are the first k cells of each GPU row,
    where k is the number of GPU rows.

    Raises:
        TopologyError: no GPU rows, a duplicate GPU label, an ``X`` off the diagonal,
            an unknown cell, or an asymmetric matrix.
    """
    if not isinstance(text, str):
        raise TopologyError(f"topology text must be str, got {type(text).__name__}")
    rows = _gpu_rows(text)
    if not rows:
        raise TopologyError(
            "no GPU rows found (lines starting 'GPU<n>' with an 'X' self cell); "
            "pass the output of `nvidia-smi topo -m`"
        )
    gpus = tuple(label for label, _ in rows)
    if len(set(gpus)) != len(gpus):
        raise TopologyError(f"duplicate GPU rows in topology text: {list(gpus)}")
    k = len(gpus)
    seen: dict[tuple[int, int], int | str] = {}
    for r, (label, cells) in enumerate(rows):
        if len(cells) < k:
            raise TopologyError(f"row GPU{label} has {len(cells)} cells, needs {k} GPU columns")
        if cells.index(_SELF_CELL) != r:
            raise TopologyError(
                f"row GPU{label}: self cell 'X' at column {cells.index(_SELF_CELL)}, "
                f"expected {r} (GPU columns must mirror GPU rows)"
            )
        for c in range(k):
            if c == r:
                continue
            value = _parse_cell(cells[c], f"row GPU{label}, column {c}")
            seen[(gpus[r], gpus[c])] = value
    nvlinks: dict[tuple[int, int], int] = {}
    pcie: dict[tuple[int, int], str] = {}
    for (a, b), value in seen.items():
        if a > b:
            continue
        if seen[(b, a)] != value:
            raise TopologyError(
                f"asymmetric topology: GPU{a}->GPU{b} is {_show(value)}, "
                f"GPU{b}->GPU{a} is {_show(seen[(b, a)])}"
            )
        if isinstance(value, int):
            nvlinks[(a, b)] = value
        else:
            pcie[(a, b)] = value
    return ParsedMatrix(tuple(sorted(gpus)), nvlinks, pcie)


def _show(value: int | str) -> str:
    return f"NV{value}" if isinstance(value, int) else value


_STATUS_GPU = re.compile(r"^\s*GPU\s+(\d+)\s*:")
_STATUS_LINK = re.compile(
    r"^\s*Link\s+(\d+)\s*:\s*(?:(<?inactive>?)|([0-9]*\.?[0-9]+)\s*([GM])B/s)", re.IGNORECASE
)


def parse_nvlink_status_text(text: str) -> dict[int, list[float]]:
    """Parse ``nvidia-smi nvlink -s``: per GPU, per link speed in GB/s (inactive -> 0.0).

    A GPU printed with "all links are inActive" (and no link lines) maps to ``[]``;
    links are listed in link-number order with gaps filled by 0.0. ``MB/s`` speeds are
    converted. Lines the parser does not know (newer drivers add some) are ignored.

    Raises:
        TopologyError: no ``GPU <n>:`` header found, or a link line before any GPU.
    """
    if not isinstance(text, str):
        raise TopologyError(f"nvlink status text must be str, got {type(text).__name__}")
    links: dict[int, dict[int, float]] = {}
    current: int | None = None
    for line in text.splitlines():
        gpu = _STATUS_GPU.match(line)
        if gpu is not None:
            current = int(gpu.group(1))
            if current in links:
                raise TopologyError(f"GPU {current} appears twice in nvlink status text")
            links[current] = {}
            continue
        link = _STATUS_LINK.match(line)
        if link is None:
            continue
        if current is None:
            raise TopologyError(f"nvlink status line before any 'GPU <n>:' header: {line!r}")
        if link.group(2) is not None:
            speed = 0.0
        else:
            speed = float(link.group(3)) / (1000.0 if link.group(4).upper() == "M" else 1.0)
        links[current][int(link.group(1))] = speed
    if not links:
        raise TopologyError("no 'GPU <n>:' lines found; pass the output of `nvidia-smi nvlink -s`")
    out: dict[int, list[float]] = {}
    for gpu_id, per_link in links.items():
        n = max(per_link) + 1 if per_link else 0
        out[gpu_id] = [per_link.get(i, 0.0) for i in range(n)]
    return out
