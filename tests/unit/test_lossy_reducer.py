"""The reduce-scatter's arithmetic alone (``ShardReducer``): no node, no loop, no clock."""

from __future__ import annotations

import random

import pytest
import torch

from gossipnet.collectives.lossy.reducer import ShardReducer

CHUNK = 4
#: Everyone the tests' reducers take parts from.
SENDERS = ("b", "c", "d", "e", *(f"p{j}" for j in range(1, 8)))


def _reducer(own: torch.Tensor, weight: float = 1.0, first: int = 0) -> ShardReducer:
    n = -(-own.numel() // CHUNK)
    return ShardReducer(own.clone(), range(first, first + n), CHUNK, weight, SENDERS)


def _parts(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.split(CHUNK))


def test_mean_conserved_without_loss() -> None:
    xs = [torch.randn(10, dtype=torch.float64) for _ in range(4)]
    red = _reducer(xs[0])
    for j, x in enumerate(xs[1:], 1):
        for c, part in enumerate(_parts(x)):
            assert red.accumulate(f"p{j}", c, part, 1.0) is None
    avg = red.average(xs[0])
    torch.testing.assert_close(avg, torch.stack(xs).mean(0))
    assert red.contributors.tolist() == [4, 4, 4]


def test_weights_and_contributors_per_chunk_under_loss() -> None:
    """Each chunk divides by the weight that arrived for it: lost parts cost no bias."""
    own = torch.full((12,), 1.0, dtype=torch.float64)
    red = _reducer(own, weight=2.0)
    four = torch.full((4,), 4.0, dtype=torch.float64)
    red.accumulate("b", 0, four, 1.0)
    red.accumulate("c", 0, four + 3, 3.0)
    red.accumulate("c", 2, four + 1, 3.0)  # chunk 1: only ours arrived
    avg = red.average(own)
    assert avg[:4].tolist() == [(2 * 1 + 4 + 3 * 7) / 6] * 4
    assert avg[4:8].tolist() == [1.0] * 4
    assert avg[8:].tolist() == [(2 * 1 + 3 * 5) / 5] * 4
    assert red.contributors.tolist() == [3, 1, 2]
    assert red.weights.tolist() == [6.0, 2.0, 5.0]


@pytest.mark.parametrize("p", [0.1, 0.4])
def test_unbiased_under_random_loss(p: float) -> None:
    """ALGORITHMS.md 1.3 (1, 2): peers whose gradients share one mean, Bernoulli(p) loss
    per part: the estimates average to that mean; zero-fill / N is low by about (1 - p)."""
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    mu, peers, trials = 3.0, 8, 2000
    ours, zero_fill = [], []
    for _ in range(trials):
        grads = mu + torch.randn(peers, CHUNK, generator=gen, dtype=torch.float64)
        red = _reducer(grads[0])
        delivered = grads[0].clone()
        for j in range(1, peers):
            if rng.random() >= p:
                assert red.accumulate(f"p{j}", 0, grads[j], 1.0) is None
                delivered += grads[j]
        ours.append(float(red.average(grads[0]).mean()))
        zero_fill.append(float(delivered.mean()) / peers)
    est = sum(ours) / trials
    biased = sum(zero_fill) / trials
    assert abs(est - mu) < 0.05, est
    expected_low = mu * (1 + (peers - 1) * (1 - p)) / peers
    assert abs(biased - expected_low) < 0.05, (biased, expected_low)


def test_duplicate_late_nan_and_foreign_parts_refused() -> None:
    own = torch.zeros(8)
    red = _reducer(own, first=10)
    part = torch.ones(CHUNK)
    assert red.accumulate("b", 10, part, 1.0) is None
    assert red.has("b", 10)
    assert not red.has("b", 11)
    assert red.accumulate("b", 10, part, 1.0) == "duplicate"
    assert red.accumulate("b", 12, part, 1.0) == "not_owner"  # outside the shard
    assert red.accumulate("c", 11, torch.tensor([1.0, float("nan"), 0.0, 0.0]), 1.0) == (
        "non_finite"
    )
    assert red.accumulate("c", 11, torch.ones(3), 1.0) == "layout_mismatch"
    assert red.accumulate("c", 11, part, -1.0) == "bad_weight"
    assert red.accumulate("c", 11, part, float("inf")) == "bad_weight"
    assert red.contributors.tolist() == [2, 1]  # only b's first part counted
    avg = red.average(own)
    assert avg.tolist() == [0.5] * 4 + [0.0] * 4
    assert red.accumulate("c", 11, part, 1.0) == "late"  # averaged already
    assert red.contributors.tolist() == [2, 1]


def test_failed_sender_removed() -> None:
    """A sender declared failed adds nothing more; what it delivered before stays."""
    own = torch.zeros(8)
    red = _reducer(own)
    assert red.accumulate("b", 0, torch.full((4,), 2.0), 1.0) is None
    red.on_sender_failed("b")
    assert red.accumulate("b", 1, torch.full((4,), 2.0), 1.0) == "failed_sender"
    assert red.accumulate("c", 1, torch.full((4,), 4.0), 1.0) is None
    avg = red.average(own)
    assert avg.tolist() == [1.0] * 4 + [2.0] * 4
    assert red.contributors.tolist() == [2, 2]


def test_zero_weight_keeps_own_values() -> None:
    """No weight arrived for a chunk (ours is 0): it keeps our values, never 0/0."""
    own = torch.arange(6.0)
    red = _reducer(own, weight=0.0)
    red.accumulate("b", 1, torch.full((2,), 9.0), 2.0)  # the short last chunk
    avg = red.average(own)
    assert avg[:4].tolist() == own[:4].tolist()
    assert avg[4:].tolist() == [9.0, 9.0]
    assert red.weights.tolist() == [0.0, 2.0]


def test_bad_construction_raises() -> None:
    with pytest.raises(ValueError, match="weight"):
        ShardReducer(torch.zeros(4), range(1), CHUNK, float("nan"), SENDERS)
    with pytest.raises(ValueError, match="chunks"):
        ShardReducer(torch.zeros(4), range(2), CHUNK, 1.0, SENDERS)
    with pytest.raises(ValueError, match="store"):
        ShardReducer(torch.zeros(4), range(1), CHUNK, 1.0, SENDERS, store=torch.zeros(4))


def _random_parts(seed: int, dtype: torch.dtype) -> list[tuple[str, int, torch.Tensor, float]]:
    """Parts with every refusal among them: duplicates, foreign chunks, short, NaN, bad weights."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for i in range(60):
        c = rng.randrange(10, 14)  # 13 is not ours
        n = 2 if c == 12 and rng.random() < 0.7 else CHUNK  # chunk 12 is the short last
        values = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) * 1e3
        if i % 7 == 3:
            values[rng.randrange(n)] = rng.choice([float("nan"), float("inf")])
        weight = rng.choice([1.0, 1.0, 0.37, 2.5, 0.0, -1.0, float("inf")])
        parts.append((rng.choice("bcde"), c, values, weight))
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_batch_is_bit_identical_to_one_by_one(seed: int, dtype: torch.dtype) -> None:
    """accumulate_batch: the same sums bit for bit, the same refusals, the same counts,
    whatever the batch boundaries (a sender failed halfway through)."""
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    own = torch.randn(10, generator=torch.Generator().manual_seed(99), dtype=acc_dtype)
    one, many = _reducer(own, 0.5, first=10), _reducer(own, 0.5, first=10)
    parts = _random_parts(seed, dtype)
    cut = random.Random(seed).randrange(len(parts))
    want = [one.accumulate(*p) for p in parts[:cut]]
    one.on_sender_failed("e")
    want += [one.accumulate(*p) for p in parts[cut:]]
    got: list[str | None] = []
    rng = random.Random(seed + 1)
    i = 0
    while i < len(parts):
        size = rng.randrange(1, 20)
        if i < cut < i + size:
            size = cut - i
        got += many.accumulate_batch(parts[i : i + size])
        i += size
        if i == cut:
            many.on_sender_failed("e")
    assert got == want
    assert {r for r in want} >= {None, "duplicate", "not_owner", "non_finite", "bad_weight"}
    assert torch.equal(one.acc, many.acc)
    assert torch.equal(one.weights, many.weights)
    assert torch.equal(one.contributors, many.contributors)
    assert torch.equal(one.average(own), many.average(own))
    assert many.accumulate_batch(parts[:3]) == ["late"] * 3


def test_large_chunks_are_added_one_call_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks above STACK_MAX_BYTES are never stacked (a stack is one more pass over
    every received byte); the sums and refusals equal one-by-one accumulation."""
    from gossipnet.collectives import chunks

    step = chunks.STACK_MAX_BYTES // 4 * 2  # float32: twice the stacking limit
    gen = torch.Generator().manual_seed(5)
    own = torch.randn(3 * step, generator=gen)
    one = ShardReducer(own.clone(), range(3), step, 1.0, SENDERS)
    many = ShardReducer(own.clone(), range(3), step, 1.0, SENDERS)
    parts = [
        (s, c, torch.randn(step, generator=gen), w)
        for s, w in (("b", 1.0), ("c", 0.5))
        for c in range(3)
    ]
    parts[4][2][7] = float("nan")
    want = [one.accumulate(*p) for p in parts]

    def no_stack(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("large chunks must not be stacked")

    monkeypatch.setattr(torch, "stack", no_stack)
    assert many.accumulate_batch(parts) == want == [None, None, None, None, "non_finite", None]
    assert torch.equal(one.acc, many.acc)
    assert torch.equal(one.weights, many.weights)


@pytest.mark.parametrize("seed", range(4))
def test_a_given_block_is_bit_identical_to_one_by_one(seed: int) -> None:
    """``stacked``: the caller's block of full-length rows (parts without values) adds
    and refuses exactly as the parts one by one, a NaN row and a duplicate included."""
    own = torch.randn(10, generator=torch.Generator().manual_seed(7))
    one, many = _reducer(own, first=10), _reducer(own, first=10)
    parts = [p for p in _random_parts(seed, torch.float32) if p[2].numel() == CHUNK]
    probe = _reducer(own, first=10)
    taken = [i for i, p in enumerate(parts) if probe.accumulate(*p) is None]
    parts[taken[1]][2][0] = float("nan")  # an accepted part made non-finite
    parts.append(parts[taken[0]])  # a duplicate
    want = [one.accumulate(*p) for p in parts]
    members = [i for i, p in enumerate(parts) if i % 3 != 2]  # the rest keep their values
    block = torch.stack([parts[i][2] for i in members])
    lean = [(s, c, None if i in members else v, w) for i, (s, c, v, w) in enumerate(parts)]
    assert many.accumulate_batch(lean, stacked=(block, members)) == want
    assert {"non_finite", "duplicate", None} <= set(want)
    assert torch.equal(one.acc, many.acc)
    assert torch.equal(one.weights, many.weights)
    assert torch.equal(one.contributors, many.contributors)
