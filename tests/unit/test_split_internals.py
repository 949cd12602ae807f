"""The internals under ``transport.faults``, ``averaging.chunks`` and ``_demo``: pinned names.

Each of those modules is split: the fault plan's values in ``transport/_fault_plan.py``,
``FlatBuffer`` in ``averaging/_flatbuffer.py``, the demo's settings and records in
``_demo_config.py`` and its data and model in ``_demo_model.py``.  These tests pin what
each new module exports and that every name stays importable, as the same object, from
the module that users, ``bench/`` and the tests import it from.
"""

from __future__ import annotations

import pickle

from gossipnet import _demo, _demo_config, _demo_model
from gossipnet.averaging import _flatbuffer, chunks
from gossipnet.transport import _fault_plan, faults


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
