"""``gossipnet testbed``: k hosts on a lossy switch, a command or a training peer in each.

    sudo gossipnet testbed --hosts 4 --loss 0.1 --train
    sudo gossipnet testbed --loss 0.05 --rate-mbit 100 --cut h3@5 -- python my_peer.py {ip} {peers}
    sudo gossipnet testbed --hold 600      # keep it up; use `ip netns exec <ns> ...` meanwhile

Before anything runs the links are checked: datagrams cross a ring of hosts
and the measured loss must match the set rate within binomial bounds.  The
testbed is torn down however the run ends (Ctrl-C included).  Like the rest of
the CLI, this module prints: it is user-facing output.

Hook for ``gossipnet/cli.py``::

    register_command("testbed", testbed_cli.HELP, testbed_cli.configure, testbed_cli.main)

or, for a plain argparse tree, ``add_parser(subparsers)``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

__all__ = ("DESCRIPTION", "HELP", "add_parser", "configure", "main")

HELP = "k hosts (network namespaces) with kernel loss, caps and cuts; needs root"
DESCRIPTION = """\
k hosts (network namespaces h0.., 10.77.0.1..) on one bridge, with kernel packet loss,
bandwidth caps and link cuts; a command or a gossipnet training peer runs in each.

Needs root: it creates network namespaces and veth links (ip), drops frames with
nftables (nft) and caps links with tc tbf; scripts/install-testbed-deps.sh installs
them. Without root or these tools it exits with status 2 and says why. Everything is
torn down however the run ends (Ctrl-C included).

Cuts (--cut h3@5 cuts h3 5 s after the commands started; --cut-mode): "drop" drops
every frame to and from the host at the switch (nftables; its link stays up), "down"
sets the host's switch port down (the host sees NO-CARRIER, as with a pulled cable).
MTU (--mtu): the MTU of the bridge and of every veth link, in bytes (1500 Ethernet,
9000 jumbo frames); it also sizes the tbf burst of --rate-mbit, and the switch counts
frames longer than it (it checks that no offload hands it super-packets).

examples:
  sudo gossipnet testbed --hosts 4 --loss 0.1 --train
  sudo gossipnet testbed --loss 0.05 --rate-mbit 100 --cut h3@5 -- python my_peer.py {ip} {peers}
  sudo gossipnet testbed --hold 600      # keep it up; use `ip netns exec <ns> ...` meanwhile
"""
EXIT_UNAVAILABLE = 2
PEER_PORT = 7000


def configure(p: argparse.ArgumentParser) -> None:
    """Add the ``testbed`` options to ``p`` (and its description: root, cuts, MTU)."""
    p.description = DESCRIPTION
    p.add_argument("--hosts", type=int, default=4, help="number of hosts (h0..)")
    p.add_argument(
        "--loss",
        default="0",
        metavar="RATE|HOST=RATE,...",
        help="random loss of the frames each host sends, e.g. 0.1 or h1=0.1,h2=0.05",
    )
    p.add_argument("--loss-in", default="0", metavar="RATE|HOST=RATE,...", help="on receive")
    p.add_argument("--rate-mbit", type=float, default=None, help="cap every link (Mbit/s)")
    p.add_argument("--queue-ms", type=float, default=50.0, help="the cap's queue (delay bound)")
    p.add_argument(
        "--cut",
        action="append",
        default=[],
        metavar="HOST@SECONDS",
        help="cut a host this long after the commands started (repeatable)",
    )
    p.add_argument(
        "--cut-mode",
        choices=("drop", "down"),
        default="drop",
        help="how --cut cuts: drop the host's frames at the switch, or set its port down",
    )
    p.add_argument(
        "--mtu", type=int, default=1500, help="MTU of the bridge and every link (bytes, 576-65535)"
    )
    p.add_argument("--check", type=int, default=2000, help="probe datagrams per link (0: skip)")
    p.add_argument("--train", action="store_true", help="run a gossipnet training peer per host")
    p.add_argument("--steps", type=int, default=300, help="training steps (--train)")
    p.add_argument("--timeout", type=float, default=300.0, help="bound of the whole run (s)")
    p.add_argument("--hold", type=float, default=0.0, help="keep the testbed up this long (s)")
    p.add_argument("--keep-logs", action="store_true", help="keep the hosts' stdout/stderr")
    p.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="run in every host; {host} {ip} {rank} {peers} {n} are filled in",
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``testbed`` to an ``add_subparsers()`` object; returns its parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "testbed", help=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure(p)
    p.set_defaults(func=main)
    return p


def _per_host(spec: str, names: list[str]) -> dict[str, float]:
    """``"0.1"`` -> every host; ``"h1=0.1,h2=0.05"`` -> those hosts (others 0)."""
    if "=" not in spec:
        return dict.fromkeys(names, float(spec))
    out = dict.fromkeys(names, 0.0)
    for item in spec.split(","):
        host, _, rate = item.partition("=")
        if host.strip() not in out:
            raise ValueError(f"unknown host {host!r} in {spec!r}; hosts are {names}")
        out[host.strip()] = float(rate)
    return out


def _cuts(specs: list[str]) -> list[tuple[float, str]]:
    out = []
    for s in specs:
        host, _, when = s.partition("@")
        out.append((float(when or 0), host))
    return sorted(out)


def _apply(tb: Any, args: argparse.Namespace) -> None:
    names = [h.name for h in tb.hosts]
    for host, rate in _per_host(args.loss, names).items():
        tb.set_loss(host, rate, direction="out")
    for host, rate in _per_host(args.loss_in, names).items():
        tb.set_loss(host, rate, direction="in")
    if args.rate_mbit:
        tb.set_rate(None, args.rate_mbit, queue_ms=args.queue_ms)


def _check(tb: Any, count: int) -> bool:
    from gossipnet.testbed.measure import measure_links

    n = len(tb.hosts)
    if n < 2 or count <= 0:
        return True
    ok = True
    for m in measure_links(tb, [(i, (i + 1) % n) for i in range(n)], count=count):
        print(f"  link check {m}")
        ok = ok and m.ok
    return ok


def _start(tb: Any, args: argparse.Namespace) -> list[Any]:
    peers = [h.url(PEER_PORT) for h in tb.hosts]
    if args.train:
        from gossipnet.testbed.train import TrainSpec, train_peer

        fast = {"heartbeat_interval_s": 0.25, "failure_timeout_s": 1.5}
        return [
            h.start(
                train_peer,
                TrainSpec(
                    peers=tuple(peers),
                    rank=i,
                    steps=args.steps,
                    run_timeout_s=args.timeout - 10,
                    config=fast,
                ),
                label=f"train-{h.name}",
            )
            for i, h in enumerate(tb.hosts)
        ]
    fill = {"peers": ",".join(peers), "n": str(len(peers))}
    return [
        h.popen(
            [a.format(host=h.name, ip=h.ip, rank=i, **fill) for a in args.cmd],
            label=f"cmd-{h.name}",
        )
        for i, h in enumerate(tb.hosts)
    ]


def _supervise(tb: Any, procs: list[Any], args: argparse.Namespace) -> None:
    """Apply cuts on schedule (seconds after the start) until every process ended;
    kill what still runs at the deadline: the CLI never waits without bound."""
    cuts, timeout_s = _cuts(args.cut), args.timeout
    t0 = time.monotonic()
    pending = list(cuts)
    while any(p.poll() is None for p in procs):
        now = time.monotonic() - t0
        while pending and pending[0][0] <= now:
            _, host = pending.pop(0)
            tb.cut(host, mode=args.cut_mode)
            print(f"  t={now:5.1f} s: cut {host} ({args.cut_mode})")
        if now > timeout_s:
            print(f"  deadline {timeout_s:.0f} s passed: killing what still runs")
            for p in procs:
                p.kill()
            return
        time.sleep(0.05)


def _report(args: argparse.Namespace, procs: list[Any]) -> int:
    status = 0
    for p in procs:
        code = p.poll()
        if args.train:
            try:
                r = p.result(5.0)
            except Exception as err:
                print(f"  {p.label}: FAILED {err}")
                status = 1
                continue
            lost = r["packets_lost"] / max(1, r["packets_lost"] + r["packets_received"])
            print(
                f"  {p.label}: {r['steps_done']} steps, final loss {r['final_loss']:.4f}, "
                f"{lost:.1%} of data packets lost, median step {r['step_s']:.3f} s, "
                f"alive at end {r['alive_end']}"
            )
        else:
            print(f"  {p.label}: exit {code}")
            for line in p.stdout().splitlines()[-20:]:
                print(f"    | {line}")
            status = status or int(code != 0)
    return status


def main(args: argparse.Namespace) -> int:
    """Run ``gossipnet testbed``; returns the exit status (2 = cannot run here)."""
    from gossipnet.testbed import Testbed, TestbedUnavailable, unavailable_reason

    # ``cmd``, not ``command``: gossipnet.cli keeps the subcommand's name in ``command``
    command = [a for a in (args.cmd or []) if a != "--"]
    args.cmd = command
    reason = unavailable_reason()
    if reason:
        print(f"gossipnet testbed cannot run here: {reason}")
        return EXIT_UNAVAILABLE
    try:
        with Testbed(hosts=args.hosts, mtu=args.mtu, keep_logs=args.keep_logs) as tb:
            print(f"testbed {tb.name}: {args.hosts} hosts on {tb.config.subnet}, MTU {args.mtu}")
            for h in tb.hosts:
                print(f"  {h.name}: {h.ip}  (ip netns exec {h.ns} ...)")
            _apply(tb, args)
            if not _check(tb, args.check):
                print("link check failed: the measured loss is not what was set")
                return 1
            status = 0
            if args.train or command:
                procs = _start(tb, args)
                _supervise(tb, procs, args)
                status = _report(args, procs)
            if args.hold > 0:
                print(f"holding for {args.hold:.0f} s (Ctrl-C tears down)")
                time.sleep(args.hold)
            if args.keep_logs:
                print(f"logs kept in {tb.run_dir}")
        print("torn down: no namespace, link or process left")
        return status
    except TestbedUnavailable as err:
        print(f"gossipnet testbed cannot run here: {err}")
        return EXIT_UNAVAILABLE
