"""The compressed optimizer's residual: each owner's parameter updates not yet sent.

Why: with ``net.optimizer(..., compress=...)`` the owner of a shard broadcasts
its parameters' *update* compressed (:mod:`gossipnet.collectives.compress.sparse`:
the blocks of largest update, in the value codec), and every replica, the
owner's too, adds the decoded update, so the replicas stay bit-identical.  What
the compressor left out (blocks not chosen, rounding) must not be lost: the owner
keeps it here, per owned shard, as ``residual = master - replica``, where
``master`` is where its optimizer put the shard.  Each step the optimizer steps
``replica + residual`` (the master), the broadcast carries part of
``master - replica``, and the rest stays here: error feedback on the
parameters (EF21-P, Gruntkowska et al. 2023).  With Adam's catch-up step only
the elements of the gradient's set move, so the update lies on the blocks that
are sent and the residual holds little more than rounding.

A resync averages the replicas, which moves the owner's replica by the updates
its receivers lost; :meth:`Residual.absorb` adds that move to the residual, so
the master stays where the optimizer put it and the lost updates are sent again
after the resync.  A shard that changes owner takes its residual only where the
new shard overlaps the old one; the rest (at most the unsent part of recent
updates) is dropped, as it is when the state is replaced (a checkpoint loaded, a
realignment): :meth:`Residual.clear`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ("Residual",)

Key = tuple[int, int, int]  # (bucket, start, length) of an owned shard


class Residual:
    """Per owned shard, ``master - replica`` in float32 (see the module doc)."""

    def __init__(self) -> None:
        self._parts: dict[Key, torch.Tensor] = {}
        self._masters: dict[Key, torch.Tensor] = {}
        self._replicas: dict[Key, torch.Tensor] = {}

    def enter(self, keys: Sequence[Key], params: Sequence[torch.Tensor]) -> None:
        """Before the optimizer steps the shards ``keys`` of ``params`` (in place):
        remember their replica values and add the residual (the shards become the
        masters)."""
        self._rekey(keys)
        self._masters.clear()
        self._replicas.clear()
        for key in keys:
            b, start, n = key
            view = params[b].narrow(0, start, n)
            self._replicas[key] = view.detach().clone()
            view.add_(self._parts[key].to(view.dtype))

    def leave(self, keys: Sequence[Key], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """After the step: the new masters of ``keys``, as copies the caller may
        change (the broadcast overwrites them with what the receivers decode);
        ``params`` hold the replica values again, from which the update is sent."""
        out = []
        for key in keys:
            b, start, n = key
            view = params[b].narrow(0, start, n)
            master = view.detach().clone()
            self._masters[key] = master
            view.copy_(self._replicas[key])
            out.append(master.clone())
        self._replicas.clear()
        return out

    def settle(self, params: Sequence[torch.Tensor]) -> None:
        """After the round: what the broadcast did not carry stays (master - replica)."""
        for key, master in self._masters.items():
            b, start, n = key
            replica = params[b].narrow(0, start, n)
            torch.sub(master.to(torch.float32), replica.to(torch.float32), out=self._parts[key])
        self._masters.clear()

    def snapshot(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The replica values of every shard with a residual (before a resync)."""
        return [params[b].narrow(0, s, n).detach().clone() for b, s, n in self._parts]

    def absorb(self, before: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """After a resync moved the replicas from ``before`` (:meth:`snapshot`): the
        masters stay, so each residual grows by the move."""
        for (key, part), old in zip(self._parts.items(), before, strict=True):
            b, start, n = key
            now = params[b].narrow(0, start, n).to(torch.float32)
            part.add_(old.to(torch.float32) - now)

    def clear(self) -> None:
        """Drop every residual (the replica was replaced: nothing pending applies)."""
        self._parts.clear()
        self._masters.clear()
        self._replicas.clear()

    def norm(self) -> float:
        """The L2 norm of every residual together (what the replicas still lack)."""
        total = sum(float(p.square().sum()) for p in self._parts.values())
        return total**0.5

    def _rekey(self, keys: Sequence[Key]) -> None:
        """Residuals for the shards ``keys``: kept where a new shard overlaps an old one."""
        if list(self._parts) == list(keys):
            return
        old = self._parts
        self._parts = {}
        for key in keys:
            b, start, n = key
            part = torch.zeros(n, dtype=torch.float32)
            for (ob, ostart, on), prev in old.items():
                lo, hi = max(start, ostart), min(start + n, ostart + on)
                if ob == b and lo < hi:
                    part[lo - start : hi - start] = prev[lo - ostart : hi - ostart]
            self._parts[key] = part
