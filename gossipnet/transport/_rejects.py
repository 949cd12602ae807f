"""Rejected packets as data: counted per reason, logged rate-limited, and the
claims of unauthenticated senders kept for diagnostics.

Why keep what a forged packet claims: a peer started with another secret looks,
from here, exactly like an attacker.  ``join()`` can only tell the user which
peer is misconfigured if something remembers what the rejected packets said
about their sender (:class:`Suspect`): sampled (at most 100 headers a second),
size-limited, never acted on.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gossipnet.clock import Clock

__all__ = ("RejectLog", "Suspect")

log = logging.getLogger("gossipnet.transport.wire")

# Reasons logged at DEBUG: duplicates, reordering and restarts are routine on a
# lossy network (and fault plans inject them); everything else hints at a
# misconfiguration or an attack and is a WARNING.
# A "destination" drop is routine too: a peer restarted on the same address under a
# new id receives the packets still addressed to its previous life.
# An "unknown_key" drop is routine too: a member's packets that overtake its
# introduction, or late ones of a peer whose keys were just released.
_ROUTINE_REASONS = frozenset({"replay", "stale_epoch", "destination", "unknown_key"})
#: Senders of unauthenticated packets remembered for diagnostics.
_SUSPECTS_MAX = 8
#: At most one unauthenticated header is parsed per this many seconds: a flood of
#: forgeries must keep costing one MAC check each, not a parse too.
_SUSPECT_PARSE_INTERVAL_S = 0.01
#: Claimed strings are cut to this length before they are kept.
_SUSPECT_CHARS = 128


@dataclass(slots=True, frozen=True)
class Suspect:
    """What a packet that failed authentication *claims* about its sender.

    Nothing here is verified: anyone can write these header fields.  It is kept
    for one use, an error message that helps a user find a misconfigured peer
    ("packets from tcp://... (claims to be peer 'b') fail authentication").

    Attributes:
        src: the claimed peer id, if the header parsed.
        addr: the claimed listen address (membership packets carry one).
        run: the claimed run id.
        reason: ``"mac"`` (the tag or key fingerprint did not match) or
            ``"mac_size"`` (a MAC frame of another length: another ``Config.mac``).
        same_key: the frame's key fingerprint matched ours, so the sender holds our
            run key (same secret and run) and the tag, not the key, differs.
    """

    src: str | None
    addr: str | None
    run: str | None
    reason: str
    same_key: bool


class RejectLog:
    """One codec's rejections: ``rejects`` (count per reason) and ``suspects``.

    Args:
        me: our peer id, named in log records.
        clock: paces the log and the suspect sampling.
        interval_s: at most one log record per reason per this many seconds
            (``Config.reject_log_interval_s``); the records say how many were dropped.
        unpack: the codec's size-limited msgpack parser, for suspects' headers.
    """

    def __init__(
        self, me: str, clock: Clock, interval_s: float, unpack: Callable[[Any], Any]
    ) -> None:
        self.me = me
        self.clock = clock
        self.interval_s = interval_s
        self._unpack = unpack
        self.rejects: collections.Counter[str] = collections.Counter()
        #: the latest distinct senders of unauthenticated packets, oldest first (bounded)
        self.suspects: collections.OrderedDict[tuple[str | None, str | None], Suspect] = (
            collections.OrderedDict()
        )
        self._last: dict[str, float] = {}
        self._pending: collections.Counter[str] = collections.Counter()
        self._parsed_at: float | None = None

    def reject(self, reason: str, src: str | None) -> None:
        """Count a rejection; log it unless this reason was logged recently."""
        self.rejects[reason] += 1
        self._pending[reason] += 1
        now = self.clock.now()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            return
        count = self._pending.pop(reason)
        self._last[reason] = now
        level = logging.DEBUG if reason in _ROUTINE_REASONS else logging.WARNING
        who = src if src is not None else "an unauthenticated sender"
        msg = "peer %s: dropped %d packet(s) for %s since the last report (latest from %s)"
        log.log(level, msg, self.me, count, reason, who)

    def note_suspect(
        self, reason: str, head: memoryview, same_key: bool, kinds: frozenset[int] | None = None
    ) -> None:
        """Remember what an unauthenticated packet claims about its sender (bounded).

        Parsed with the same size limits as any header, at most once per
        ``_SUSPECT_PARSE_INTERVAL_S``; only strings are kept, cut short.  The
        result is never used for anything but diagnostics.  ``kinds``: keep it only
        if it claims one of these kinds (an unknown key's packet is a suspect only
        as an introduction: anything else may be a member's that overtook its own).
        """
        now = self.clock.now()
        last = self._parsed_at
        if last is not None and 0 <= now - last < _SUSPECT_PARSE_INTERVAL_S:
            return
        self._parsed_at = now
        try:
            header = self._unpack(head)
        except Exception:
            header = None
        claims = header if type(header) is dict else {}
        if kinds is not None and claims.get("k") not in kinds:
            return

        def claim(key: str) -> str | None:
            value = claims.get(key)
            return value[:_SUSPECT_CHARS] if isinstance(value, str) else None

        suspect = Suspect(claim("src"), claim("addr"), claim("run"), reason, same_key)
        key = (suspect.src, suspect.addr)
        self.suspects.pop(key, None)
        self.suspects[key] = suspect
        while len(self.suspects) > _SUSPECTS_MAX:
            self.suspects.popitem(last=False)
