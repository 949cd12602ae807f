"""The estimated step for parameter chunks whose broadcast was lost (``_stale_step``).

What it must do: measure each arrived chunk's step (mean |new - old|), move a
missed chunk by the last step measured for it against the sign of this peer's
own gradient, leave our own chunks and never-measured chunks alone, and forget
what it knew when the chunk layout changes.
"""

from __future__ import annotations

import torch

from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.stale_step import StaleStep

CHUNK = 64  # bytes: 16 float32 per chunk
N = 64  # 4 chunks; "a" owns chunks 0-1, "b" chunks 2-3


def one_round(
    stale: StaleStep, param: torch.Tensor, grad: torch.Tensor, arrive: dict[int, torch.Tensor]
) -> int:
    """One round on peer "a": chunks in ``arrive`` come in with those values."""
    chunk = CHUNK // 4 * param.element_size()  # 16 elements, whatever the dtype
    rnd = Round(0, "a", ("a", "b"), [grad], [param], 1.0, [chunk])
    rnd.step_mag = StaleStep.fresh(rnd)
    for c, values in arrive.items():
        StaleStep.measure(rnd, 0, c, values)
        rnd.plans[0].view(param, c).copy_(values)
        rnd.got[0][c] = True
    return stale.apply(rnd)


def test_a_missed_chunk_steps_by_its_last_measured_size_against_our_gradient() -> None:
    stale = StaleStep()
    param = torch.zeros(N)
    grad = torch.ones(N)
    grad[40:48] = -1.0  # half of chunk 2 points the other way
    # round 1: both of b's chunks arrive, each moved by 0.5 (chunk 2) and 0.25 (chunk 3)
    new = {2: torch.full((16,), -0.5), 3: torch.full((16,), 0.25)}
    assert one_round(stale, param, grad, new) == 0  # nothing missed
    before = param.clone()
    # round 2: chunk 2 is lost, chunk 3 arrives
    stepped = one_round(stale, param, grad, {3: torch.full((16,), 0.5)})
    assert stepped == 1
    want = before[32:48] - 0.5 * torch.sign(grad[32:48])
    torch.testing.assert_close(param[32:48], want)  # -1.0 where grad > 0, 0.0 where < 0
    assert torch.equal(param[:32], before[:32])  # our own chunks: untouched
    assert torch.equal(param[48:], torch.full((16,), 0.5))  # arrived: as sent


def test_a_chunk_never_seen_to_arrive_and_a_zero_gradient_stay_put() -> None:
    stale = StaleStep()
    param = torch.arange(N, dtype=torch.float32)
    kept = param.clone()
    assert one_round(stale, param, torch.ones(N), {}) == 0  # no step measured yet
    assert torch.equal(param, kept)
    one_round(stale, param, torch.ones(N), {2: kept[32:48] + 1.0, 3: kept[48:] + 1.0})
    after = param.clone()
    one_round(stale, param, torch.zeros(N), {})  # a non-finite gradient was zeroed
    assert torch.equal(param, after)


def test_a_new_chunk_layout_forgets_the_measured_steps() -> None:
    stale = StaleStep()
    param = torch.zeros(N)
    one_round(stale, param, torch.ones(N), {2: torch.ones(16), 3: torch.ones(16)})
    other = torch.zeros(2 * N)  # another model: 8 chunks
    rnd = Round(1, "a", ("a", "b"), [torch.ones(2 * N)], [other], 1.0, [CHUNK])
    rnd.step_mag = StaleStep.fresh(rnd)
    assert stale.apply(rnd) == 0
    assert torch.equal(other, torch.zeros(2 * N))


def test_half_precision_steps_are_measured_without_overflow() -> None:
    """A float16 chunk's |step| sum is far past 65504: measured in float32."""
    stale = StaleStep()
    param = torch.zeros(N, dtype=torch.float16)
    grad = torch.ones(N, dtype=torch.float16)
    big = torch.full((16,), 5000.0, dtype=torch.float16)  # sum of |step| 80000
    one_round(stale, param, grad, {2: big, 3: big})
    assert one_round(stale, param, grad, {3: big * 2}) == 1
    assert torch.equal(param[32:48], torch.zeros(16, dtype=torch.float16))  # 5000 - 5000


def test_rows_measured_together_equal_one_by_one() -> None:
    """measure_rows (a drain's stacked broadcast chunks) records what measure does per
    chunk; a non-finite step is left unmeasured in both."""
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(N, generator=gen)
    grad = torch.randn(N, generator=gen)
    new = torch.randn(2, 16, generator=gen)
    new[1, 4] = float("inf")
    one = Round(0, "a", ("a", "b"), [grad], [param.clone()], 1.0, [CHUNK])
    many = Round(0, "a", ("a", "b"), [grad], [param.clone()], 1.0, [CHUNK])
    one.step_mag, many.step_mag = StaleStep.fresh(one), StaleStep.fresh(many)
    for row, c in enumerate((2, 3)):
        StaleStep.measure(one, 0, c, new[row])
    StaleStep.measure_rows(many, 0, torch.tensor([2, 3]), new)
    torch.testing.assert_close(many.step_mag[0], one.step_mag[0], equal_nan=True)
    assert not bool(torch.isnan(many.step_mag[0][2]))
    assert bool(torch.isnan(many.step_mag[0][3]))
