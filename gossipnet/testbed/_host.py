"""A host of a testbed (a network namespace) and what a teardown may leave behind.

Kept apart from :mod:`._net` so the switch/fault logic and the per-host
process plumbing each stay readable on their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gossipnet.testbed._proc import HostProcess, PyTask
from gossipnet.testbed._sys import netns_exec, run

__all__ = ("Host", "HostOwner", "Leftovers")


class HostOwner(Protocol):
    """What a :class:`Host` needs from the testbed that made it.

    Why a Protocol: :class:`~gossipnet.testbed._net.Testbed` builds hosts, so a host
    naming that class would import it back (an import circle); the host only needs
    where logs go, the environment its children get, and somewhere to register
    processes that teardown must kill.
    """

    @property
    def run_dir(self) -> Path:
        """Directory for the children's logs."""
        ...

    def child_env(self, host: Host, extra: Mapping[str, str]) -> dict[str, str]:
        """The environment of a process started in ``host``, with ``extra`` on top."""
        ...

    def track(self, proc: HostProcess) -> None:
        """Remember ``proc`` so that teardown kills it if still running."""
        ...


@dataclass(frozen=True, slots=True)
class Leftovers:
    """What of a testbed still exists; all empty after a clean teardown."""

    namespaces: tuple[str, ...] = ()
    processes: tuple[int, ...] = ()
    interfaces: tuple[str, ...] = ()  # veths/bridge still visible in the switch

    def __bool__(self) -> bool:
        return bool(self.namespaces or self.processes or self.interfaces)


@dataclass(slots=True, eq=False)
class Host:
    """One host of a testbed: a namespace with ``eth0`` at :attr:`ip`."""

    testbed: HostOwner = field(repr=False)
    index: int
    name: str
    ns: str
    ip: str
    mac: str
    port: str  # switch-side interface
    _count: Callable[[], int] = field(
        default_factory=lambda: itertools.count().__next__, repr=False
    )

    def url(self, port: int, scheme: str = "udp") -> str:
        """``scheme://<ip>:<port>``, e.g. a gossipnet listen address."""
        return f"{scheme}://{self.ip}:{port}"

    def run(self, argv: Sequence[str], *, timeout_s: float = 15.0, check: bool = True) -> Any:
        """Run a short command in this host and return its ``CompletedProcess``."""
        return run(netns_exec(self.ns, argv), timeout_s=timeout_s, check=check)

    def popen(
        self, argv: Sequence[str], *, label: str | None = None, env: Mapping[str, str] = {}
    ) -> HostProcess:
        """Start ``argv`` in this host; teardown kills it if it is still running."""
        proc = HostProcess(
            self.ns,
            argv,
            log_dir=self.testbed.run_dir,
            label=label or f"{self.name}-cmd{self._count()}",
            env=self.testbed.child_env(self, env),
        )
        self.testbed.track(proc)
        return proc

    def start(
        self,
        fn: Callable[..., Any],
        *args: Any,
        label: str | None = None,
        env: Mapping[str, str] = {},
        standalone: bool = False,
        **kwargs: Any,
    ) -> PyTask:
        """Start ``fn(*args, **kwargs)`` in a Python process inside this host.

        ``standalone``: load ``fn``'s module file directly, without importing its
        package (skips gossipnet's torch import for stdlib-only helpers).
        """
        task = PyTask(
            self.ns,
            fn,
            args,
            kwargs,
            log_dir=self.testbed.run_dir,
            label=label or f"{self.name}-py{self._count()}",
            env=self.testbed.child_env(self, env),
            standalone=standalone,
        )
        self.testbed.track(task)
        return task

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """``start(fn, ...)`` and wait for its result, at most ``timeout_s``."""
        return self.start(fn, *args, **kwargs).result(timeout_s)

    def snmp(self) -> dict[str, dict[str, int]]:
        """This host's ``/proc/net/snmp`` (e.g. ``["Ip"]["FragCreates"]``,
        ``["Udp"]["RcvbufErrors"]``): tells kernel buffer drops from wire drops."""
        text = self.run(["cat", "/proc/net/snmp"]).stdout.splitlines()
        out: dict[str, dict[str, int]] = {}
        for head, values in zip(text[::2], text[1::2], strict=False):
            proto, names = head.split(":", 1)
            nums = values.split(":", 1)[1].split()
            out[proto] = {k: int(v) for k, v in zip(names.split(), nums, strict=False)}
        return out
