"""LossWatch: when ENDs and extras go out (gossipnet/collectives/lossy/loss_watch.py)."""

from __future__ import annotations

from gossipnet.collectives.lossy.loss_watch import (
    COLD_ROUNDS,
    END_COPIES,
    QUIET_ROUNDS,
    LossWatch,
)
from gossipnet.reports import CollectiveReport


def _round(**extra: float) -> CollectiveReport:
    return CollectiveReport(round=0, method="allreduce", extra=dict(extra))


def test_quiet_rounds_stop_the_ends() -> None:
    w = LossWatch()
    assert w.end_copies([], 1) == END_COPIES  # a cold engine counts as lossy
    for _ in range(QUIET_ROUNDS):
        w.note(_round())
    assert w.end_copies([], 1) == 0


def test_a_cold_engine_is_lossy_for_its_first_round_only() -> None:
    """No round yet is no evidence; one clean round is (a join is not a burst of loss)."""
    w = LossWatch()
    for _ in range(COLD_ROUNDS):
        assert w.recent
        assert w.parity_group([], 4, always=False) == 4
        w.note(_round())
    assert not w.recent
    assert w.parity_group([], 4, always=False) == 0
    assert w.end_copies([], 1) == 0


def test_loss_in_the_first_rounds_keeps_the_extras_for_quiet_rounds() -> None:
    w = LossWatch()
    w.note(_round(arrived_behind=1.0))  # the cold round saw loss
    for _ in range(QUIET_ROUNDS - 1):
        w.note(_round())
        assert w.recent
    w.note(_round())
    assert not w.recent


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
