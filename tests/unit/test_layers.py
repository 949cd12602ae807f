"""The package's layers import only downward, and no modules import each other in a circle.

Why a test: layers that may only import downward are what let a newcomer read
the code bottom up (values, transport, runtime, collectives, training, facade)
and test each layer alone; one upward import, even under ``TYPE_CHECKING``,
couples them again.  The check is an AST walk of every module under
``gossipnet/`` (no import is executed, so imports inside functions and
``TYPE_CHECKING`` blocks count like the others; relative imports are resolved).

An edge goes to the module an import names: ``from gossipnet.a import b`` points
at ``gossipnet.a.b`` when that is a module, otherwise at ``gossipnet.a`` (a
package ``__init__`` is a module like any other).  Parent packages that Python
also runs are not edges, or every module would depend on ``gossipnet/__init__``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import gossipnet

PACKAGE_DIR = Path(gossipnet.__file__).resolve().parent
PACKAGE = PACKAGE_DIR.name

#: Layers, low to high: a module may import its own layer and the ones below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("values", ("errors", "config", "clock", "reports")),
    ("transport", ("transport",)),
    ("runtime", ("runtime",)),
    ("mobility", ("mobility",)),
    ("collectives", ("collectives",)),
    ("training", ("training",)),
    ("facade", ("", "peer", "_core", "_collective", "_training_host", "_join", "_step_resync")),
    ("top", ("cli", "demo", "testbed", "testing", "distributed")),
)
#: Upward edges allowed by name, each with its reason.  ``import gossipnet`` registers
#: the torch.distributed backend (issue #23: scripts only say ``init_process_group(
#: "gossipnet")``); the package ``gossipnet.distributed`` imports nothing of gossipnet at
#: import time and its process group (a top-layer user of ``join()``) only when torch
#: calls the creator; test_registering_the_backend_stays_cheap pins that.
UPWARD_ALLOWED = frozenset({("gossipnet", "gossipnet.distributed")})
#: Layers that may import only from these (mobility is pure maths over values).
ONLY_FROM = {"mobility": frozenset({"values", "mobility"})}


@dataclass(frozen=True, slots=True)
class Import:
    """One edge: ``src`` imports ``dst`` at ``path:line`` by the statement ``text``."""

    src: str
    dst: str
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.src} -> {self.dst} ({self.text})"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``), for every module of the package."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The innermost module of the package that ``name`` lies in, or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            inside = alias.name == PACKAGE or alias.name.startswith(PACKAGE + ".")
            if inside and (dst := _resolve(alias.name)) is not None:
                yield dst
        return
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        full = ".".join([*base, node.module] if node.module else base)
    else:
        full = node.module or ""
    if full != PACKAGE and not full.startswith(PACKAGE + "."):
        return
    for alias in node.names:
        sub = f"{full}.{alias.name}"
        dst = sub if sub in MODULES else _resolve(full)
        if dst is not None:
            yield dst


def _imports() -> list[Import]:
    edges = []
    for module, (path, is_pkg) in MODULES.items():
        source = path.read_text()
        rel = str(path.relative_to(PACKAGE_DIR.parent))
        for node in ast.walk(ast.parse(source, filename=rel)):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            text = " ".join((ast.get_source_segment(source, node) or "").split())
            for dst in set(_targets(node, module, is_pkg)):
                if dst != module:
                    edges.append(Import(module, dst, rel, node.lineno, text))
    return sorted(edges, key=lambda e: (e.path, e.line, e.dst))


IMPORTS = _imports()


def _layer(module: str) -> tuple[int, str] | None:
    rest = module.removeprefix(PACKAGE).removeprefix(".")
    head = rest.split(".", 1)[0]
    for rank, (name, heads) in enumerate(LAYERS):
        if head in heads:
            return rank, name
    return None


def _cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {m: [] for m in MODULES}
    for e in edges:
        graph[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def test_the_walk_sees_every_kind_of_import() -> None:
    """Guards the checker itself: relative, TYPE_CHECKING and package imports resolve."""
    assert len(MODULES) > 100
    pairs = {(e.src, e.dst) for e in IMPORTS}
    assert ("gossipnet", "gossipnet.peer") in pairs  # a package __init__ is a module
    assert ("gossipnet.transport.factory", "gossipnet.transport.memory") in pairs  # TYPE_CHECKING
    assert (
        "gossipnet.transport.factory",
        "gossipnet.transport.zeromq.backend",
    ) in pairs  # inside a function

    def relative(code: str, module: str, is_pkg: bool = False) -> list[str]:
        node = ast.parse(code).body[0]
        assert isinstance(node, ast.ImportFrom)
        return list(_targets(node, module, is_pkg))

    assert relative("from ..clock import FakeClock", "gossipnet.transport.memory") == [
        "gossipnet.clock"
    ]
    assert relative("from . import memory", "gossipnet.transport", is_pkg=True) == [
        "gossipnet.transport.memory"
    ]


def test_every_module_has_a_layer() -> None:
    lost = sorted(m for m in MODULES if _layer(m) is None)
    assert not lost, f"modules outside every layer (add them to LAYERS): {lost}"


def test_no_import_circle() -> None:
    cycles = _cycles(IMPORTS)
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append(f"circle of {len(comp)}: {', '.join(comp)}")
        lines += [f"    {e}" for e in IMPORTS if e.src in members and e.dst in members]
    assert not cycles, "import circles among gossipnet's modules:\n" + "\n".join(lines)


def test_imports_only_go_down_the_layers() -> None:
    bad = []
    for e in IMPORTS:
        src, dst = _layer(e.src), _layer(e.dst)
        if src is None or dst is None:
            continue  # reported by test_every_module_has_a_layer
        allowed = ONLY_FROM.get(src[1])
        if (e.src, e.dst) in UPWARD_ALLOWED:
            continue
        if dst[0] > src[0] or (allowed is not None and dst[1] not in allowed):
            bad.append(f"{e}  [{src[1]} must not import {dst[1]}]")
    assert not bad, f"{len(bad)} imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["gossipnet", "gossipnet.testing", "gossipnet.transport"])
def test_importing_starts_no_socket_backend(module: str) -> None:
    """``import gossipnet`` stays lazy: ZeroMQ loads only when a zmq transport is made."""
    code = (
        "import sys, threading\n"
        f"import {module}\n"
        "assert 'zmq' not in sys.modules, 'zmq imported'\n"
        "assert threading.active_count() == 1, 'a thread started at import'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}  # this checkout, not another
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr


def test_registering_the_backend_stays_cheap() -> None:
    """``import gossipnet`` registers the torch backend without importing its machinery.

    Why: the registration runs in every process that imports gossipnet; only
    ``init_process_group("gossipnet")`` may load the process group and its rendezvous.
    """
    code = (
        "import sys\n"
        "import torch, torch.distributed as dist\n"
        "before = set(sys.modules)\n"
        "import gossipnet\n"
        "assert 'GOSSIPNET' in dist.Backend._plugins, 'backend not registered'\n"
        "assert dist.Backend.default_device_backend_map['cpu'] == 'gloo', 'cpu default moved'\n"
        "lazy = [m for m in ('process_group', 'rendezvous', 'exchange')"
        " if 'gossipnet.distributed.' + m in sys.modules]\n"
        "assert not lazy, lazy\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before} - {'gossipnet'}\n"
        "assert 'torch' not in new, new\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
