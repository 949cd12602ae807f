"""The facade's side of a collective: flat buckets, CPU staging, write-back.

:class:`~gossipnet.Peer`'s collectives run on the loop thread, but the
caller's tensors stay on the caller's thread (STYLE: tensors cross threads as
CPU copies; results are applied on the caller's thread).  So every call
flattens the tensors into a cached :class:`FlatBuffer` (the runtime's
:class:`~gossipnet.runtime.flatbuffer.FlatCache`), zeroes non-finite
values (they are never sent), hands CPU buckets to the loop, then copies the
result back on return.  Why one place: ``all_reduce`` and ``average`` did the
same steps, and the order (sanitise before copying to the CPU; copy back
before unflattening) is what keeps a GPU's tensors and the network's in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from gossipnet.collectives.chunks import all_finite
from gossipnet.collectives.moshpit.averager import MoshpitConfig
from gossipnet.runtime.flatbuffer import FlatBuffer

__all__ = ("Staged", "moshpit_bound_s", "moshpit_config", "stage")


@dataclasses.dataclass(slots=True)
class Staged:
    """One call's tensors, flattened and staged on the CPU for the loop thread.

    Attributes:
        flat: the layout's buffer (owns ``buckets``).
        buckets: the flat buckets, on the tensors' device.
        cpu: ``buckets`` themselves where on the CPU, else CPU copies: what the
            loop thread reads and overwrites.
        nonfinite: a local value was NaN or infinite (now zeroed): the caller
            contributes with weight 0 this call.
    """

    flat: FlatBuffer
    buckets: tuple[torch.Tensor, ...]
    cpu: list[torch.Tensor]
    nonfinite: bool

    def write_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the loop's results into ``tensors`` (on the caller's thread)."""
        for b, c in zip(self.buckets, self.cpu, strict=True):
            if b is not c:
                b.copy_(c)
        self.flat.unflatten_into(tensors)


def stage(flat: FlatBuffer, tensors: Sequence[torch.Tensor]) -> Staged:
    """Flatten ``tensors`` into ``flat``, zero non-finite values, copy to the CPU."""
    buckets = flat.flatten(tensors)
    nonfinite = not all(all_finite(b) for b in buckets)
    if nonfinite:
        for b in buckets:
            torch.nan_to_num_(b, nan=0.0, posinf=0.0, neginf=0.0)
    cpu = [b if b.device.type == "cpu" else b.cpu() for b in buckets]
    return Staged(flat=flat, buckets=buckets, cpu=cpu, nonfinite=nonfinite)


def moshpit_config(
    base: MoshpitConfig, group_size: int | None, timeout_s: float | None
) -> MoshpitConfig:
    """``base`` with one ``average()`` call's group size and round timeout, if given."""
    if group_size is None and timeout_s is None:
        return base
    return dataclasses.replace(
        base,
        max_group_size=base.max_group_size if group_size is None else group_size,
        round_timeout_s=base.round_timeout_s if timeout_s is None else timeout_s,
    )


def moshpit_bound_s(cfg: MoshpitConfig, n_rounds: int, collective_timeout_s: float) -> float:
    """How long the caller waits for ``n_rounds`` Moshpit rounds, in seconds.

    Each round is bounded by its matchmaking, its group all-reduce and the
    reply margins; one round more and 30 s cover scheduling on a loaded loop
    (the rounds themselves end at their own deadlines, this only stops a hang).
    """
    per_round = cfg.matchmaking_timeout_s + 3 * cfg.reply_margin_s
    per_round += cfg.round_timeout_s or collective_timeout_s
    return (n_rounds + 1) * per_round + 30
