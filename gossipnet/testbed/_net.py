"""k hosts on one switch, built from network namespaces, and their faults.

Topology: a "switch" namespace holds bridge ``br0``; each host is a namespace
whose ``eth0`` is one end of a veth pair, the other end (``p<i>``) a bridge
port.  Both ends are created directly inside their namespaces, so nothing is
ever added to, or named in, the machine's own network namespace, and the same
private subnet can be reused by parallel testbeds without a clash.  Neighbour
entries are static (no ARP), so the kernel's random drops hit only the traffic
under test, and IPv6 is off on the links (no router solicitations in the
counters).

Faults live where a real network has them: random loss and cuts on the
switch's forwarding path (nftables, see :mod:`._shaping` for why not in the
sender), bandwidth caps as ``tbf`` queues on both ends of a host's link.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gossipnet.testbed import _registry
from gossipnet.testbed._host import Host, Leftovers
from gossipnet.testbed._proc import HostProcess
from gossipnet.testbed._shaping import TABLE, LinkState, parse_counters, render_ruleset, tbf_args
from gossipnet.testbed._sys import (
    TestbedError,
    TestbedUnavailable,
    netns_exec,
    run,
    unavailable_reason,
)

__all__ = ("Testbed", "TestbedConfig")

log = logging.getLogger(__name__)
_seq = itertools.count()
BRIDGE = "br0"
HOST_IF = "eth0"


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedConfig:
    """Shape of a testbed.

    Attributes:
        hosts: number of hosts (namespaces ``h0..``), 1 to 250.
        subnet: an IPv4 /24 of private addresses; host i gets ``.i+1``.  It exists
            only inside the testbed's namespaces.
        mtu: the links' MTU in bytes (1500 Ethernet; 9000 for jumbo frames).
        keep_logs: keep the run directory (children's stdout/stderr) after teardown.
    """

    __test__ = False  # a library class whose name starts with "Test": not a pytest class

    hosts: int = 4
    subnet: str = "10.77.0.0/24"
    mtu: int = 1500
    keep_logs: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 250:
            raise ValueError(f"hosts must be in [1, 250], got {self.hosts}")
        net = ipaddress.ip_network(self.subnet)
        if net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise ValueError(f"subnet must be a private IPv4 /24, got {self.subnet!r}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535], got {self.mtu}")


class Testbed:
    """k hosts on a switch with per-host loss, caps and cuts; always torn down.

    Use as a context manager (``with Testbed(hosts=4) as tb:``); :meth:`up`
    and :meth:`down` are the same steps by hand.  Every setting method applies
    at once and may be called while hosts run.

    Raises:
        TestbedUnavailable: on :meth:`up`, when this machine cannot host it.
    """

    __test__ = False  # not a pytest class

    def __init__(self, config: TestbedConfig | None = None, **overrides: Any) -> None:
        cfg = config or TestbedConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        self.name = f"{_registry.PREFIX}{os.getpid()}x{next(_seq)}"
        self.switch = f"{self.name}-sw"
        net = ipaddress.ip_network(self.config.subnet)
        pid = os.getpid()
        self.hosts = [
            Host(
                testbed=self,
                index=i,
                name=f"h{i}",
                ns=f"{self.name}-h{i}",
                ip=str(net.network_address + i + 1),
                mac=f"02:77:{(pid >> 8) & 0xFF:02x}:{pid & 0xFF:02x}:00:{i + 1:02x}",
                port=f"p{i}",
            )
            for i in range(self.config.hosts)
        ]
        self.links = {h.name: LinkState(host=h.name, port=h.port) for h in self.hosts}
        self.rates: dict[str, tuple[float, float] | None] = {h.name: None for h in self.hosts}
        self.ports_down: set[str] = set()
        self._run_dir: Path | None = None
        self._procs: list[HostProcess] = []
        self._inodes: set[int] = set()
        self._up = False

    @property
    def run_dir(self) -> Path:
        """This testbed's private directory for logs and call specs (made on first use).

        Why ``mkdtemp``: it creates a new directory, mode 0700, under an
        unpredictable name, or fails; a predictable ``<tmp>/<name>-run`` that
        another local user created first was accepted, and root wrote and read
        files there (issue 19).  The name still starts ``<name>-run`` so that
        ``cleanup_stale`` finds what a killed owner left.
        """
        if self._run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-run-"))
        return self._run_dir

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> Testbed:
        """Create the switch, the hosts and their links; on any failure tear down and raise."""
        reason = unavailable_reason()
        if reason:
            raise TestbedUnavailable(reason)
        _registry.cleanup_stale()
        _registry.register(self)
        self._up = True
        try:
            self.run_dir  # noqa: B018 - made now, private, before any child writes there
            self._add_ns(self.switch)
            sw = ["ip", "-n", self.switch]
            run([*sw, "link", "add", BRIDGE, "mtu", str(self.config.mtu), "type", "bridge"])
            run([*sw, "link", "set", BRIDGE, "up"])
            for h in self.hosts:
                self._add_host(h)
            for h in self.hosts:
                for other in self.hosts:
                    if other is not h:
                        run(
                            [
                                "ip",
                                "-n",
                                h.ns,
                                "neigh",
                                "replace",
                                other.ip,
                                "lladdr",
                                other.mac,
                                "dev",
                                HOST_IF,
                                "nud",
                                "permanent",
                            ]
                        )
            self._apply_rules()
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        run(["ip", "netns", "add", ns])
        inode = _registry.netns_inode(ns)
        if inode is not None:
            self._inodes.add(inode)
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # IPv6 off: no router/neighbour solicitations mixed into the measured traffic
        run(netns_exec(ns, ["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"]), check=False)

    def _add_host(self, h: Host) -> None:
        self._add_ns(h.ns)
        mtu = str(self.config.mtu)
        run(
            [
                "ip",
                "link",
                "add",
                HOST_IF,
                "netns",
                h.ns,
                "mtu",
                mtu,
                "address",
                h.mac,
                "type",
                "veth",
                "peer",
                "name",
                h.port,
                "netns",
                self.switch,
                "mtu",
                mtu,
            ]
        )
        run(["ip", "-n", self.switch, "link", "set", h.port, "master", BRIDGE, "up"])
        # a static forwarding entry: an unknown (never seen) MAC would be flooded to
        # every port, and each flooded copy meets the loss rules again
        run(
            [
                "bridge",
                "-n",
                self.switch,
                "fdb",
                "replace",
                h.mac,
                "dev",
                h.port,
                "master",
                "static",
            ]
        )
        # one wire frame per skb: with GSO, TCP hands 64 KB super-packets to the veth and
        # one random drop on the bridge would take out ~45 segments at once (burst loss)
        run(["ip", "-n", h.ns, "link", "set", HOST_IF, "gso_max_segs", "1"])
        run(["ip", "-n", self.switch, "link", "set", h.port, "gso_max_segs", "1"])
        run(["ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", HOST_IF])
        run(["ip", "-n", h.ns, "link", "set", HOST_IF, "up"])

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down(raise_on_leftovers=exc[0] is None)

    def down(self, *, raise_on_leftovers: bool = True) -> Leftovers:
        """Kill every process, delete links, bridge and namespaces; idempotent.

        Each step runs even if an earlier one failed.  Returns what is left
        (empty when clean); with ``raise_on_leftovers`` a non-empty remainder
        raises, otherwise it is logged (used while another exception unwinds).
        """
        if not self._up:
            return Leftovers()
        self._up = False
        errors: list[str] = []
        for proc in self._procs:
            try:
                proc.kill()
            except TestbedError as err:
                errors.append(str(err))
        namespaces = [h.ns for h in self.hosts] + [self.switch]
        for ns in namespaces:
            try:
                _registry.kill_netns_processes(ns)
            except TestbedError as err:
                errors.append(str(err))
        # links first, so that "no veth or bridge left" is checked, not assumed
        for h in self.hosts:
            run(["ip", "-n", self.switch, "link", "del", h.port], check=False)
        run(["ip", "-n", self.switch, "link", "del", BRIDGE], check=False)
        left_ifs = self._switch_interfaces()
        for ns in namespaces:
            run(["ip", "netns", "del", ns], check=False)
        _registry.unregister(self)
        if not self.config.keep_logs and self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        left = self.leftovers()
        left = Leftovers(left.namespaces, left.processes, tuple(left_ifs))
        if left or errors:
            msg = f"testbed {self.name}: teardown left {left} ({'; '.join(errors)})"
            if raise_on_leftovers:
                raise TestbedError(msg)
            log.error("%s", msg)
        return left

    def _switch_interfaces(self) -> list[str]:
        out = run(["ip", "-n", self.switch, "-o", "link", "show"], check=False).stdout
        names = [
            line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line
        ]
        return [n for n in names if n != "lo"]

    def leftovers(self) -> Leftovers:
        """Namespaces of this testbed that exist and processes still inside them."""
        ours = {self.switch, *(h.ns for h in self.hosts)}
        listed = run(["ip", "netns", "list"], check=False).stdout.split()
        ns = tuple(sorted(ours & set(listed)))
        return Leftovers(ns, tuple(_registry.processes_in(self._inodes, self.name)))

    def track(self, proc: HostProcess) -> None:
        self._procs.append(proc)

    def child_env(self, host: Host, extra: Mapping[str, str]) -> dict[str, str]:
        """A child's environment: ours, tagged for leftover checks, one torch thread."""
        env = dict(os.environ)
        env.update(
            {
                "GNTB_TAG": self.name,
                "GNTB_HOST": host.name,
                "GNTB_IP": host.ip,
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            }
        )
        env.update(extra)
        return env

    # ------------------------------------------------------------------ faults
    def host(self, which: int | str | Host) -> Host:
        """A host by index, name (``"h2"``) or itself."""
        if isinstance(which, Host):
            return which
        if isinstance(which, int):
            return self.hosts[which]
        for h in self.hosts:
            if which in (h.name, h.ip):
                return h
        raise KeyError(f"no host {which!r} in {[h.name for h in self.hosts]}")

    def _targets(self, which: int | str | Host | None) -> list[Host]:
        return list(self.hosts) if which is None else [self.host(which)]

    def set_loss(
        self, which: int | str | Host | None, rate: float, *, direction: str = "out"
    ) -> None:
        """Drop frames of host ``which`` (None = every host) at random with ``rate``.

        ``direction``: ``"out"`` (frames it sends: with every host at rate p each
        host-to-host packet is lost with probability exactly p), ``"in"``, or
        ``"both"`` (end-to-end loss 1-(1-p)^2 when both ends have it).
        """
        if direction not in ("out", "in", "both"):
            raise ValueError(f"direction must be 'out', 'in' or 'both', got {direction!r}")
        for h in self._targets(which):
            link = self.links[h.name]
            if direction in ("out", "both"):
                link = replace(link, loss_out=rate)
            if direction in ("in", "both"):
                link = replace(link, loss_in=rate)
            self.links[h.name] = link
        self._apply_rules()

    def cut(self, which: int | str | Host, *, mode: str = "drop") -> None:
        """Cut host ``which`` off: ``"drop"`` every frame at the switch (its link looks
        up), or ``"down"`` its switch port (it sees NO-CARRIER, as with a pulled cable)."""
        h = self.host(which)
        if mode == "drop":
            self.links[h.name] = replace(self.links[h.name], cut=True)
            self._apply_rules()
        elif mode == "down":
            run(["ip", "-n", self.switch, "link", "set", h.port, "down"])
            self.ports_down.add(h.name)
        else:
            raise ValueError(f"mode must be 'drop' or 'down', got {mode!r}")

    def heal(self, which: int | str | Host) -> None:
        """Undo :meth:`cut` (both modes) for host ``which``."""
        h = self.host(which)
        run(["ip", "-n", self.switch, "link", "set", h.port, "up"])
        self.ports_down.discard(h.name)
        self.links[h.name] = replace(self.links[h.name], cut=False)
        self._apply_rules()

    def is_cut(self, which: int | str | Host) -> bool:
        """True while host ``which`` is cut off (either mode)."""
        h = self.host(which)
        return self.links[h.name].cut or h.name in self.ports_down

    def set_rate(
        self, which: int | str | Host | None, mbit: float | None, *, queue_ms: float = 50.0
    ) -> None:
        """Cap host ``which``'s link at ``mbit`` Mbit/s each way (None removes the cap).

        ``queue_ms``: how long a packet may wait in the cap's queue before it
        is tail-dropped (see :func:`._shaping.tbf_args`).
        """
        for h in self._targets(which):
            for ns, dev in ((h.ns, HOST_IF), (self.switch, h.port)):
                if mbit is None:
                    if self.rates[h.name] is not None:
                        run(netns_exec(ns, ["tc", "qdisc", "del", "dev", dev, "root"]), check=False)
                else:
                    run(netns_exec(ns, tbf_args(dev, mbit, queue_ms, self.config.mtu)))
            self.rates[h.name] = None if mbit is None else (mbit, queue_ms)

    def _apply_rules(self) -> None:
        script = render_ruleset([self.links[h.name] for h in self.hosts], mtu=self.config.mtu)
        run(netns_exec(self.switch, ["nft", "-f", "-"]), input_text=script)

    def counters(self, field: str = "packets") -> dict[str, int]:
        """Switch counters by rule, e.g. ``{"h0 seen-out": 5000, "h0 loss-out": 497}``;
        ``field="bytes"`` gives bytes (IP packet lengths) instead of packets."""
        out = run(netns_exec(self.switch, ["nft", "-j", "list", "table", "bridge", TABLE]))
        return parse_counters(out.stdout, field)
