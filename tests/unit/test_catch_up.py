"""Adam's catch-up step for sparse, error-fed gradients (``training._catch_up``) and
the ages it needs (``collectives.compress.staleness``).

What must hold: age 1 everywhere is stock Adam/AdamW; a value that stands for k
rounds moves its element as k rounds of its mean would (stock Adam moves it
about sqrt(k) times less); elements not sent keep their state; ages are
counted per element from the rounds they travelled, bounded.
"""

from __future__ import annotations

import pytest
import torch

from gossipnet.collectives.compress.staleness import MAX_AGE, STALE, Staleness
from gossipnet.collectives.compress.topk import block_mean
from gossipnet.runtime.flatbuffer import FlatBuffer
from gossipnet.training._catch_up import catch_up_step, supports
from gossipnet.training._stepping import as_optimizer_step


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_age_one_everywhere_is_stock_adam(cls: type[torch.optim.Optimizer]) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(3, 5, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    stock = cls([a], lr=0.01, weight_decay=0.1)
    ours = cls([b], lr=0.01, weight_decay=0.1)
    for _ in range(6):
        g = torch.randn(3, 5, generator=gen)
        a.grad = g.clone()
        stock.step()
        catch_up_step(b, g, torch.ones(3, 5), ours.state[b], ours.param_groups[0])
    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours.state[b][key], stock.state[a][key])
    # the state is torch's own: it loads into the stock optimizer
    stock.load_state_dict(ours.state_dict())


def _adam_moves(grads: list[torch.Tensor]) -> float:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return -float(p.detach())


@pytest.mark.parametrize("k", [4, 16])
def test_a_value_of_k_rounds_moves_as_k_rounds(k: int) -> None:
    """Constant gradient 1: dense Adam moves k * lr over k rounds; the catch-up step
    of one k-fold value does the same; stock Adam given the k-fold value once and
    zeros after moves about sqrt(k) times less (the problem being fixed)."""
    dense = _adam_moves([torch.ones(1)] * k)
    stock = _adam_moves([torch.full((1,), float(k))] + [torch.zeros(1)] * (k - 1))
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=0.01)
    catch_up_step(
        p, torch.full((1,), float(k)), torch.full((1,), float(k)), opt.state[p], opt.param_groups[0]
    )
    ours = -float(p.detach())
    assert ours == pytest.approx(dense, rel=0.02)
    assert stock < 0.75 * dense


def test_elements_not_sent_keep_value_and_state() -> None:
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
    age = torch.tensor([0, 1, 0, 3, 0, 0], dtype=torch.float32)
    catch_up_step(p, torch.ones(6), age, opt.state[p], opt.param_groups[0])
    before = p.detach().clone()
    m = opt.state[p]["exp_avg"].clone()
    catch_up_step(
        p,
        torch.full((6,), 5.0),
        torch.tensor([0, 0, 0, 0, 0, 2.0]),
        opt.state[p],
        opt.param_groups[0],
    )
    unchanged = [0, 1, 2, 3, 4]
    assert torch.equal(p.detach()[unchanged], before[unchanged])
    assert torch.equal(opt.state[p]["exp_avg"][unchanged], m[unchanged])
    assert float(p.detach()[5]) < float(before[5])
    assert float(opt.state[p]["step"]) == 2.0


def test_decoupled_decay_reaches_every_element() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.5)
    catch_up_step(p, torch.zeros(4), torch.zeros(4), opt.state[p], opt.param_groups[0])
    torch.testing.assert_close(p.detach(), torch.full((4,), 0.95))


def test_only_plain_adam_is_supported() -> None:
    w = [torch.nn.Parameter(torch.zeros(2))]
    assert supports(torch.optim.AdamW(w))
    assert supports(torch.optim.Adam(w))
    assert not supports(torch.optim.Adam(w, amsgrad=True))
    assert not supports(torch.optim.SGD(w, lr=0.1, momentum=0.9))
    assert not supports(torch.optim.Adamax(w))


def test_ages_count_rounds_since_an_element_last_travelled() -> None:
    st = Staleness([10])
    st.begin()
    st.own(0, 4, 6, torch.tensor([4, 5]), now=1)  # first time: since the session began
    assert st.shard_ages(0, 4, 6) is not None
    assert st.shard_ages(0, 4, 6).tolist() == [1, 1, 0, 0, 0, 0]  # type: ignore[union-attr]
    st.mark(0, torch.tensor([6]), now=2)  # sent as a sender (another owner then)
    st.begin()
    st.own(0, 4, 6, torch.tensor([4, 6, 9]), now=5)
    assert st.shard_ages(0, 4, 6).tolist() == [4, 0, 3, 0, 0, 5]  # type: ignore[union-attr]
    assert st.shard_ages(0, 0, 6) is None  # another shard map: unknown, not guessed
    st.begin()
    st.own(0, 4, 6, torch.tensor([7]), now=5 + 10 * MAX_AGE)
    assert st.shard_ages(0, 4, 6).tolist()[3] == MAX_AGE  # type: ignore[union-attr]


def test_applied_ages_are_tracked_only_on_request() -> None:
    st = Staleness([8])
    st.apply(0, 0, 4, torch.tensor([1]), torch.tensor([5.0]))
    assert st.applied == []
    st.track_applied()
    st.begin()
    # chunk [0, 4) arrived with ages 3 at elements 1 and 2; chunk [4, 8) was lost
    st.apply(0, 0, 4, torch.tensor([1, 2]), torch.tensor([3.0, 3.0]))
    assert st.applied[0].tolist() == [0, 3, 3, 0, STALE, STALE, STALE, STALE]
    st.begin()
    assert bool((st.applied[0] == STALE).all())  # a round's ages are spent at the next


def test_block_mean_and_flat_split() -> None:
    assert block_mean(torch.arange(5, dtype=torch.float32), 2).tolist() == [0.5, 2.5, 4.0]
    a, b = torch.zeros(2, 3), torch.zeros(4)
    flat = FlatBuffer([a, b])
    assert flat.segments() == [[0, 6]]  # where each tensor starts (Accordion's layers)
    views = flat.split([torch.arange(10, dtype=torch.float32)])
    assert views[0].shape == (2, 3)
    assert views[1].tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="lengths"):
        flat.split([torch.zeros(3)])


def test_a_step_in_place_of_opt_step_keeps_its_bookkeeping() -> None:
    """``as_optimizer_step`` runs the pre-hooks, the update, then the post-hooks, in
    order, with ``opt.step()``'s arguments, and leaves the marks torch's LR schedulers
    read: ``_opt_called`` and, under the older counting wrapper, ``_step_count``."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([w], lr=0.1)
    seen: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kw: seen.append(f"pre {args[0] is o} {kw}"))
    opt.register_step_post_hook(lambda o, args, kw: seen.append(f"post {args[0] is o}"))
    step = opt.step

    def counting(*args: object, **kwargs: object) -> object:  # torch < 2.2's scheduler wrapper
        return step(*args, **kwargs)

    counting._with_counter = True  # type: ignore[attr-defined]
    opt.step = counting  # type: ignore[method-assign]
    opt._step_count = 0  # type: ignore[attr-defined]
    as_optimizer_step(opt, lambda: seen.append("update"))
    assert seen == ["pre True {}", "update", "post True"]
    assert opt._opt_called  # type: ignore[attr-defined]
    assert opt._step_count == 1  # type: ignore[attr-defined]
