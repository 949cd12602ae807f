"""Why ``join()`` found fewer peers than it expected, in words a user can act on.

When the expected peers are not all alive at ``Config.join_timeout_s``,
:class:`~gossipnet.runtime.runtime.Runtime` either raises
:class:`~gossipnet.JoinError` or, with ``Config.min_peers`` met, goes on with a
warning; both say the same thing, built here: who is alive, which bootstrap
addresses never answered, and whose packets failed authentication, with the
likely cause (another secret, run id or MAC algorithm).

Why a module of its own: the rules are pure (a snapshot of the node in, text
out), so they are read and tested apart from sockets and threads.  What a
rejected packet says about its sender is unverified (:class:`Suspect`): it
appears in messages as a claim and decides nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from gossipnet.errors import JoinError
from gossipnet.transport.wire import Suspect

__all__ = ("JoinSnapshot", "join_error", "shortfall_details", "unauthenticated")

#: Names listed in one message at most; the rest are counted.
_MAX_LISTED = 8


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JoinSnapshot:
    """What a peer knew at its join deadline (taken on its loop thread).

    Attributes:
        peer_id: this peer.
        address: this peer's advertised address.
        alive: ids of the peers alive, this one included, sorted.
        alive_addresses: their addresses.
        bootstrap: the addresses we said hello to (our own removed).
        suspects: senders of packets that failed authentication (unverified claims).
        run: our ``Config.run``.
        expected: peers expected, this one included.
        timeout_s: how long we waited.
    """

    peer_id: str
    address: str
    alive: tuple[str, ...]
    alive_addresses: frozenset[str]
    bootstrap: tuple[str, ...]
    suspects: tuple[Suspect, ...]
    run: str
    expected: int
    timeout_s: float


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def _cause(suspect: Suspect, run: str) -> str:
    """The likely misconfiguration behind one sender's rejected packets."""
    if suspect.reason == "mac_size":
        return "a different Config.mac (its MAC frames have another length)?"
    if suspect.same_key:
        return "same key but a bad tag: a different Config.mac, or corrupted or forged packets?"
    if suspect.run is not None and suspect.run != run:
        return f"a different run id (it claims Config.run={suspect.run!r}, ours is {run!r})?"
    return "a different secret?"


def unauthenticated(suspects: Iterable[Suspect], run: str) -> dict[str, str]:
    """Sender label -> likely cause, one entry per claimed peer id.

    A sender's membership packets carry its address and its data packets do
    not: the entry with an address wins, so the message names where it is.
    """
    best: dict[str | None, Suspect] = {}
    for suspect in suspects:
        seen = best.get(suspect.src)
        if seen is None or suspect.addr is not None or seen.addr is None:
            best[suspect.src] = suspect
    out: dict[str, str] = {}
    for src, suspect in best.items():
        if suspect.addr is not None:
            label = f"{suspect.addr} (claims to be peer {src!r})" if src else suspect.addr
        elif src is not None:
            label = f"a sender that claims to be peer {src!r}"
        else:
            label = "a sender whose header does not parse"
        out[label] = _cause(suspect, run)
    return out


def shortfall_details(
    snap: JoinSnapshot, *, advice: bool = True
) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """(text, bootstrap addresses never heard from, unauthenticated senders).

    An address whose packets failed authentication is reported as such, not
    also as silent: it did answer, with the wrong key.  ``advice`` False leaves
    out what to check about a silent address (for the warning of a run that
    chose to go on without it); failed authentication is always explained.
    """
    bad = unauthenticated(snap.suspects, snap.run)
    claimed = {s.addr for s in snap.suspects if s.addr is not None}
    missing = tuple(a for a in snap.bootstrap if a not in snap.alive_addresses and a not in claimed)
    lines = [
        f"peer {snap.peer_id}: {len(snap.alive)} of {snap.expected} expected peers alive after"
        f" {snap.timeout_s:.1f} s (Config.join_timeout_s); alive: {_listed(snap.alive)}"
    ]
    lines += [f"packets from {who} fail authentication: {why}" for who, why in bad.items()]
    if bad:
        lines.append(
            "every peer of a run needs the same secret (join(secret=...) or GOSSIPNET_SECRET),"
            " Config.run and Config.mac"
        )
    if missing and advice:
        lines.append(
            f"no answer from {_listed(missing)}: is a peer running there, is the host:port"
            " right (the peer's listen address) and reachable from here (firewall, routes)?"
        )
    elif missing:
        lines.append(f"no answer from {_listed(missing)}")
    if not missing and not bad and len(snap.alive) < snap.expected:
        # e.g. torchrun's rank 0: it bootstraps from nobody, the others dial it
        lines.append(
            f"{snap.expected - len(snap.alive)} peer(s) never said hello: are they started,"
            f" with {snap.address} among their peers (under torchrun:"
            " MASTER_ADDR:MASTER_PORT+1), and can they reach it?"
        )
    return "\n  ".join(lines), missing, bad


def join_error(snap: JoinSnapshot) -> JoinError:
    """The :class:`JoinError` for a snapshot with fewer peers than required."""
    text, missing, bad = shortfall_details(snap)
    text += (
        "\nfix the above, raise Config.join_timeout_s if peers start slowly, or pass"
        " min_peers=N to go on with N peers (this one included)"
    )
    return JoinError(text, alive=snap.alive, missing=missing, unauthenticated=tuple(bad))
