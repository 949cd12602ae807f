"""Teardown that happens however the run ends: names, exit hooks, stale leftovers.

Three lines of defence, because a namespace outlives the process that made it
(it is a mount under ``/run/netns``) and keeps its veths and bridge alive:

1. ``with Testbed(...)``: normal exit and exceptions (KeyboardInterrupt too).
2. ``atexit`` plus a SIGTERM/SIGHUP handler that turns the signal into
   ``SystemExit``, so the ``with`` blocks unwind and the exit hook runs
   (installed only where the signal still has its default action, and only
   from the main thread: we never replace someone else's handler).
3. :func:`cleanup_stale`: SIGKILL cannot be caught, so every namespace name
   carries its creator's pid (``gntb<pid>x<seq>-<role>``) and a later run
   removes the leftovers of pids that are gone.  It runs on every ``up()``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from gossipnet.testbed._sys import TestbedError, list_netns, pid_alive, run

__all__ = (
    "NAME_RE",
    "cleanup_stale",
    "kill_netns_processes",
    "netns_inode",
    "processes_in",
    "register",
    "unregister",
)

log = logging.getLogger(__name__)

#: Prefix of every namespace and run directory the testbed creates.
PREFIX = "gntb"
#: ``gntb<pid>x<seq>-<role>``: the creator's pid makes leftovers attributable.
NAME_RE = re.compile(rf"^{PREFIX}(\d+)x(\d+)-")
_KILL_WAIT_S = 5.0


class _Closable(Protocol):
    name: str

    def down(self) -> Any: ...


_live: dict[str, _Closable] = {}
_lock = threading.Lock()
_hooks_installed = False


def _teardown_all() -> None:
    for tb in list(_live.values()):
        try:
            tb.down()
        except Exception:
            log.exception("testbed %s: teardown at exit failed", tb.name)


def _on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_teardown_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _on_signal)


def register(tb: _Closable) -> None:
    """Track ``tb`` so that exit hooks tear it down if its owner does not."""
    with _lock:
        _install_hooks()
        _live[tb.name] = tb


def unregister(tb: _Closable) -> None:
    with _lock:
        _live.pop(tb.name, None)


def netns_inode(ns: str) -> int | None:
    """Inode of namespace ``ns`` (what ``/proc/<pid>/ns/net`` links to), None if absent."""
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return None


def processes_in(inodes: set[int], tag: str | None = None) -> list[int]:
    """Pids living in one of the network namespaces ``inodes``, or carrying ``GNTB_TAG=tag``.

    Why both: the namespace test finds any process, however it was started;
    the environment tag also finds one that moved itself out of the namespace.
    """
    found = []
    marker = f"GNTB_TAG={tag}".encode() if tag else None
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            link = os.readlink(f"/proc/{entry}/ns/net")
            inode = int(link[link.index("[") + 1 : -1])
        except (OSError, ValueError):
            continue
        hit = inode in inodes
        if not hit and marker is not None:
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                hit = marker in f.read().split(b"\0")
        if hit and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def kill_netns_processes(ns: str) -> list[int]:
    """SIGKILL every process in namespace ``ns`` and wait (bounded) until they are gone."""
    inode = netns_inode(ns)
    if inode is None:
        return []
    pids = processes_in({inode})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _KILL_WAIT_S
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise TestbedError(f"processes {pids} in {ns} survived SIGKILL for {_KILL_WAIT_S} s")
        time.sleep(0.01)
    return pids


def _stale_owner(name: str, alive: Callable[[int], bool]) -> int | None:
    m = NAME_RE.match(name)
    if m is None:
        return None
    pid = int(m.group(1))
    return None if alive(pid) else pid


def cleanup_stale(*, alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """Remove namespaces and run directories left by testbed owners that died.

    A namespace is stale when the pid in its name no longer exists (a reused
    pid keeps its leftovers until that process ends too: safe, never wrong).
    Its processes are killed first, as ``ip netns del`` alone would leave them
    running in a namespace nobody can name.

    Returns:
        The namespaces removed.
    """
    removed = []
    for ns in list_netns():
        if _stale_owner(ns, alive) is None:
            continue
        kill_netns_processes(ns)
        run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    tmp = Path(tempfile.gettempdir())
    for path in tmp.glob(f"{PREFIX}*x*-run*"):
        if _stale_owner(path.name, alive) is not None and _ours(path):
            shutil.rmtree(path, ignore_errors=True)
    if removed:
        log.warning("removed %d stale testbed namespace(s): %s", len(removed), removed)
    return removed


def _ours(path: Path) -> bool:
    """A real directory (not a link) owned by us: only such run directories are removed."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
