"""Capacity matrices shared by the Blink unit tests (GB/s per direction)."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi-topo"

#: DGX-1V NVLink counts (ALGORITHMS.md 5.2), 25 GB/s per link per direction.
DGX1V_LINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
    (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}  # fmt: skip


def dgx1v() -> np.ndarray:
    cap = np.zeros((8, 8))
    for (a, b), n in DGX1V_LINKS.items():
        cap[a, b] = cap[b, a] = 25.0 * n
    return cap


def dgx1p() -> np.ndarray:
    """P100: 0-3 and 4-7 fully connected by single links, plus i <-> i+4; 20 GB/s."""
    cap = np.zeros((8, 8))
    for a, b in itertools.permutations(range(8), 2):
        if (a < 4) == (b < 4) or abs(a - b) == 4:
            cap[a, b] = 20.0
    return cap


#: A deterministic sample of allocations (all 219 are covered by bench/blink.py).
SUBSETS = (
    (0, 1, 5), (0, 1, 6), (0, 3, 4), (1, 2, 4), (0, 1, 2, 3), (0, 1, 4, 5), (0, 2, 5, 7),
    (0, 1, 2, 4, 5), (1, 3, 5, 6, 7), (0, 1, 2, 3, 4, 5), (0, 2, 3, 4, 6, 7),
    (0, 1, 2, 3, 5, 6, 7), tuple(range(8)),
)  # fmt: skip


@functools.cache
def allocation(machine: str, sub: tuple[int, ...]) -> np.ndarray:
    full = dgx1v() if machine == "v100" else dgx1p()
    return full[np.ix_(sub, sub)]
