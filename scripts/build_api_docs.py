"""Build the API reference (HTML, from the docstrings) with pdoc; exit 1 on any problem.

Usage: ``python scripts/build_api_docs.py [OUTPUT_DIR]`` (default ``build/api``, git-ignored);
``make docs`` runs it and ``make test`` (what CI runs) too, so a module that no longer
imports, or a docstring pdoc warns about, fails CI. Open ``build/api/index.html``.

What it covers: the ``gossipnet`` package and every public module below it
(``gossipnet.transport``, ``runtime``, ``collectives``, ``training``, ``mobility``,
``testing``, ``testbed``, ``demo``, ``cli`` and all their submodules). Private modules,
any dotted part of whose name starts with ``_`` (``gossipnet._core``,
``gossipnet.runtime._node_io``), are left out: they are internals, documented in their
source and in docs/INTERNALS.md. pdoc itself would render them when it walks a package,
and would skip the submodules that a package's ``__all__`` does not name (``__all__``
lists the names a package re-exports, not its submodules): :func:`module_specs` gives
it the exact list.

Why a script and not the ``pdoc`` command: pdoc reports problems as Python warnings
and still exits 0; here every warning fails the build, except one kind: pdoc cannot
evaluate some postponed annotations (a class re-exported from another module, a
``NamedTuple``'s constructor) and warns "Error parsing type annotation". Those are
printed as written in the page, nothing is lost, and mypy checks every annotation.
Docstrings are Google style (Args/Returns/Raises) with reST inline markup.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gossipnet"
TOLERATED = ("Error parsing type annotation",)


def _is_public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def _walked_by_pdoc(name: str) -> set[str]:
    """``name`` and the submodules pdoc's walk adds with it: a package's ``__all__``, if
    it has one, lets through only the submodules it names."""
    module = importlib.import_module(name)
    found = {name}
    exported = getattr(module, "__all__", None)
    for child in pkgutil.iter_modules(getattr(module, "__path__", []), f"{name}."):
        if exported is None or child.name.rpartition(".")[2] in exported:
            found |= _walked_by_pdoc(child.name)
    return found


def _resolve_lazy_exports(name: str) -> None:
    """Resolve the names a module exports lazily (a module ``__getattr__``, as
    ``gossipnet.distributed`` does to keep ``import gossipnet`` cheap): pdoc reads a
    module's ``__dict__``, and such a name is there only once it has been asked for."""
    module = importlib.import_module(name)
    for export in getattr(module, "__all__", ()):
        getattr(module, export, None)


def module_specs() -> list[str]:
    """pdoc's module specs: every public module once, private ones excluded.

    Each public module not reached from an earlier spec becomes a spec of its own (so
    no page is added twice, which pdoc warns about); the last spec drops every module
    with a private part, which pdoc's walk would otherwise render.
    """
    sys.path.insert(0, str(ROOT))
    package = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    names += [m.name for m in pkgutil.walk_packages(package.__path__, f"{PACKAGE}.")]
    specs: list[str] = []
    reached: set[str] = set()
    for name in sorted(filter(_is_public, names)):
        _resolve_lazy_exports(name)
        if name not in reached:
            specs.append(name)
            reached |= _walked_by_pdoc(name)
    return [*specs, r"!.*\._"]


def build(out: Path) -> int:
    """Render every public module into ``out``; returns the exit status (0 = clean)."""
    import pdoc
    import pdoc.render

    t0 = time.monotonic()
    pdoc.render.configure(docformat="google", footer_text=f"{PACKAGE} API reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pdoc.pdoc(*module_specs(), output_directory=out)
        except Exception as err:  # an import error, a broken docstring: report, fail
            print(f"build_api_docs: pdoc failed: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
    problems = sorted({str(w.message) for w in caught if not str(w.message).startswith(TOLERATED)})
    for text in problems:
        print(f"build_api_docs: warning: {text}", file=sys.stderr)
    pages = len(list(out.rglob("*.html")))
    print(f"API reference: {out}/index.html ({pages} pages, {time.monotonic() - t0:.1f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "api"))
