"""Every protocol owns a range of packet kinds next to its code; no two overlap.

Why: a node dispatches by kind alone, so two protocols sharing a number would each
see the other's packets as malformed input (counted drops at best).  The ranges are
found by walking the package, so a new protocol's ``kinds`` module is checked too.
"""

from __future__ import annotations

import importlib
import pkgutil
from enum import IntEnum

import gossipnet

WIRE_KIND_MAX = 0xFFFF


def _kinds_modules() -> dict[str, object]:
    found = {}
    for info in pkgutil.walk_packages(gossipnet.__path__, "gossipnet."):
        if info.name.rpartition(".")[2] == "kinds":
            found[info.name] = importlib.import_module(info.name)
    return found


def test_each_protocol_owns_a_disjoint_range_and_stays_inside_it() -> None:
    mods = _kinds_modules()
    assert {"gossipnet.runtime.kinds", "gossipnet.collectives.lossy.kinds"} <= set(mods)
    taken: dict[int, str] = {}
    for name, mod in mods.items():
        rng = mod.KIND_RANGE  # type: ignore[attr-defined]
        assert isinstance(rng, range)
        assert rng.step == 1
        assert 0 < rng.start < rng.stop <= WIRE_KIND_MAX + 1, name
        for k in rng:
            assert k not in taken, f"kind {k}: {name} and {taken[k]}"
            taken[k] = name
        enums = [
            v
            for v in vars(mod).values()
            if isinstance(v, type) and issubclass(v, IntEnum) and v is not IntEnum
        ]
        assert len(enums) == 1, name
        assert all(int(k) in rng for k in enums[0]), f"{name}: a kind outside {rng}"


def test_node_control_kinds_are_the_urgent_ones() -> None:
    from gossipnet.runtime.kinds import KIND_RANGE, NodeKind

    assert KIND_RANGE.start == 1
    assert all(k < KIND_RANGE.stop for k in NodeKind)
