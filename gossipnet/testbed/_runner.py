"""Child entry point: run one pickled Python call inside a testbed host.

    python /path/to/_runner.py SPEC.pkl RESULT.pkl

Run by *path*, not with ``-m``: ``-m gossipnet.testbed._runner`` would import the
``gossipnet`` package and with it torch (seconds of start-up), which a loss probe
made of ``socket`` calls does not need.  The spec names the function by module
and qualified name; ``standalone`` specs load the module's file directly under a
private name instead of importing its package (for stdlib-only helpers such as
``_probe.py``, and for functions defined in a script's ``__main__``).

The result file holds ``("ok", value)`` or ``("error", traceback text)``; it is
written to a temporary name and renamed, so the parent never reads half a file.
Then the process leaves with ``os._exit``: a worker that timed out a gloo
collective holds C++ threads whose destructors may block, and the parent has
everything it needs by then.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
import traceback
from typing import Any


def _load(spec: dict[str, Any]) -> Any:
    if spec["standalone"] or spec["module"] == "__main__":
        name = "_gntb_" + os.path.splitext(os.path.basename(spec["file"]))[0]
        mspec = importlib.util.spec_from_file_location(name, spec["file"])
        if mspec is None or mspec.loader is None:
            raise ImportError(f"cannot load {spec['file']}")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module
        mspec.loader.exec_module(module)
    else:
        module = importlib.import_module(spec["module"])
    obj: Any = module
    for part in spec["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str]) -> int:
    spec_path, result_path = argv[1], argv[2]
    status = 1
    try:
        with open(spec_path, "rb") as f:
            spec = pickle.load(f)
        for entry in reversed(spec["sys_path"]):
            if entry not in sys.path:
                sys.path.insert(1, entry)
        fn = _load(spec)
        args, kwargs = pickle.loads(spec["payload"])
        outcome: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        status = 0
    except BaseException:
        outcome = ("error", traceback.format_exc())
    tmp = result_path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(outcome, f)
    except Exception:  # an unpicklable result: say so instead
        with open(tmp, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        status = 1
    os.replace(tmp, result_path)
    return status


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
