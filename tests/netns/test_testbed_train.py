"""End to end on a real lossy network: 4 hosts, gossipnet's UDP backend, 10% kernel loss.

Why on the testbed and not on FaultPlan: here the kernel drops frames on the
switch's forwarding path, so nothing in gossipnet knows which packet died; the
claim under test is that training does not care.

The task (``gossipnet.testbed.train``) is a student MLP learning a sharp
random teacher; the compared number is the exact expected cross-entropy on
fixed inputs.  Why 1% is a meaningful tolerance there: lossless runs with
different data seeds end within ~0.3% of each other, while the lossless run
at 60% of its steps is still > 2% above its final loss (asserted below), so
the band is wider than the noise and narrower than losing 40% of the run.

Runtime: ~20 s per 4-peer run on 2 cores (start-up ~6 s of it); every wait has
a deadline, and teardown is asserted complete.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gossipnet.testbed import Testbed, measure_links, unavailable_reason
from gossipnet.testbed.train import TrainSpec, train_peer
from gossipnet.testing import wait_until_sync

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

HOSTS = 4
STEPS = 300
LOSS = 0.10
TOLERANCE = 0.01  # relative to the lossless final loss; see the module docstring
RUN_DEADLINE_S = 120.0
# failure detection in 2.5 s (default 3 s); not shorter: under load from other jobs on
# the 2 cores a live peer can miss its heartbeats for over a second
FAST = {"heartbeat_interval_s": 0.25, "failure_timeout_s": 2.5, "collective_timeout_s": 3.0}


def _train(tb: Testbed, *, progress: Path | None = None, cut: int | None = None) -> list[Any]:
    """Run one peer per host; with ``cut``, cut that host once rank 0 passed STEPS/3."""
    peers = tuple(h.url(7000) for h in tb.hosts)
    tasks = [
        h.start(
            train_peer,
            TrainSpec(
                peers=peers,
                rank=i,
                steps=STEPS,
                config=FAST,
                run_timeout_s=RUN_DEADLINE_S - 20,
                progress_path=str(progress) if i == 0 and progress else None,
            ),
        )
        for i, h in enumerate(tb.hosts)
    ]
    if cut is not None:
        assert progress is not None

        def progressed() -> bool:
            assert not any(t.done() for t in tasks), [t.stderr() for t in tasks if t.done()]
            return progress.exists() and int(progress.read_text() or 0) >= STEPS // 3

        wait_until_sync(progressed, RUN_DEADLINE_S, interval_s=0.05, what="training progress")
        tb.cut(cut)
    return [t.result(RUN_DEADLINE_S) for t in tasks]


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    tb = Testbed(hosts=HOSTS)
    with tb:
        yield tb
    assert not tb.leftovers()


@pytest.fixture(scope="module")
def lossless(bed: Testbed) -> list[Any]:
    bed.set_loss(None, 0.0)
    return _train(bed)


@pytest.mark.timeout(240)
def test_training_under_10pct_kernel_loss_matches_lossless(
    bed: Testbed, lossless: list[Any]
) -> None:
    ref = statistics.mean(r["final_loss"] for r in lossless)
    curve = dict(lossless[0]["evals"])
    assert curve[int(STEPS * 0.6) // 25 * 25] > (1 + 2 * TOLERANCE) * ref, curve  # band is tight
    # the reference is (nearly) lossless: the kernel drops nothing; what gossipnet may
    # still miss is a sender cut for being CPU-starved (2 shared cores, load from others)
    lost0 = sum(r["packets_lost"] for r in lossless)
    assert lost0 <= 0.02 * (lost0 + sum(r["packets_received"] for r in lossless))

    bed.set_loss(None, LOSS)
    ring = [(i, (i + 1) % HOSTS) for i in range(HOSTS)]
    for m in measure_links(bed, ring, count=3000):  # the links lose what we set, first
        assert m.ok, m
    frames_before = bed.counters()
    lossy = _train(bed)
    counters = bed.counters()

    assert all(r["steps_done"] == STEPS and not r["timed_out"] for r in lossy)
    finals = [r["final_loss"] for r in lossy]
    assert abs(statistics.mean(finals) - ref) <= TOLERANCE * ref, (finals, ref)
    # the loss really hit training: ~10% of gossipnet's data packets never arrived
    lost = sum(r["packets_lost"] for r in lossy)
    expected = lost + sum(r["packets_received"] for r in lossy)
    assert 0.05 < lost / expected < 0.15, (lost, expected)
    dropped = sum(
        counters[f"h{i} loss-out"] - frames_before.get(f"h{i} loss-out", 0) for i in range(HOSTS)
    )
    assert dropped > 1000
    for h in bed.hosts:  # one chunk = one frame: nothing was IP-fragmented
        assert h.snmp()["Ip"]["FragCreates"] == 0


@pytest.mark.timeout(180)
def test_host_cut_mid_run_leaves_the_others_training(bed: Testbed, tmp_path: Path) -> None:
    bed.set_loss(None, LOSS)
    victim = HOSTS - 1
    try:
        results = _train(bed, progress=tmp_path / "progress", cut=victim)
    finally:
        bed.heal(victim)
    survivors = [f"h{i}" for i in range(HOSTS) if i != victim]
    for r in results[:victim]:
        assert r["steps_done"] == STEPS, r
        assert not r["timed_out"]
        # the cut host is out of the last round and of the alive set; who else was in
        # them depends on when each survivor finished (one that finished first may have
        # closed already: seen in CI, a survivor's last round alone), so no more is said
        assert f"h{victim}" not in r["participants_last"]
        assert set(r["participants_last"]) <= set(survivors), r["participants_last"]
        assert f"h{victim}" not in r["alive_end"]
        assert f"h{r['rank']}" in r["alive_end"]
        evals = dict(r["evals"])
        at_cut = evals[min(s for s in evals if s >= STEPS // 3)]
        assert r["final_loss"] < 0.9 * at_cut, r["evals"]  # it kept learning after the cut
    # the cut host trains on alone and finishes too: nothing waits forever
    assert results[victim]["steps_done"] == STEPS
    assert results[victim]["alive_end"] == [f"h{victim}"]
