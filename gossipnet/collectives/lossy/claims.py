"""Who may move this peer's round id, and how far: :class:`RoundClaims`.

A plain call (no ``round_id``) starts at the round the run has reached, so that a
peer that made fewer calls, was frozen, joined late or restarted pairs with the
others again at its next call.  What "the run has reached" means is the
question here.  A round id in another peer's beacon or round packet is that
peer's claim: evidence from one peer, not a fact.  Taking the highest id any
packet named let one member move every receiver to the largest valid id, after
which the next id was out of range everywhere and the run was wedged.  Two rules
bound what claims can do:

- Quorum.  The catch-up target is the highest round that more than half of the
  *electorate* claims to have reached.  The electorate is the peers whose data
  this peer took in one of its last :data:`PARTICIPANT_ROUNDS` rounds (its
  participants), or, while there are none (a fresh or restarted engine, a long
  partition), the members alive in its view.  A claim from any other id moves
  nothing, and that id is neither ahead nor behind in
  :func:`.round_id.alignment`: an id that never took part in a round carries
  no weight.  In a run of two peers the electorate is the other one, whose
  word alone moves us, within the window below.
- Window.  A claim more than :data:`ROUND_WINDOW` past our own next round is
  kept as ``next_round + ROUND_WINDOW`` (the engine counts it, ``round_jump``;
  a data packet that far ahead is dropped, never buffered).  So round ids
  advance by at most ``ROUND_WINDOW + 1`` per round this peer runs, whatever
  anyone sends: reaching :data:`.round_id.MAX_ROUND` from 0 takes more than
  ``2**32`` rounds.  A peer that joins a run more than a window ahead catches
  up a window per call.

Everything here is bookkeeping with no I/O; the engine (:mod:`.intake`,
:mod:`.engine`) decides when a packet is a claim and when a round closed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

__all__ = ("PARTICIPANT_ROUNDS", "ROUND_WINDOW", "RoundClaims")

#: How far past our own next round one claim counts (further: counted, clamped).
#: A power of two far above any gap between honest peers' plain calls (a peer
#: frozen or absent for a million rounds), and far below MAX_ROUND.
ROUND_WINDOW = 1 << 20
#: Rounds of ours during which a peer whose data we took stays a participant.
PARTICIPANT_ROUNDS = 64


class RoundClaims:
    """The round each peer claims to be in, and the peers that took part with us.

    Bounded: one entry per peer id; the engine keeps only those of its current
    view and participants (:meth:`keep`).
    """

    __slots__ = ("_claims", "_closed", "_seen")

    def __init__(self) -> None:
        self._claims: dict[str, int] = {}  # peer -> the round it claims (clamped)
        self._seen: dict[str, int] = {}  # peer -> our closed-round count when it took part
        self._closed = 0

    def claim(self, src: str, r: int, base: int, *, latest: bool = False) -> tuple[int, bool]:
        """``src`` says it is at round ``r`` while our next round is ``base``.

        Args:
            src: the sender (authenticated by the transport).
            r: the id it named, a valid round id.
            base: our own next round; the window counts from it.
            latest: the claim replaces the sender's previous one (a beacon: where it
                is now, lower after a rewind); else only a higher one counts (a
                round packet, which may arrive late).

        Returns:
            ``(kept, within)``: the round kept for ``src`` (``r``, or the window's
            end where ``r`` is beyond it) and whether ``r`` was within the window.
        """
        limit = base + ROUND_WINDOW
        within = r <= limit
        kept = r if within else limit
        if latest or kept > self._claims.get(src, -1):
            self._claims[src] = kept
        return kept, within

    def took_part(self, peers: Iterable[str]) -> None:
        """One of our rounds closed; ``peers`` are those whose data it took."""
        self._closed += 1
        for p in peers:
            self._seen[p] = self._closed
        horizon = self._closed - PARTICIPANT_ROUNDS
        for p in [p for p, at in self._seen.items() if at <= horizon]:
            del self._seen[p]

    def participants(self) -> frozenset[str]:
        """Peers whose data we took in one of our last :data:`PARTICIPANT_ROUNDS` rounds."""
        return frozenset(self._seen)

    def electorate(self, alive: Iterable[str], me: str) -> frozenset[str]:
        """Whose claims count: our participants, or, while there are none, the
        members ``alive`` in our view (``me`` left out)."""
        if self._seen:
            return frozenset(self._seen)
        return frozenset(alive) - {me}

    def quorum(self, voters: Collection[str]) -> int:
        """The highest round that more than half of ``voters`` claim to have
        reached (a voter with no claim counts as -1); -1 without voters."""
        if not voters:
            return -1
        got = sorted((self._claims.get(p, -1) for p in voters), reverse=True)
        return got[len(got) // 2]

    def cap(self, r: int) -> None:
        """Forget every claim above ``r`` (we went back to an earlier round)."""
        for p, x in self._claims.items():
            if x > r:
                self._claims[p] = r

    def keep(self, peers: Collection[str]) -> None:
        """Drop the claims of peers outside ``peers`` and our participants."""
        for p in [p for p in self._claims if p not in peers and p not in self._seen]:
            del self._claims[p]
