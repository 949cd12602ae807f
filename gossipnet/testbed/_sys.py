"""Running the system tools the testbed drives (``ip``, ``nft``, ``tc``), with deadlines.

Why one module: every command goes through :func:`run` so that each has a
timeout, an argument list (never a shell string), and a failure message that
carries the tool's own stderr.  :func:`unavailable_reason` is the one place that
decides whether this machine can host a testbed, so the CLI, the tests and the
bench skip with the same clear message.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence

from gossipnet.errors import GossipError

__all__ = (
    "COMMAND_TIMEOUT_S",
    "TOOLS",
    "TestbedError",
    "TestbedUnavailable",
    "list_netns",
    "netns_exec",
    "pid_alive",
    "run",
    "unavailable_reason",
)

#: Bound of one ``ip``/``nft``/``tc`` call; they answer in milliseconds, a hang is a bug.
COMMAND_TIMEOUT_S = 15.0
#: tool -> Debian package that provides it (what ``scripts/install-testbed-deps.sh`` installs).
TOOLS = {"ip": "iproute2", "tc": "iproute2", "bridge": "iproute2", "nft": "nftables"}
INSTALL_HINT = "run `sudo scripts/install-testbed-deps.sh` (apt-get install nftables iproute2)"


class TestbedError(GossipError):
    """A testbed command failed; the message holds the command and its stderr."""

    __test__ = False  # not a pytest class


class TestbedUnavailable(TestbedError):
    """This machine cannot host a testbed (not root, tools or netns support missing)."""


def run(
    args: Sequence[str],
    *,
    timeout_s: float = COMMAND_TIMEOUT_S,
    check: bool = True,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` (no shell) and capture its output.

    Raises:
        TestbedError: ``check`` and a non-zero exit, or the command outlived
            ``timeout_s`` (it is killed first).
    """
    try:
        proc = subprocess.run(
            list(args),
            check=False,
            timeout=timeout_s,
            capture_output=True,
            text=True,
            input=input_text,
        )
    except subprocess.TimeoutExpired as err:
        raise TestbedError(f"`{' '.join(args)}` did not finish within {timeout_s} s") from err
    except FileNotFoundError as err:
        raise TestbedUnavailable(f"`{args[0]}` is not installed; {INSTALL_HINT}") from err
    if check and proc.returncode != 0:
        raise TestbedError(
            f"`{' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}"
        )
    return proc


def netns_exec(ns: str, argv: Sequence[str]) -> list[str]:
    """The argument list that runs ``argv`` inside network namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``), ids stripped."""
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@functools.cache
def unavailable_reason() -> str | None:
    """Why no testbed can run here, or None when it can (checked once per process).

    Checks, in order: root (network namespaces, nftables and qdiscs need
    CAP_NET_ADMIN and CAP_SYS_ADMIN), the tools on PATH, and that a namespace
    can really be created and deleted (containers may forbid it).
    """
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, nftables, tc)"
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        return f"missing Debian package(s) {', '.join(missing)}; {INSTALL_HINT}"
    probe = f"gntbprobe{os.getpid()}"
    try:
        run(["ip", "netns", "add", probe])
    except TestbedError as err:
        return f"`ip netns add` does not work here: {err}"
    try:
        nft = run(["ip", "netns", "exec", probe, "nft", "list", "ruleset"], check=False)
        if nft.returncode != 0:
            return f"nftables does not work in a namespace: {nft.stderr.strip()}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return None
