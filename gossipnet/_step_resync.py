"""``all_reduce(..., step=opt)``'s parameter resyncs: replicas that lossy rounds let
drift apart become identical again.

Why: a DDP-style loop steps every replica with the round's averages, and a chunk
whose average never arrived holds this peer's own gradient, so every lost
broadcast moves the replicas apart; nothing in a gradient all-reduce brings them
back.  Measured on the compression bench's demo task at 10% loss (dense, seed 0):
the replicas ended up to 0.09 apart in a parameter and the mean held-out
perplexity read 9.30 against 8.66 lossless; averaging the parameters exactly every
25 steps brought it to 8.93.  The optimizer strategy resyncs every
``Config.resync_every_steps``; with ``step=opt`` gossipnet steps the optimizer, so it
knows the parameters and does the same: at the first such call and after every
``resync_every_steps`` calls, one dense round averages the optimizer's
parameters with repair (lost chunks are asked for again), so every peer leaves it
holding the same values.  The first runs before the first call's round, as DDP's
start-up broadcast does: it makes peers that started from different weights
consistent, and warns that they did (seed every peer alike).

Like the optimizer's resyncs, each one ends with a digest of the parameters announced
to the peers heard in the round (:mod:`gossipnet.training.replicas`), so
``net.replicas_agree()`` answers after ``net.resync(opt)`` as after ``opt.resync()``.
Nothing is repaired from that verdict on this path: it only says whether the replicas
agree (the resync itself is what makes them agree).

Every peer counts its own ``step=`` calls, so peers that make the same calls with
the same ``resync_every_steps`` run their resyncs at the same rounds (as the
optimizer strategy's do); the round is of another mode than gradient rounds, so a
peer out of step drops it as mismatched rather than adding parameters to
gradients.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from gossipnet._collective import stage
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.reports import CollectiveReport
from gossipnet.runtime.cputime import loop_cpu, stamp_cpu
from gossipnet.runtime.flatbuffer import FlatBuffer
from gossipnet.training.replicas import ReplicaDigests, digest

__all__ = ("MODE_STEP_RESYNC", "StepResync", "optimizer_params")

log = logging.getLogger(__name__)

#: The resync rounds' mode (gradient rounds of ``all_reduce`` are mode 0).
MODE_STEP_RESYNC = 2

#: A parameter that moved more than this in the first resync started elsewhere.
_STARTED_APART = 1e-6


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The floating-point parameters ``opt`` steps, in its param groups' order."""
    return [
        p
        for group in opt.param_groups
        for p in group["params"]
        if p.requires_grad and p.dtype.is_floating_point
    ]


class StepResync:
    """When ``all_reduce(..., step=opt)`` resyncs, and the resync itself.

    Args:
        every: calls between resyncs after the first (0: only the first).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.calls = 0  # step= calls so far on this peer

    def first(self) -> bool:
        """True at the first ``step=`` call: it resyncs before its round, so the
        resync sees only how the replicas started (no lossy round has run yet)."""
        return self.calls == 0

    def due(self) -> bool:
        """Count one ``step=`` call, after its step; True where a resync follows."""
        n = self.calls
        self.calls += 1
        return n > 0 and self.every > 0 and n % self.every == 0

    def run(
        self,
        opt: torch.optim.Optimizer,
        engine: LossyAllReduce,
        call: Callable[[Coroutine[Any, Any, Any], float], Any],
        timeout_s: float,
        replicas: ReplicaDigests | None = None,
    ) -> CollectiveReport:
        """Average ``opt``'s parameters with repair, on the peer's loop via ``call``,
        then announce their digest through ``replicas`` (the peer's, for
        ``net.replicas_agree()``; only the peers heard in the round vote on it).

        The report's ``extra["resync_moved"]`` is the largest change of one of this
        peer's parameters (its drift from the average); at the first resync a
        change above rounding logs a warning that the replicas started apart.
        """
        params = optimizer_params(opt)
        # a flat buffer of their own, built per resync (they are rare): the peer's
        # cached one for this layout is the gradients' (the same shapes), which the
        # calling all_reduce has already staged its input in
        staged = stage(FlatBuffer(params), params)
        src = [b.clone() for b in staged.cpu]  # served again to repair requests: private
        opts = RoundOptions(
            dst=staged.cpu,
            weight=0.0 if staged.nonfinite else 1.0,  # a broken replica adopts the others'
            timeout_s=timeout_s,
            mode=MODE_STEP_RESYNC,
            repair=True,
        )

        async def work() -> CollectiveReport:
            report = await engine.run(src, opts)
            if replicas is not None:
                in_sync = engine.alignment().in_sync  # this round's (no await since it ended)
                value = await asyncio.to_thread(digest, staged.cpu)  # releases the GIL
                replicas.publish(report.round, value, in_sync)
            return report

        first = self.first()
        report, loop_s = call(loop_cpu(work), 2 * timeout_s + 30)
        moved = max(float((a - b).abs().max()) for a, b in zip(staged.cpu, src, strict=True))
        staged.write_back(params)
        report.method = "resync"
        report.extra["resync_moved"] = moved
        if first and moved > _STARTED_APART:
            log.warning(
                "the replicas started from different parameters (the first resync moved one"
                " by %.3g): averaged them; build the model from the same seed on every peer",
                moved,
            )
        return stamp_cpu(report, loop_s, 0.0)
