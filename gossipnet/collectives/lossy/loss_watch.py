"""What an all-reduce engine knows about recent loss, and what it spends on it.

Split from :mod:`gossipnet.collectives.lossy.engine`: one place owns the rule that
turns "loss was seen lately" into extra packets.  Loss shows at receivers, so
a sender learns of loss on its outgoing links from its peers: each peer flags
"I saw loss recently" on its END markers and heartbeats.  While we or any
participant saw loss within the last ``QUIET_ROUNDS`` rounds, ENDs go out in
``END_COPIES`` copies and parity packets (``Config.parity_group``) are sent;
on a quiet network no END (where data was withheld, one) and no parity, so a
clean network pays nothing.
A cold engine counts as lossy for its first ``COLD_ROUNDS`` round(s): with no
round of its own yet there is no evidence either way, and one clean round of a
collective (thousands of packets, none lost) is that evidence.  Why not
``QUIET_ROUNDS`` as after seen loss: that hysteresis is there because loss comes
in bursts; a join is not a burst, and four cold rounds of parity cost a
quarter more packets each (``bench/testbed.py``: 3920 against 3139 packets per
17 MB step, the first four steps of every run).
"""

from __future__ import annotations

from collections.abc import Iterable

from gossipnet.reports import CollectiveReport

__all__ = ("COLD_ROUNDS", "END_COPIES", "QUIET_ROUNDS", "LossWatch")

END_COPIES = 5  # all lost with p^5: 0.2% per link at 30% loss
#: Loss-free rounds (ours, and every peer's as their flags say) before the extras stop.
QUIET_ROUNDS = 4
#: A new engine's first rounds, lossy until they show otherwise (at most QUIET_ROUNDS).
COLD_ROUNDS = 1


class LossWatch:
    """Our own recent loss (per round) and our peers' flags."""

    def __init__(self) -> None:
        self.rounds_run = 0
        # ``rounds_run`` when we last saw loss; the start value makes the first
        # COLD_ROUNDS rounds count as lossy
        self.loss_at = COLD_ROUNDS - QUIET_ROUNDS
        self.lossy_peers: set[str] = set()
        # ``rounds_run`` when a round of ours last sent copies (``Config.compressed_copies``)
        self.copies_at = -QUIET_ROUNDS

    def note(self, report: CollectiveReport) -> None:
        """Remember whether the round that produced ``report`` saw loss."""
        self.rounds_run += 1
        if report.extra.get("copies_sent", 0.0):
            self.copies_at = self.rounds_run
        if (
            report.packets_lost
            or report.timed_out
            or report.chunks_stale
            or report.extra.get("arrived_behind", 0.0)  # loss that copies repaired
        ):
            self.loss_at = self.rounds_run

    @property
    def recent(self) -> bool:
        """Whether we saw loss within the last ``QUIET_ROUNDS`` rounds: our flag."""
        return self.rounds_run - self.loss_at < QUIET_ROUNDS

    def peer_flag(self, peer: str, lossy: bool) -> None:
        """A peer's flag, from its END markers or heartbeats."""
        if lossy:
            self.lossy_peers.add(peer)
        else:
            self.lossy_peers.discard(peer)

    def lossy(self, others: Iterable[str]) -> bool:
        """Whether we or any of ``others`` saw loss recently."""
        return self.recent or any(p in self.lossy_peers for p in others)

    def end_copies(self, others: Iterable[str], redundancy: int) -> int:
        """END copies for a round with ``others``: ``END_COPIES``, or 0 when all is quiet.

        Why quiet means none: ENDs only matter to a receiver that lost data (all of
        a sender's data completes it without one), and on a 1M-element all-reduce
        they were half of all packets (measured: a tenth of the CPU of a round).  A
        sender that withholds data a receiver expects (an all-gather chunk with no
        weight) still sends one.  If loss starts on a quiet network, a receiver
        that lost data cuts the sender shortly after it moves on (its next phase's
        packets) or at its learned deadline, for that round only; its loss flag
        then brings the copies back.  ENDs also go on for ``QUIET_ROUNDS`` rounds after
        our last round with copies: copies hide loss (a copy that stands in for the
        only packet of a stream looks like the original), so "quiet" may be wrong
        then, and the first round without copies must not end on a cut.
        """
        copied = self.rounds_run - self.copies_at < QUIET_ROUNDS
        return END_COPIES if redundancy > 1 or copied or self.lossy(others) else 0

    def parity_group(self, others: Iterable[str], k: int, always: bool) -> int:
        """This round's parity group size: ``k`` while loss is seen (or ``always``)."""
        return k if k and (always or self.lossy(others)) else 0
