"""Same-host shortcut: reach a loopback ``tcp://`` peer over a Unix socket instead.

Why: between processes on one host the kernel's TCP stack is overhead:
segmentation, ACKs and the loopback device cost a third of the system time
of a 25M float32 all-reduce across four processes (``bench/allreduce_cpu.py``:
0.23-0.24 s per call over TCP, 0.20-0.21 s over Unix sockets).  A peer keeps
its ``tcp://127.0.0.1:<port>`` address as its identity; its PULL socket also
binds an *alias*, a Unix socket whose path is derived from that port, and a
sender dialing ``127.0.0.1`` connects to the alias when one answers.  A peer
bound to another host gets none; one bound to the IPv4 wildcard gets one.

Why the path holds the network namespace: a filesystem path is shared across
network namespaces, ``127.0.0.1:<port>`` is not (the testbed runs peers in
namespaces of their own).  Why a private directory (``<tmp>/gossipnet-<uid>``,
mode 0700, checked to be ours and not a link): only this user can bind an
alias there, so no other local user can take over a peer's traffic by
binding its name first.  Why the sender probes the alias before using it: a
peer killed with SIGKILL leaves its socket file behind, and the port may since
belong to a peer that binds none; a stale file refuses the probe and the
sender uses TCP.

Anything unusual (no ``/proc``, a directory we do not own, a path longer than
a Unix socket allows) disables the shortcut: TCP still works.  A directory of
that name that is not ours alone (another user created it first, or made it a
link, or opened its mode) is logged once as a WARNING that says what to do:
otherwise same-host traffic would quietly take the slower path (issue 19).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import tempfile

__all__ = ("ALIASED_HOST", "alias_path", "live_alias", "stream_path")

#: The one host whose ports get aliases.  Why only it: an alias is named by port
#: alone, and a 127.0.0.1 bind excludes a wildcard IPv4 bind of the same port, so
#: names cannot collide; 127.0.0.2 or ``[::1]`` on the same port could.
ALIASED_HOST = "127.0.0.1"

#: sun_path holds 108 bytes with its terminating NUL on Linux.
_MAX_PATH = 107

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _netns() -> int | None:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None


def _private_dir() -> str | None:
    """``<tmp>/gossipnet-<uid>``, created 0700; None unless it is ours alone."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None
    uid = getuid()
    path = os.path.join(tempfile.gettempdir(), f"gossipnet-{uid}")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        if path not in _warned:  # once per process: every dial asks again
            _warned.add(path)
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory (a link?)"
            log.warning(
                "same-host Unix-socket path off, peers on this host talk over TCP: %s is "
                "%s owned by uid %d with mode %o, not a private directory of uid %d. "
                "Remove it (its owner or root can) or point TMPDIR at a directory of "
                "your own, then restart the peers",
                path, what, st.st_uid, st.st_mode & 0o777, uid,
            )  # fmt: skip
        return None
    return path


def alias_path(port: int | str) -> str | None:
    """The Unix socket path of ``tcp://127.0.0.1:<port>`` in this network namespace.

    None where the shortcut is unavailable (see the module docstring).
    """
    netns = _netns()
    directory = _private_dir() if netns is not None else None
    if directory is None:
        return None
    path = os.path.join(directory, f"{netns}-{port}.ipc")
    return path if len(path.encode()) <= _MAX_PATH else None


def stream_path(port: int | str) -> str | None:
    """The path of ``127.0.0.1:<port>``'s loop-served stream socket (``local_stream.py``).

    Beside the alias, in the same private directory; None where the alias is.
    """
    path = alias_path(port)
    if path is None:
        return None
    path = path[: -len(".ipc")] + ".sock"
    return path if len(path.encode()) <= _MAX_PATH else None


def live_alias(port: int | str) -> str | None:
    """The alias path of the ``127.0.0.1`` peer on ``port`` if a listener answers there.

    The probe is one non-blocking ``connect`` on a Unix socket: a stale file
    refuses it at once, a live listener accepts it (or, with its backlog full,
    answers ``EAGAIN``, which is as alive).  The listener sees a connection
    closed before any greeting, which ZeroMQ discards.
    """
    path = alias_path(port)
    if path is None:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except BlockingIOError:
            return path
        except OSError:
            return None
    return path
