"""Behaviour that must survive moving code between modules.

A fault plan pickles (the demo sends it to its processes) under the public
module's name, so the private layout behind it may change; the lossy engine's
loss policy is one object.  Which private module holds a name is not pinned.
"""

from __future__ import annotations

import pickle

from gossipnet.demo import config as _demo_config
from gossipnet.transport import faults


def test_a_plan_still_pickles_for_the_demo_processes() -> None:
    plan = _demo_config.DemoConfig(loss=0.1, burst=4.0).fault_plan()
    assert plan is not None
    assert pickle.loads(pickle.dumps(plan)) == plan
    # pickles (and reprs, docs) name the public module, so the one behind it may move
    data = pickle.dumps(plan)
    assert b"gossipnet.transport.faults" in data
    assert b"fault_plan" not in data
    for name in faults.__all__:  # the classes (Link is a type alias)
        assert getattr(faults, name).__module__ == "gossipnet.transport.faults"


def test_the_engines_loss_policy_is_one_object() -> None:
    """END copies and parity follow one rule (``LossWatch``)."""
    from gossipnet.collectives.lossy import loss_watch as _loss_watch
    from gossipnet.reports import CollectiveReport

    watch = _loss_watch.LossWatch()
    assert watch.recent  # cold: counts as lossy
    assert watch.end_copies(["b"], 1) == _loss_watch.END_COPIES
    assert watch.parity_group(["b"], 3, always=False) == 3
    for _ in range(_loss_watch.QUIET_ROUNDS):
        watch.note(CollectiveReport())
    assert not watch.recent
    assert watch.end_copies(["b"], 1) == 0  # quiet: data alone completes a sender
    assert watch.end_copies(["b"], 2) == _loss_watch.END_COPIES  # copies need their ENDs
    assert watch.parity_group(["b"], 3, always=False) == 0
    assert watch.parity_group(["b"], 3, always=True) == 3
    watch.peer_flag("b", True)  # a peer saw loss on our links
    assert watch.parity_group(["b"], 3, always=False) == 3
    assert watch.parity_group(["c"], 3, always=False) == 0  # not in this round
    watch.note(CollectiveReport(packets_lost=1))
    watch.peer_flag("b", False)
    assert watch.end_copies(["c"], 1) == _loss_watch.END_COPIES
