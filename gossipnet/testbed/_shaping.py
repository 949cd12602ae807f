"""What the testbed asks the kernel for: nftables loss/cut rules and tc tbf caps.

Pure functions that build rule text and argument lists, so the exact rules are
unit-tested without root.

Why loss lives on the switch, in an nftables ``bridge`` table on its forward
hook, not in the sending host: a packet dropped in the sender's own output path
is reported straight back to TCP (the qdisc/netfilter verdict reaches the
socket), which then resends at once, with no timeout: gloo moved 100 MB at 5%
"loss" in 0.42 s that way, against 106 s when the same rate was dropped on the
bridge, where a lost segment is only discovered by missing ACKs, as on a real
wire.  ``tc netem`` would be the usual tool but is not in every kernel;
``numgen random`` is.

Why a cap shapes both ends of a host's link: ``tbf`` on the host's ``eth0``
models its NIC (the sender queues and, for TCP, gets back-pressure), ``tbf`` on
the switch port toward the host models the switch's egress queue, where
incast (three peers sending to one) overflows and tail-drops, as it does on a
real switch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = (
    "LOSS_SCALE",
    "TABLE",
    "LinkState",
    "parse_counters",
    "render_ruleset",
    "tbf_args",
    "tbf_burst_bytes",
)

#: ``numgen random mod LOSS_SCALE``: loss rates resolve to one part per million.
LOSS_SCALE = 1_000_000
#: The nftables table (family ``bridge``) in the switch namespace.
TABLE = "gntb"


@dataclass(frozen=True, slots=True)
class LinkState:
    """Faults on one host's link, as seen from its switch port.

    Attributes:
        host: the host's name, used in rule comments (counters are read by it).
        port: the switch-side interface of the host's veth pair.
        loss_out: probability that a frame the host sends is dropped.
        loss_in: probability that a frame to the host is dropped.
        cut: drop every frame to and from the host (a pulled cable that the host
            does not notice: its own interface stays up).
    """

    host: str
    port: str
    loss_out: float = 0.0
    loss_in: float = 0.0
    cut: bool = False

    def __post_init__(self) -> None:
        for name in ("loss_out", "loss_in"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")


def _threshold(p: float) -> int:
    return round(p * LOSS_SCALE)


def _rules(link: LinkState, mtu: int | None) -> list[str]:
    port, host = link.port, link.host
    rules = [
        # counters without a verdict: what the switch saw, to compare drops against
        f'iifname "{port}" counter comment "{host} seen-out"',
        f'oifname "{port}" counter comment "{host} seen-in"',
    ]
    if mtu is not None:
        # a packet longer than the MTU here is a GSO super-packet: one random drop
        # would then remove many wire frames at once; this counter proves it never happens
        rules.append(f'iifname "{port}" meta length > {mtu} counter comment "{host} oversize-out"')
    if link.cut:
        rules.append(f'iifname "{port}" counter drop comment "{host} cut-out"')
        rules.append(f'oifname "{port}" counter drop comment "{host} cut-in"')
        return rules
    for match, p, what in (("iifname", link.loss_out, "out"), ("oifname", link.loss_in, "in")):
        n = _threshold(p)
        if n >= LOSS_SCALE:
            rules.append(f'{match} "{port}" counter drop comment "{host} loss-{what}"')
        elif n > 0:
            rules.append(
                f'{match} "{port}" numgen random mod {LOSS_SCALE} < {n} '
                f'counter drop comment "{host} loss-{what}"'
            )
    return rules


def render_ruleset(
    links: Sequence[LinkState], table: str = TABLE, *, mtu: int | None = None
) -> str:
    """One ``nft -f`` script that atomically replaces the testbed's rules.

    ``add table`` + ``flush table`` + the full definition in one file is
    nftables' atomic replace: no packet ever sees a half-applied rule set.
    With ``mtu``, each host also gets a ``<host> oversize-out`` counter of
    packets longer than the MTU (``meta length`` is the IP packet's length).
    """
    body = "\n".join(f"\t\t{rule}" for link in links for rule in _rules(link, mtu))
    return (
        f"add table bridge {table}\n"
        f"flush table bridge {table}\n"
        f"table bridge {table} {{\n"
        "\tchain faults {\n"
        "\t\ttype filter hook forward priority 0; policy accept;\n"
        f"{body}\n"
        "\t}\n"
        "}\n"
    )


def parse_counters(nft_json: str, field: str = "packets") -> dict[str, int]:
    """Counters by rule comment from ``nft -j list table bridge <table>``.

    ``field``: ``"packets"`` or ``"bytes"`` (IP packet bytes, Ethernet header excluded).
    """
    out: dict[str, int] = {}
    for item in json.loads(nft_json).get("nftables", []):
        rule = item.get("rule")
        if not rule or "comment" not in rule:
            continue
        for expr in rule.get("expr", []):
            if isinstance(expr, dict) and "counter" in expr:
                out[rule["comment"]] = int(expr["counter"][field])
    return out


def tbf_burst_bytes(rate_mbit: float, mtu: int) -> int:
    """Token-bucket depth: 2 ms at the rate, at least 4 frames.

    Why not larger: the burst is how much the link may send at line rate,
    and a deep bucket hides the cap on short transfers (a 1 MB all-reduce
    would never see a 100 Mbit/s cap with a 1 MB bucket).
    """
    return max(4 * (mtu + 14), int(rate_mbit * 1e6 / 8 * 0.002))


def tbf_args(dev: str, rate_mbit: float, queue_ms: float, mtu: int) -> list[str]:
    """``tc`` arguments that cap ``dev``'s egress at ``rate_mbit`` with a ``queue_ms`` queue.

    ``latency`` bounds the time a packet may wait in the queue; tbf derives the
    queue size (bytes) from it, so the queue is the same *delay* at every rate,
    like a switch buffer sized for one round-trip.
    """
    if rate_mbit <= 0 or queue_ms <= 0:
        raise ValueError("rate_mbit and queue_ms must be > 0")
    return [
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate_mbit * 1000:.0f}kbit",
        "burst",
        str(tbf_burst_bytes(rate_mbit, mtu)),
        "latency",
        f"{queue_ms:g}ms",
    ]
