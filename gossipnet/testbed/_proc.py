"""Processes inside testbed hosts: commands and Python calls, each with a deadline.

Why a process group per child (``start_new_session``): ``ip netns exec`` execs
the command, which may fork (a shell, torch's workers); killing the group
reaches all of them, and teardown must leave no process behind.  Why files for
output, not pipes: a chatty child can never block on a full pipe that nobody
reads, and the logs survive for the error message after the child is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gossipnet.testbed._runner import from_json, to_json
from gossipnet.testbed._sys import TestbedError, netns_exec

__all__ = ("RUNNER", "HostProcess", "PyTask", "WorkerError")

#: The child entry point, run by path (see ``_runner.py`` for why).
RUNNER = str(Path(__file__).with_name("_runner.py"))
_TAIL_CHARS = 3000


class WorkerError(TestbedError):
    """A Python call inside a host raised; the message holds its traceback."""


def _tail(path: Path, chars: int = _TAIL_CHARS) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]


class HostProcess:
    """One command running in a host's namespace, in its own process group.

    Args:
        ns: the network namespace.
        argv: the command (no shell).
        log_dir: where ``<label>.out`` and ``<label>.err`` go.
        label: file name stem and name in messages.
        env: the child's complete environment.
    """

    def __init__(
        self,
        ns: str,
        argv: Sequence[str],
        *,
        log_dir: Path,
        label: str,
        env: Mapping[str, str],
    ) -> None:
        self.label = label
        self.argv = list(argv)
        self.stdout_path = log_dir / f"{label}.out"
        self.stderr_path = log_dir / f"{label}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self._popen = subprocess.Popen(
                netns_exec(ns, self.argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=dict(env),
                start_new_session=True,
            )
        self.pid = self._popen.pid

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        return self._popen.poll()

    def wait(self, timeout_s: float) -> int:
        """Wait for the exit status; on the deadline kill the group and raise.

        Raises:
            TimeoutError: still running after ``timeout_s`` (it is killed first).
        """
        try:
            return self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(
                f"{self.label} still running after {timeout_s:.1f} s; killed.\n"
                f"stderr tail:\n{self.stderr()}"
            ) from None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole process group (no error if it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def kill(self, grace_s: float = 0.0) -> None:
        """SIGTERM (when ``grace_s`` > 0) then SIGKILL the group; reap the child."""
        if grace_s > 0 and self._popen.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=grace_s)
        # even after the leader exited, its group may hold forked children
        self.signal(signal.SIGKILL)
        try:
            self._popen.wait(timeout=10.0)
        except subprocess.TimeoutExpired as err:  # pragma: no cover - kernel stuck
            raise TestbedError(f"{self.label} (pid {self.pid}) survived SIGKILL") from err

    def stdout(self) -> str:
        """The child's standard output so far."""
        return _tail(self.stdout_path, 10**9)

    def stderr(self, chars: int = _TAIL_CHARS) -> str:
        """The last ``chars`` characters of the child's standard error."""
        return _tail(self.stderr_path, chars)


class PyTask(HostProcess):
    """``fn(*args, **kwargs)`` running in a host; :meth:`result` returns its value.

    ``fn`` must be importable by module and qualified name (or, with
    ``standalone``, its module file must load on its own); arguments and the
    result travel as JSON (``_runner.to_json``: plain values, tuples, bytes and
    dataclasses importable by name), never pickled: the testbed runs as root.
    """

    def __init__(
        self,
        ns: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        log_dir: Path,
        label: str,
        env: Mapping[str, str],
        standalone: bool = False,
    ) -> None:
        module = sys.modules.get(fn.__module__)
        spec = {
            "module": fn.__module__,
            "qualname": fn.__qualname__,
            "file": getattr(module, "__file__", None),
            "standalone": standalone,
            "sys_path": [p for p in sys.path if p],
            "args": to_json(list(args)),
            "kwargs": to_json(dict(kwargs)),
        }
        if (standalone or fn.__module__ == "__main__") and not spec["file"]:
            raise ValueError(f"{fn.__qualname__}: its module has no file to load in the host")
        self.spec_path = log_dir / f"{label}.spec.json"
        self.result_path = log_dir / f"{label}.result.json"
        self.spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, RUNNER, str(self.spec_path), str(self.result_path)]
        super().__init__(ns, argv, log_dir=log_dir, label=label, env=env)

    def done(self) -> bool:
        """True once the call returned or raised (its result file exists)."""
        return self.result_path.exists() or self.poll() is not None

    def result(self, timeout_s: float) -> Any:
        """The call's return value, waiting at most ``timeout_s``.

        Raises:
            TimeoutError: not finished in time (the process group is killed).
            WorkerError: the call raised, or the process died without a result.
        """
        deadline = time.monotonic() + timeout_s
        code = self.wait(max(0.0, deadline - time.monotonic()))
        try:
            with open(self.result_path) as f:
                outcome = json.load(f)
            status, value = outcome["status"], from_json(outcome["value"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise WorkerError(
                f"{self.label} exited {code} without a result.\nstderr tail:\n{self.stderr()}"
            ) from err
        if status != "ok":
            raise WorkerError(f"{self.label} raised:\n{value}\nstderr tail:\n{self.stderr()}")
        return value
