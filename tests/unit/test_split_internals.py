"""The internals under ``transport.faults``, ``averaging.chunks`` and ``_demo``: pinned names.

Each of those modules is split: the fault plan's values in ``transport/_fault_plan.py``,
``FlatBuffer`` in ``averaging/_flatbuffer.py``, the demo's settings and records in
``_demo_config.py`` and its data and model in ``_demo_model.py``.  These tests pin what
each new module exports and that every name stays importable, as the same object, from
the module that users, ``bench/`` and the tests import it from.
"""

from __future__ import annotations

import pickle

from gossipnet.collectives import chunks
from gossipnet.collectives import flatbuffer as _flatbuffer
from gossipnet.demo import config as _demo_config
from gossipnet.demo import harness as _demo
from gossipnet.demo import model as _demo_model
from gossipnet.transport import fault_plan as _fault_plan
from gossipnet.transport import faults


def test_internal_names_are_pinned() -> None:
    assert _fault_plan.__all__ == (
        "Crash",
        "FaultPlan",
        "FaultStats",
        "GilbertElliott",
        "Link",
        "Partition",
    )
    assert faults.__all__ == (
        "Crash",
        "FaultPlan",
        "FaultStats",
        "FaultyTransport",
        "GilbertElliott",
        "Partition",
    )
    assert _flatbuffer.__all__ == ("FlatBuffer",)
    assert _demo_config.__all__ == (
        "SPLITS",
        "STRATEGIES",
        "DemoConfig",
        "DemoResult",
        "EvalRecord",
        "LateLoss",
        "StepRecord",
    )
    assert _demo_model.__all__ == (
        "VOCAB",
        "CharLM",
        "eval_windows",
        "evaluate",
        "load_corpus",
        "lr_at",
        "sample_windows",
        "shard_stream",
    )
    assert _demo.__all__ == (
        "VOCAB",
        "DemoConfig",
        "DemoResult",
        "EvalRecord",
        "StepRecord",
        "run_demos",
    )


def test_moved_names_are_reexported_as_the_same_objects() -> None:
    for name in _fault_plan.__all__:
        assert getattr(faults, name) is getattr(_fault_plan, name)
    assert chunks.FlatBuffer is _flatbuffer.FlatBuffer
    for module in (_demo_config, _demo_model):
        for name in module.__all__:
            assert getattr(_demo, name) is getattr(module, name)


def test_a_plan_still_pickles_for_the_demo_processes() -> None:
    plan = _demo_config.DemoConfig(loss=0.1, burst=4.0).fault_plan()
    assert plan is not None
    assert pickle.loads(pickle.dumps(plan)) == plan
    # pickles (and reprs, docs) name the public module, so the private one may move
    data = pickle.dumps(plan)
    assert b"gossipnet.transport.faults" in data
    assert b"_fault_plan" not in data
    for name in faults.__all__:  # the classes (Link is a type alias)
        assert getattr(faults, name).__module__ == "gossipnet.transport.faults"


def test_the_engines_loss_policy_is_one_object() -> None:
    """``averaging/_loss_watch.py`` (split from ``allreduce.py``): END copies and
    parity follow one rule, and ``END_COPIES`` stays importable from the engine."""
    from gossipnet.collectives.lossy import engine as allreduce
    from gossipnet.collectives.lossy import loss_watch as _loss_watch
    from gossipnet.reports import CollectiveReport

    assert allreduce.END_COPIES is _loss_watch.END_COPIES
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
