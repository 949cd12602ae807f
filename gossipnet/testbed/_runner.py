"""Child entry point: run one Python call, described in JSON, inside a testbed host.

    python /path/to/_runner.py SPEC.json RESULT.json

Run by *path*, not with ``-m``: ``-m gossipnet.testbed._runner`` would import the
``gossipnet`` package and with it torch (seconds of start-up), which a loss probe
made of ``socket`` calls does not need.  The spec names the function by module
and qualified name; ``standalone`` specs load the module's file directly under a
private name instead of importing its package (for stdlib-only helpers such as
``_probe.py``, and for functions defined in a script's ``__main__``).

The result file holds ``{"status": "ok", "value": ...}`` or ``{"status":
"error", "value": traceback text}``; it is written to a temporary name and
renamed, so the parent never reads half a file.

Why JSON and not pickle: the testbed runs as root and these files lie in a run
directory; loading a pickle runs whatever code it names, so a file swapped in
there by another local user ran code as root (issue 19).  JSON carries plain
values; tuples, bytes and dataclasses (``TrainSpec``) travel tagged
(:func:`to_json`, :func:`from_json`), and the run directory is private anyway.
Then the process leaves with ``os._exit``: a worker that timed out a gloo
collective holds C++ threads whose destructors may block, and the parent has
everything it needs by then.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import traceback
from typing import Any


def to_json(obj: Any) -> Any:
    """``obj`` as JSON-able values; tuples, bytes and dataclasses tagged.

    Raises:
        TypeError: a value that cannot cross (say which; pass plain values).
    """
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [to_json(x) for x in obj]
    if type(obj) is tuple:
        return {"$tuple": [to_json(x) for x in obj]}
    if type(obj) is bytes:
        return {"$bytes": obj.hex()}
    if type(obj) is dict and all(type(k) is str and not k.startswith("$") for k in obj):
        return {k: to_json(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        fields = {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"$dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise TypeError(
        f"a {type(obj).__name__} cannot cross into a testbed host; pass plain values "
        "(None, bool, int, float, str, bytes, lists, tuples, str-keyed dicts, dataclasses)"
    )


def from_json(obj: Any) -> Any:
    """The inverse of :func:`to_json`."""
    if type(obj) is list:
        return [from_json(x) for x in obj]
    if type(obj) is not dict:
        return obj
    if "$tuple" in obj:
        return tuple(from_json(x) for x in obj["$tuple"])
    if "$bytes" in obj:
        return bytes.fromhex(obj["$bytes"])
    if "$dataclass" in obj:
        module, _, qualname = str(obj["$dataclass"]).partition(":")
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"{obj['$dataclass']} is not a dataclass")
        return cls(**{k: from_json(v) for k, v in obj["fields"].items()})
    return {k: from_json(v) for k, v in obj.items()}


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
        with open(spec_path) as f:
            spec = json.load(f)
        for entry in reversed(spec["sys_path"]):
            if entry not in sys.path:
                sys.path.insert(1, entry)
        fn = _load(spec)
        args, kwargs = from_json(spec["args"]), from_json(spec["kwargs"])
        outcome: dict[str, Any] = {"status": "ok", "value": to_json(fn(*args, **kwargs))}
        status = 0
    except BaseException:
        outcome = {"status": "error", "value": traceback.format_exc()}
        status = 1
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(outcome, f)
    os.replace(tmp, result_path)
    return status


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
