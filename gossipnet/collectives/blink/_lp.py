"""A dense simplex for the small packing LPs: max sum(x) s.t. A x <= b, x >= 0.

Why our own: the LPs have at most a few hundred columns (trees) and <= 16 * 15 rows
(links), gossipnet has no scipy dependency, and only this one LP shape is needed:
b >= 0, so the origin is feasible and no phase one is required.  It returns the duals
too (the links' shadow prices), which price new trees in column generation.
"""

from __future__ import annotations

import numpy as np

__all__ = ("LpResult", "max_sum")

_TOL = 1e-10


class LpResult:
    """Optimum of :func:`max_sum`: ``value``, primal ``x`` and dual ``y`` (per row)."""

    __slots__ = ("value", "x", "y")

    def __init__(self, value: float, x: np.ndarray, y: np.ndarray) -> None:
        self.value = value
        self.x = x
        self.y = y


def max_sum(a: np.ndarray, b: np.ndarray, max_pivots: int = 5000) -> LpResult:
    """Maximise sum(x) subject to ``a @ x <= b``, ``x >= 0`` (tableau simplex).

    Entering column: most negative reduced cost (Dantzig), switching to Bland's rule
    (lowest index) after 50 pivots so degenerate cycling cannot last.

    Args:
        a: m x n non-negative constraint matrix (rows = links, columns = trees).
        b: m capacities, >= 0.
        max_pivots: backstop; the LPs here need tens of pivots.

    Raises:
        ValueError: b has a negative entry, or the LP is unbounded (a column of zeros).
        RuntimeError: no optimum after ``max_pivots`` pivots.
    """
    m, n = a.shape
    if (b < 0).any():
        raise ValueError("max_sum needs b >= 0")
    t = np.zeros((m + 1, n + m + 1))
    t[:m, :n] = a
    t[:m, n : n + m] = np.eye(m)
    t[:m, -1] = b
    t[m, :n] = -1.0
    basis = np.arange(n, n + m)
    for pivots in range(max_pivots):
        red = t[m, :-1]
        neg = np.flatnonzero(red < -_TOL)
        if neg.size == 0:
            x = np.zeros(n + m)
            x[basis] = t[:m, -1]
            return LpResult(float(t[m, -1]), x[:n].copy(), t[m, n : n + m].copy())
        j = int(neg[0]) if pivots >= 50 else int(neg[np.argmin(red[neg])])
        col = t[:m, j]
        pos = col > _TOL
        if not pos.any():
            raise ValueError("unbounded LP: a column uses no constrained row")
        ratio = np.where(pos, t[:m, -1] / np.where(pos, col, 1.0), np.inf)
        best = ratio.min()
        rows = np.flatnonzero(ratio <= best + _TOL * max(1.0, abs(best)))
        r = int(rows[np.argmin(basis[rows])])
        t[r] /= t[r, j]
        others = np.arange(m + 1) != r
        t[others] -= np.outer(t[others, j], t[r])
        basis[r] = j
    raise RuntimeError(f"simplex did not converge in {max_pivots} pivots")
