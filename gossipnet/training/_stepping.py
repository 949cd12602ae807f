"""A step that replaces ``opt.step()`` keeps the bookkeeping of ``opt.step()``.

Why: gossipnet steps the user's optimizer in ways ``opt.step()`` cannot express:
Adam's catch-up step for sparse, error-fed gradients (:mod:`._catch_up`), and the
all-reduce strategy's sharded step, where each peer steps only the shard it owns
(:mod:`._shards`).  torch ties two things to ``opt.step()`` that users rely on: the
step hooks (``register_step_pre_hook`` / ``register_step_post_hook``: an EMA of the
weights, a framework's bookkeeping) and the mark an LR scheduler reads to check that
the optimizer stepped before it did.  Skipped, every scheduler warned "Detected call
of ``lr_scheduler.step()`` before ``optimizer.step()``" and every hook missed every
step, silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ("as_optimizer_step",)

T = TypeVar("T")


def as_optimizer_step(opt: torch.optim.Optimizer, update: Callable[[], T]) -> T:
    """Run ``update`` as ``opt.step()`` runs its own update, for a step that replaces
    it (the catch-up step; the all-reduce strategy's sharded step); its result.

    Inside the step's profiler range; after the global and ``opt``'s step pre-hooks,
    before its post-hooks and the global ones (each called with ``(opt, (opt,), {})``,
    as ``opt.step()`` calls them; a pre-hook's replacement arguments have nothing to
    replace here); and recorded as a step where torch's learning-rate schedulers
    look for one: ``opt._opt_called``, which the wrapper a scheduler puts on
    ``opt.step`` sets, and ``opt._step_count`` where the older wrapper
    (``_with_counter``, torch before 2.2) counts steps there instead.
    """
    pre = getattr(torch_optimizer, "_global_optimizer_pre_hooks", {})
    post = getattr(torch_optimizer, "_global_optimizer_post_hooks", {})
    args: tuple[Any, ...] = (opt,)
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
        for hook in (*pre.values(), *opt._optimizer_step_pre_hooks.values()):
            hook(opt, args, {})
        out = update()
        opt._optimizer_step_code()
        for hook in (*opt._optimizer_step_post_hooks.values(), *post.values()):
            hook(opt, args, {})
    opt._opt_called = True  # type: ignore[attr-defined]
    count = getattr(opt, "_step_count", None)
    if getattr(opt.step, "_with_counter", False) and type(count) is int:
        opt._step_count = count + 1  # type: ignore[attr-defined]
    return out
