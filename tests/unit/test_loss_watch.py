"""LossWatch: when ENDs and extras go out (gossipnet/collectives/lossy/loss_watch.py)."""

from __future__ import annotations

from gossipnet.collectives.lossy.loss_watch import END_COPIES, QUIET_ROUNDS, LossWatch
from gossipnet.reports import CollectiveReport


def _round(**extra: float) -> CollectiveReport:
    return CollectiveReport(round=0, method="allreduce", extra=dict(extra))


def test_quiet_rounds_stop_the_ends() -> None:
    w = LossWatch()
    assert w.end_copies([], 1) == END_COPIES  # a cold engine counts as lossy
    for _ in range(QUIET_ROUNDS):
        w.note(_round())
    assert w.end_copies([], 1) == 0


def test_a_copy_that_stood_in_for_a_lost_packet_is_loss() -> None:
    w = LossWatch()
    for _ in range(QUIET_ROUNDS):
        w.note(_round())
    w.note(_round(arrived_behind=1.0))
    assert w.recent


def test_ends_outlast_the_copies_that_may_have_hidden_loss() -> None:
    """Copies hide a lost one-packet stream (its copy looks like the original), so the
    rounds right after the last one with copies keep their ENDs: without them a loss
    there ends on a cut (a phase reported timed out) instead of on its END."""
    w = LossWatch()
    for _ in range(QUIET_ROUNDS):
        w.note(_round(copies_sent=3.0))  # no loss seen: the copies may have hidden it
    assert not w.recent
    for _ in range(QUIET_ROUNDS - 1):
        w.note(_round())
        assert w.end_copies([], 1) == END_COPIES
    w.note(_round())
    assert w.end_copies([], 1) == 0
