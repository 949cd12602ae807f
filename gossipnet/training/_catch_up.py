"""Adam for sparse, error-fed gradients: each value stepped as the rounds it stands for.

Why: under ARC-Top-K an element's value this round is the error-fed sum
of the ``k`` rounds since it last travelled (its *age*,
:mod:`gossipnet.collectives.compress.staleness`).  Stock Adam takes it as one
round's gradient and sees zeros in the other ``k - 1``; its second moment then
grows with ``k^2 / k = k`` while the summed first moment grows with ``k``, so
the element moves about ``sqrt(k)`` times less than in the dense run.  The
catch-up step treats the value as ``k`` rounds of its mean ``x = g / k``:

    m <- b1^k m + (1 - b1^k) x        v <- b2^k v + (1 - b2^k) x^2
    p <- p - k * lr * m_hat / (sqrt(v_hat) + eps)

which is exactly what Adam does over ``k`` rounds of a constant gradient ``x``
(to first order in the change of ``m`` and ``v`` over them) and stock Adam when
``k = 1``.  Bias correction counts at least ``k`` rounds for the element (its
averages absorbed ``k``, even when the optimizer state is younger).  Elements not
sent this round (age 0) keep ``m``, ``v`` and their
value: their gradient is still in the senders' error feedback.  Decoupled
weight decay (AdamW) applies to every element each round, as in the dense run.

State stays torch's own (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints
load into stock Adam and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gossipnet.collectives.compress import CompressSession
from gossipnet.collectives.compress.staleness import STALE
from gossipnet.runtime.flatbuffer import FlatBuffer
from gossipnet.training._stepping import as_optimizer_step

__all__ = ("catch_up_step", "selection_weights", "step_all_reduced", "supports")


def supports(opt: torch.optim.Optimizer) -> bool:
    """True for Adam and AdamW without the variants this step does not model
    (amsgrad, maximize, capturable, differentiable, fused)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(
        g.get(flag)
        for g in opt.param_groups
        for flag in ("amsgrad", "maximize", "capturable", "differentiable", "fused")
    )


@torch.no_grad()
def catch_up_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    age: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
) -> None:
    """One Adam(W) step of ``param`` (in place) with per-element ``age`` (0: not sent)."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    eps, wd = float(group["eps"]), float(group["weight_decay"])
    decoupled = bool(group.get("decoupled_weight_decay", False))
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    t = float(state["step"])
    if wd and decoupled:
        param.mul_(1.0 - lr * wd)
    flat_age = age.to(param.device).reshape(-1)
    at = torch.nonzero(flat_age).flatten()
    if not at.numel():
        return
    p, m_all, v_all = param.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    k = flat_age[at].to(param.dtype)
    x = grad.reshape(-1)[at].to(param.dtype) / k
    if wd and not decoupled:
        x += wd * p[at]
    d1, d2 = torch.pow(beta1, k), torch.pow(beta2, k)
    m = m_all[at].mul_(d1).add_((1.0 - d1) * x)
    v = v_all[at].mul_(d2).add_((1.0 - d2) * x * x)
    m_all[at] = m
    v_all[at] = v
    # bias correction by the rounds the element's averages absorbed: at least k
    # (an optimizer state younger than the values' ages, e.g. the first step)
    tt = k.clamp(min=t)
    bc1, bc2 = 1.0 - torch.pow(beta1, tt), 1.0 - torch.pow(beta2, tt)
    denom = (v / bc2).sqrt_().add_(eps)
    p[at] -= lr * k * (m / bc1) / denom


def selection_weights(state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor | None:
    """``1 / (sqrt(v_hat) + eps)^2`` per element: how much a unit of squared
    gradient moves it (the owner's weights for the next index set); None before
    the first step."""
    if not state or "exp_avg_sq" not in state:
        return None
    bc2 = 1.0 - float(group["betas"][1]) ** float(state["step"])
    denom = (state["exp_avg_sq"] / bc2).sqrt_().add_(float(group["eps"]))
    return denom.square_().reciprocal_()


def step_all_reduced(
    opt: torch.optim.Optimizer,
    grads: Sequence[torch.Tensor],
    flat: FlatBuffer,
    session: CompressSession | None,
) -> bool:
    """Step ``opt`` after ``all_reduce(grads, compress=..., step=opt)``; True if the
    catch-up step ran (Adam/AdamW and a sparse compressor that tracked ages),
    False if ``opt.step()`` did.

    Every peer steps every element here (each holds the whole optimizer), so
    the ages are those of the values *applied* (the sets of the owners'
    broadcasts), the same on every peer that received them.  A parameter whose
    gradient was not in ``grads`` is stepped as dense (age 1).  The owners'
    next sets are weighted by this peer's ``1 / v`` (every peer has it).
    """
    ages = session.applied_ages() if session is not None else None
    if session is None or ages is None or not supports(opt):
        opt.step()
        return False
    as_optimizer_step(opt, lambda: _catch_up_all(opt, grads, flat, session, ages))
    return True


def _catch_up_all(
    opt: torch.optim.Optimizer,
    grads: Sequence[torch.Tensor],
    flat: FlatBuffer,
    session: CompressSession,
    ages: list[torch.Tensor],
) -> None:
    """The catch-up step of every parameter of ``opt`` (see :func:`step_all_reduced`)."""
    # a chunk whose broadcast was lost holds our own gradient: one round's, dense
    ages = [torch.where(a == STALE, 1.0, a) for a in ages]
    by_grad = {id(g): a for g, a in zip(grads, flat.split(ages), strict=True)}
    weights = [torch.zeros(a.numel(), dtype=torch.float32) for a in ages]
    w_by_grad = {id(g): w for g, w in zip(grads, flat.split(weights), strict=True)}
    for group in opt.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            age = by_grad.get(id(g))
            state = opt.state[p]
            catch_up_step(p, g, age if age is not None else torch.ones(g.shape), state, group)
            w = w_by_grad.get(id(g))
            sel = selection_weights(state, group)
            if w is not None and sel is not None:
                w.copy_(sel)
    for b, w in enumerate(weights):
        session.selection_weights(b, 0, w, everywhere=True)
