"""When a phase gives up on a sender (``averaging._cut.cut_time``), as a pure function.

Why on its own: the rule decides between cutting a live sender (its data goes
stale at 0% loss) and waiting for packets that were lost (time per round grows
with loss), and the end-to-end tests only see it through timing.
"""

from __future__ import annotations

import pytest

from gossipnet import Config
from gossipnet.collectives.lossy.cut import MOVED_ON_GRACE_S, cut_time
from gossipnet.collectives.lossy.round import Phase

CFG = Config()
MIN_WAIT = CFG.phase_min_wait_s
PER_PACKET = 0.001  # learned seconds per packet


def phase_with(arrivals: dict[str, list[float]]) -> Phase:
    phase = Phase(expected=set(arrivals))
    for t, src in sorted((t, src) for src, ts in arrivals.items() for t in ts):
        phase.arrived(src, t)
    return phase


def test_a_silent_sender_is_not_cut_while_others_still_deliver() -> None:
    """``a`` went quiet at 0.01 s (it is busy receiving everyone's chunks), ``b``
    delivered until 0.5 s: ``a`` is held until ``phase_min_wait_s`` after 0.5 s.
    A per-sender silence rule would have cut it at 0.11 s."""
    phase = phase_with({"a": [0.0, 0.01], "b": [0.0, 0.2, 0.5]})
    cut = cut_time(CFG, phase, "a", PER_PACKET, expected=10)
    assert cut == pytest.approx(0.5 + MIN_WAIT)
    assert cut > phase.last["a"] + MIN_WAIT


def test_once_the_whole_phase_is_silent_the_cut_comes_soon() -> None:
    """Everything that can still arrive has: the cut is ``phase_min_wait_s`` after
    the last packet of the phase, not the call's timeout."""
    phase = phase_with({"a": [0.0, 0.01], "b": [0.0, 0.02]})
    assert cut_time(CFG, phase, "a", PER_PACKET, expected=10) == pytest.approx(0.02 + MIN_WAIT)


def test_the_learned_allowance_still_holds_a_sender_with_much_to_send() -> None:
    """A sender expected to take longer than the silence window (learned seconds
    per packet x packets) keeps ``phase_deadline_factor`` x that from its first packet."""
    phase = phase_with({"a": [1.0], "b": [1.0]})
    cut = cut_time(CFG, phase, "a", PER_PACKET, expected=1000)
    assert cut == pytest.approx(1.0 + CFG.phase_deadline_factor * PER_PACKET * 1000)


def test_a_sender_that_moved_on_is_cut_after_the_grace_whatever_the_others_do() -> None:
    phase = phase_with({"a": [0.0, 0.01], "b": [0.0, 0.4]})
    phase.passed("a", 0.05)
    assert cut_time(CFG, phase, "a", PER_PACKET, expected=10) == pytest.approx(
        0.05 + MOVED_ON_GRACE_S
    )
