"""``bench/testbed.py``'s busy machine and its summary (not a bench itself).

``--busy N`` starts N processes that each keep one core busy, as a training
job's data loading and augmentation do, for the whole of a measured row
(both backends, same row), and stops them after it.  Why on the machine
outside the namespaces, not one per namespace host: network namespaces do
not partition the CPU (every process, in a namespace or not, competes for
the same cores under one scheduler), so where the loop runs changes nothing
but the plumbing; a data loader belongs to the job, not to one of the four
emulated hosts (with N=1 one host would be singled out); and a host process
needs no testbed session.  Each is a pure-Python tight loop (no imports:
it starts in milliseconds and holds a core at 100% without touching memory
bandwidth), at the same priority as the bench's workers.

The summary turns rows into the bench's JSON keys, ratios and targets
(issue #21): CPU per step and per all-reduce as a ratio to gloo's, and the
step-time ratios idle and busy.
"""

from __future__ import annotations

import subprocess
import sys
from types import TracebackType
from typing import Any

_LOOP = "x = 0\nwhile True:\n    x += 1\n"

TARGET_GN_10_VS_0 = 1.2
TARGET_GLOO_VS_GN_5 = 5.0
TARGET_GLOO_VS_GN_0 = 1 / 1.3  # gossipnet's 0% step <= 1.3x gloo's
TARGET_CPU_VS_GLOO_0 = 2.5
TARGET_GLOO_VS_GN_5_BUSY = 3.0


class Busy:
    """N busy-loop processes for the duration of a ``with`` block (N = 0: none)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Busy:
        for _ in range(self.n):
            self._procs.append(subprocess.Popen([sys.executable, "-c", _LOOP]))
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.wait(10)
        self._procs.clear()


def ratio(num: dict[str, Any], den: dict[str, Any]) -> tuple[float, bool]:
    """``num / den`` seconds and whether it is only a lower bound (``num`` timed out)."""
    return num["s"] / den["s"], bool(num["timed_out"])


def cpu_ratio(row: dict[str, Any], op: str) -> float | None:
    """gossipnet's CPU seconds per ``op`` / gloo's, None where gloo timed out."""
    gn, gl = row[f"gossipnet_{op}"].get("cpu_s"), row[f"gloo_{op}"].get("cpu_s")
    return gn / gl if gn is not None and gl else None


def find(
    rows: list[dict[str, Any]], loss: float, cap: float | None, busy: int = 0
) -> dict[str, Any] | None:
    for r in rows:
        same = abs(r["loss"] - loss) < 1e-9 and r["cap_mbit"] == cap
        if same and r.get("busy", 0) == busy:
            return r
    return None


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def summary(rows: list[dict[str, Any]], cap_mbit: float, busy: int) -> dict[str, Any]:
    """The JSON's headline keys (see the bench's doc) and ``targets_met``."""
    out: dict[str, Any] = {"lower_bounds": []}
    kinds = [(None, "", 0), (cap_mbit, "_capped", 0)] + ([(None, "_busy", busy)] if busy else [])
    for cap, suffix, n in kinds:
        r0, r5, r10 = (find(rows, x, cap, n) for x in (0.0, 0.05, 0.1))
        for op, tag in (("step", ""), ("allreduce", "_allreduce")):
            for pct, r in (("5pct", r5), ("0pct", r0)):
                if r is None:
                    continue
                key = f"gloo_vs_gossipnet_{pct}{tag}{suffix}"
                val, lb = ratio(r[f"gloo_{op}"], r[f"gossipnet_{op}"])
                out[key] = round(val, 3)
                if lb:
                    out["lower_bounds"].append(key)
                out[f"cpu_vs_gloo_{pct}{tag}{suffix}"] = _rounded(cpu_ratio(r, op))
            if r0 and r10:
                val = r10[f"gossipnet_{op}"]["s"] / r0[f"gossipnet_{op}"]["s"]
                out[f"gossipnet_10pct_vs_0pct{tag}{suffix}"] = round(val, 3)
    out["targets_met"] = targets(out)
    return out


def targets(out: dict[str, Any]) -> dict[str, bool]:
    """Issue #21's targets that this bench measures, each met or not (missing: not)."""

    def at_most(key: str, bound: float) -> tuple[str, bool]:
        v = out.get(key)
        return f"{key} <= {bound:g}", v is not None and v <= bound

    def at_least(key: str, bound: float) -> tuple[str, bool]:
        v = out.get(key)
        return f"{key} >= {bound:.3g}", v is not None and v >= bound

    return dict(
        (
            at_most("cpu_vs_gloo_0pct", TARGET_CPU_VS_GLOO_0),
            at_least("gloo_vs_gossipnet_0pct", TARGET_GLOO_VS_GN_0),
            at_least("gloo_vs_gossipnet_5pct", TARGET_GLOO_VS_GN_5),
            at_least("gloo_vs_gossipnet_5pct_busy", TARGET_GLOO_VS_GN_5_BUSY),
            at_most("gossipnet_10pct_vs_0pct", TARGET_GN_10_VS_0),
        )
    )
