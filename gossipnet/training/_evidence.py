"""Evidence before adopting state: who counts, how many must agree, on what.

Why: a peer that replaces its replica with another's (realignment, replica repair)
hands that other peer the model.  One key holder used to be enough: ids it made up,
which never took part in a round, announced a round far ahead; the honest peers
concluded they were behind, downloaded the made-up ids' state and adopted it, and
all replicas then agreed on the poisoned model.  The rule here:

- **Participants.**  Only peers that this peer *saw take part* carry weight: those
  heard contributing to one of its last :data:`PARTICIPANT_ROUNDS` rounds of the
  optimizer (a round's ``Alignment.in_sync``).  A peer with no such history (a
  fresh process that joined a run under way) falls back to the peers whose round
  packets (data, ENDs; not heartbeats) it holds for rounds ahead of its own
  (:meth:`~gossipnet.collectives.lossy.engine.LossyAllReduce.senders_ahead`).
  An id known only from heartbeats or digests counts for nothing: not in "behind"
  or "ahead", not in a digest vote, not as a donor.
- **Claims.**  A donor's published parameters carry a :class:`Claim` (its position:
  step count, round base, next round id; and its layout), and the manifest lists a
  digest per chunk of the parameter bytes.  Peers asked for their state at the same
  target step publish at that step, so honest ones make the same position claim;
  their bytes agree chunk by chunk except where a broadcast was lost, or where the
  absent downloader itself owns the chunks (each donor estimated those alone).
- **Quorum.**  ``n`` counts the verified participants and this peer (which never
  vouches for the state it is about to replace).  A position is adopted only if at
  least :func:`quorum` of ``n`` claim it: a strict majority of ``n``, and never fewer
  than two peers (the donor and a witness) once ``n >= 3``.  With ``n == 2`` no third
  witness exists; :data:`ADOPT_ON_ONE_WORD` decides (default: adopt the one other
  participant's state, with a warning and a report; that peer already owns half of
  every all-reduce, and its broadcasts are applied as they come).  Each chunk of the
  parameters is adopted only if :func:`quorum` of ``n`` list the same digest for it
  (:func:`vouched_chunks`), and the bytes downloaded must hash to that digest; the
  other chunks stay ours (the owners' broadcasts of the next round overwrite every
  chunk but our own shard anyway).
- Nothing else comes from a donor: not hyperparameters, not optimizer state.

A made-up id gains weight only by taking part in rounds, and then it is a
participant that the quorum outnumbers until it holds half the group; how many ids
one key holder may make is the membership layer's bound.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gossipnet.collectives.lossy.round_id import MAX_ROUND, Alignment

__all__ = (
    "ADOPT_ON_ONE_WORD",
    "LIVE",
    "PARTICIPANT_ROUNDS",
    "Claim",
    "ParticipantLog",
    "quorum",
    "vouched",
    "vouched_chunks",
)

#: How many of this peer's latest optimizer rounds make a peer a verified participant.
PARTICIPANT_ROUNDS = 16
#: In a group of two verified participants, adopt the other's state on its word
#: alone (with a warning); False: never (a peer out of step stays so).
ADOPT_ON_ONE_WORD = True
#: The snapshot kind of a claim (a server target's kind): the parameters at the end
#: of a step.
LIVE = 0
_HEX = frozenset("0123456789abcdef")
_LAYOUT_HEX = 16


def quorum(n: int) -> int:
    """Holders needed among ``n`` verified participants (this peer included).

    A strict majority of ``n`` and at least 2 for ``n >= 3``; for ``n == 2``, 1 if
    :data:`ADOPT_ON_ONE_WORD` else more than can exist; for ``n <= 1`` (nobody
    else verified) more than can exist.
    """
    if n >= 3:
        return max(2, n // 2 + 1)
    if n == 2 and ADOPT_ON_ONE_WORD:
        return 1
    return n + 1


@dataclass(frozen=True, slots=True)
class Claim:
    """Where a published state is in training; the manifest's meta carries it.

    Attributes:
        step: the donor's step count (steps done) with this state.
        round_base: the donor's round base (``AllReduceStrategy`` round numbering).
        next_round: the first optimizer round id a peer holding this state runs.
        layout: 16 hex digits naming the parameter buckets' dtypes and lengths
            (:func:`gossipnet.training._snapshot.layout_key`).
    """

    step: int
    round_base: int
    next_round: int
    layout: str

    def to_meta(self) -> dict[str, Any]:
        """The manifest meta fields (``step`` is also what a server matches targets by)."""
        return {
            "k": LIVE,
            "step": self.step,
            "rb": self.round_base,
            "nr": self.next_round,
            "lay": self.layout,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Claim | None:
        """The claim in a manifest's meta, or None if any field is missing or out of
        range (a peer's manifest is data, never trusted for its types)."""
        k, lay = meta.get("k"), meta.get("lay")
        nums = [meta.get(f) for f in ("step", "rb", "nr")]
        if type(k) is not int or k != LIVE:
            return None
        ints = [v for v in nums if type(v) is int and 0 <= v <= MAX_ROUND]
        if len(ints) != len(nums) or ints[1] + 3 * (ints[0] + 1) > MAX_ROUND:
            return None  # a position whose round ids would leave the valid range
        if not (isinstance(lay, str) and len(lay) == _LAYOUT_HEX and set(lay) <= _HEX):
            return None
        return cls(ints[0], ints[1], ints[2], lay)


def vouched(claims: Mapping[str, Claim], n: int) -> tuple[Claim, list[str]] | None:
    """The claim that :func:`quorum` of ``n`` hold, and its holders (sorted); None if
    no claim has enough.  ``claims``: verified participant -> its claim (never this
    peer's own).  At most one claim can qualify (a strict majority, or the one other
    peer when ``n == 2``)."""
    need = quorum(n)
    groups: dict[Claim, list[str]] = collections.defaultdict(list)
    for peer, claim in claims.items():
        groups[claim].append(peer)
    for claim, holders in groups.items():
        if len(holders) >= need:
            return claim, sorted(holders)
    return None


def vouched_chunks(digests: Mapping[str, Sequence[bytes]], n: int) -> dict[int, bytes]:
    """Per chunk index, the digest that :func:`quorum` of ``n`` list; chunks where no
    digest has enough are left out.  ``digests``: holder -> its manifest's chunk
    digests (all of one length: the holders of one claim, same size and chunking)."""
    need = quorum(n)
    lists = list(digests.values())
    out: dict[int, bytes] = {}
    for c in range(min((len(d) for d in lists), default=0)):
        top, count = collections.Counter(d[c] for d in lists).most_common(1)[0]
        if count >= need:
            out[c] = top
    return out


class ParticipantLog:
    """The peers heard contributing to this peer's latest optimizer rounds.

    Fed once per round (:meth:`note`) with the round's alignment; loop thread only
    (read from the training thread between calls into the loop, which orders them).
    """

    def __init__(self, me: str, rounds: int = PARTICIPANT_ROUNDS) -> None:
        self.me = me
        self._rounds: collections.deque[frozenset[str]] = collections.deque(maxlen=rounds)

    def note(self, align: Alignment) -> None:
        """Record who took part in a round (its ``in_sync``: heard in that very round)."""
        self._rounds.append(align.in_sync)

    def verified(self, fallback: Iterable[str] = ()) -> frozenset[str]:
        """Peers (not us) heard taking part in one of the recorded rounds; if none,
        ``fallback`` (the peers whose round packets a fresh joiner holds for rounds
        ahead of its own: the only sign it has of who runs rounds)."""
        seen: set[str] = set()
        for ids in self._rounds:
            seen |= ids
        seen.discard(self.me)
        return frozenset(seen) if seen else frozenset(fallback) - {self.me}

    def judge(self, align: Alignment, fallback: Iterable[str] = ()) -> Alignment:
        """``align`` with "ahead" and "behind" restricted to verified participants.

        ``fallback``: as in :meth:`verified`.  ``in_sync`` is kept: it is made of
        peers heard in the round itself.
        """
        verified = self.verified(fallback)
        ahead = {p: r for p, r in align.ahead.items() if p in verified}
        behind = {p: r for p, r in align.behind.items() if p in verified}
        return Alignment(align.in_sync, ahead, behind)
