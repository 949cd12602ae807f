"""SIGTERM: announce the departure, leave within a second, then die as SIGTERM would.

Preemptible clouds (and ``torchrun`` stopping a job) send SIGTERM and, a
grace period later, SIGKILL.  A peer that just dies is noticed only after
``failure_timeout_s``, and until then its groups wait for it; a peer that
says LEAVE first is dropped from every view at once.  So on SIGTERM every
open peer of the process sends LEAVE (all at once, in helper threads, at
most ~1 s), and then the process ends the way it would have without us:
the previous handler runs, or, if that was the default, SIGTERM is
re-raised with the default action (exit status says "killed by SIGTERM",
which is what ``torchrun`` and schedulers expect).

Installed only when asked (``join(..., handle_sigterm=True)``) and only from
the main thread (Python delivers signals there; ``signal.signal`` raises
elsewhere).  Peers are held weakly, so a forgotten peer is not kept alive.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Any, Protocol

__all__ = ("LEAVE_BUDGET_S", "install", "installed", "uninstall")

log = logging.getLogger(__name__)

#: how long SIGTERM may spend announcing departures before the process goes on dying
LEAVE_BUDGET_S = 0.9


class _Leaver(Protocol):
    @property
    def peer_id(self) -> str: ...

    def close(self, *, announce: bool = ...) -> None: ...


_peers: weakref.WeakSet[Any] = weakref.WeakSet()
_previous: Any = None
_installed = False
_lock = threading.Lock()


def installed() -> bool:
    return _installed


def install(peer: _Leaver) -> bool:
    """Leave ``peer`` on SIGTERM; False (nothing installed) off the main thread."""
    global _installed, _previous
    if threading.current_thread() is not threading.main_thread():
        log.debug("peer %s: SIGTERM handler not installed (not the main thread)", peer.peer_id)
        return False
    with _lock:
        _peers.add(peer)
        if not _installed:
            _previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _on_sigterm)
            _installed = True
    return True


def uninstall() -> None:
    """Restore the handler that was there before :func:`install` (tests, embedding)."""
    global _installed, _previous
    with _lock:
        if _installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
            _installed, _previous = False, None
        _peers.clear()


def _leave_all(budget_s: float) -> None:
    """Close every open peer with an announced departure, in parallel, within ``budget_s``."""
    peers = [p for p in list(_peers) if not getattr(p, "_closed", False)]
    threads = [
        threading.Thread(target=_leave, args=(p,), name=f"gossipnet-leave-{p.peer_id}", daemon=True)
        for p in peers
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + budget_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _leave(peer: _Leaver) -> None:
    try:
        peer.close(announce=True)
    except Exception:
        log.exception("peer %s: leaving on SIGTERM failed", peer.peer_id)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    log.warning("SIGTERM: leaving %d peer(s) and exiting", len(_peers))
    _leave_all(LEAVE_BUDGET_S)
    previous = _previous
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
