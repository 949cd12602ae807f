"""What the local-step strategies (``moshpit``, ``route``) share.

Both step the base optimizer on this peer's own gradients and average
parameters now and then, so both must treat a ``net.microbatches`` loop the
way the all-reduce strategy does, and both may average the optimizer state
alongside the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gossipnet.training.dropcompute import MicrobatchReport
from gossipnet.training.host import TrainingHost

__all__ = ("scale_for_microbatches", "state_tensors")


def scale_for_microbatches(
    host: TrainingHost,
    params: Sequence[torch.Tensor],
    closure: Callable[[], Any] | None,
    weight: float | None,
) -> tuple[MicrobatchReport | None, Callable[[], Any] | None]:
    """Take the last ``net.microbatches`` report and scale the summed gradients by it.

    With ``weight=None`` the gradients become a mean, as the all-reduce strategy
    makes them (1 / micro-batches done, or 1 / K with ``normalise="full"``); an
    explicit ``weight`` leaves them as they are.  A closure runs first (its
    gradients are the ones to scale), so the returned closure is then ``None``.
    Returns the report (``None`` without a loop) and the closure still to run.
    """
    mb = host.take_microbatch_report()  # the last net.microbatches loop, once
    if mb is None or weight is not None:
        return mb, closure
    if closure is not None:
        with torch.enable_grad():
            closure()
        closure = None
    scale = mb.grad_scale
    for p in params if scale != 1.0 else ():
        if p.grad is not None:
            p.grad.mul_(scale)
    return mb, closure


def state_tensors(
    base: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The optimizer's floating-point per-parameter state shaped like its parameter
    (e.g. Adam's moments), in a fixed order, to average with the parameters."""
    out = []
    for p in params:
        state = base.state.get(p, {})
        for name in sorted(state):
            value = state[name]
            if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                out.append(value)
    return out
