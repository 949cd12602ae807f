"""The all-reduce strategy's sharded optimizer: the base optimizer over owned shards.

Why rebuild the base optimizer per shard: torch optimizers step whole
tensors; a shard is a view of the flat parameter bucket, so a new optimizer
of the same class over those views steps exactly the owned elements, and
LR schedulers keep working because hyperparameters are copied from the
user's ``base.param_groups`` before every step.  When the shard map changes
(peers come or go), the state of the elements kept moves to the new views;
the state is saved as full-length per-bucket tensors (zeros outside the
shard), so it loads under any later shard map.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from gossipnet.collectives.compress import CompressSession
from gossipnet.collectives.lossy.engine import OwnedShard
from gossipnet.training._catch_up import catch_up_step, selection_weights, supports

__all__ = ("ShardKey", "ShardedOptimizer")

ShardKey = tuple[tuple[int, int, int], ...]  # (bucket, start, length) per owned shard


class ShardedOptimizer:
    """``base``'s class stepping the shards this peer owns in a round.

    Args:
        base: the user's optimizer (class, defaults, live hyperparameters).
        bucket_group: the param group of each flat bucket, in bucket order.
    """

    def __init__(self, base: torch.optim.Optimizer, bucket_group: list[int]) -> None:
        self.base = base
        self.bucket_group = bucket_group
        self._key: ShardKey = ()
        self._opt: torch.optim.Optimizer | None = None
        self._views: list[torch.Tensor] = []
        self._pending: dict[str, Any] | None = None  # loaded, applied at the next rebuild
        self.caught_up = False  # the last step was Adam's catch-up step (._catch_up)

    def step(
        self,
        shards: list[OwnedShard],
        params: list[torch.Tensor],
        codec: CompressSession | None = None,
    ) -> list[torch.Tensor]:
        """Step the base optimizer on the owned shards; return their new values.

        ``codec``: the round's compressor; where it knows the age of each value
        (ARC-Top-K, DCT with ``catch_up``) and the base is Adam or AdamW, the
        shards take the catch-up step (:mod:`._catch_up`) and hand the codec
        the weights for its next index sets.
        """
        self.caught_up = False
        key: ShardKey = tuple((s.bucket, s.start, s.average.numel()) for s in shards)
        if key != self._key or self._opt is None:
            self._rebuild(key, params)
        if self._opt is None:  # this peer owns no chunk in this round
            return [s.average for s in shards]
        for group, (b, _, _) in zip(self._opt.param_groups, _live(key), strict=True):
            for name, value in self.base.param_groups[self.bucket_group[b]].items():
                if name != "params":
                    group[name] = value
        views = self._views
        live = [s for s in shards if s.average.numel()]
        ages = _ages(live, codec) if codec is not None and supports(self.base) else None
        self.caught_up = ages is not None
        if ages is not None and codec is not None:
            self._catch_up(live, ages, codec)
        else:
            for view, shard in zip(views, live, strict=True):
                view.grad = shard.average.to(view.dtype)
            self._opt.step()
            for view in views:
                view.grad = None
        out = []
        it = iter(views)
        for s in shards:
            out.append(next(it).detach() if s.average.numel() else s.average)
        return out

    def _catch_up(
        self, live: list[OwnedShard], ages: list[torch.Tensor], codec: CompressSession
    ) -> None:
        """Adam's catch-up step on every live shard; the next sets' weights to ``codec``."""
        assert self._opt is not None
        for view, shard, age, group in zip(
            self._views, live, ages, self._opt.param_groups, strict=True
        ):
            state = self._opt.state[view]
            catch_up_step(view, shard.average, age, state, group)
            weights = selection_weights(state, group)
            if weights is not None:
                codec.selection_weights(shard.bucket, shard.start, weights)

    def state(self, params: list[torch.Tensor]) -> dict[str, Any]:
        """The sharded state as full-length per-bucket tensors (a loaded state not yet
        applied is returned as loaded)."""
        return self._full_state(params) if self._pending is None else self._pending

    def load(self, sharded: dict[str, Any]) -> None:
        """Adopt a saved :meth:`state`; applied when the next step rebuilds the shards."""
        self._pending = sharded
        self._key = ()
        self._opt = None

    def _rebuild(self, key: ShardKey, params: list[torch.Tensor]) -> None:
        """New shard map: rebuild the shard optimizer, carrying state for kept elements."""
        full = self._full_state(params) if self._pending is None else self._pending
        self._pending = None
        views = [params[b].narrow(0, start, n) for b, start, n in _live(key)]
        groups = [
            {"params": [v], **self._hyper(b)}
            for v, (b, _, _) in zip(views, _live(key), strict=True)
        ]
        opt = type(self.base)(groups, **self._ctor_defaults()) if groups else None
        if opt is not None and full:
            for v, (b, start, n) in zip(views, _live(key), strict=True):
                per_key = full["buckets"].get(b, {})
                if per_key:
                    st: dict[str, Any] = {
                        k: t.narrow(0, start, n).clone().to(v.dtype)
                        if t.dtype.is_floating_point
                        else t.clone()
                        for k, t in per_key.items()
                    }
                    for scalar, value in full.get("scalars", {}).items():
                        st[scalar] = value.clone() if torch.is_tensor(value) else value
                    opt.state[v] = st
        self._key, self._opt, self._views = key, opt, views

    def _hyper(self, bucket: int) -> dict[str, Any]:
        """The live hyperparameters of ``bucket``'s param group (lr, betas, ...)."""
        group = self.base.param_groups[self.bucket_group[bucket]]
        return {k: val for k, val in group.items() if k != "params"}

    def _ctor_defaults(self) -> dict[str, Any]:
        """``base.defaults`` restricted to what the class's constructor accepts
        (AdamW keeps ``decoupled_weight_decay`` in defaults but takes no such argument)."""
        params = inspect.signature(type(self.base).__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(self.base.defaults)
        return {k: v for k, v in self.base.defaults.items() if k in params}

    def _full_state(self, params: list[torch.Tensor]) -> dict[str, Any]:
        """The sharded state spread over full-length per-bucket tensors (zeros elsewhere)."""
        out: dict[str, Any] = {"buckets": {}, "scalars": {}}
        if self._opt is None:
            return out
        for v, (b, start, n) in zip(self._views, _live(self._key), strict=True):
            for k, t in self._opt.state.get(v, {}).items():
                if torch.is_tensor(t) and t.dim() >= 1 and t.numel() == n:
                    full = (
                        out["buckets"]
                        .setdefault(b, {})
                        .setdefault(k, torch.zeros(params[b].numel(), dtype=t.dtype))
                    )
                    full.narrow(0, start, n).copy_(t)
                else:
                    # clone: optimizers bump scalar state (Adam's step) in place
                    out["scalars"][k] = t.clone() if torch.is_tensor(t) else t
        return out


def _ages(live: list[OwnedShard], codec: CompressSession) -> list[torch.Tensor] | None:
    """The age of every value of every live shard, or None unless all are known."""
    out = []
    for s in live:
        age = codec.ages(s.bucket, s.start, s.average.numel())
        if age is None:
            return None
        out.append(age)
    return out


def _live(key: ShardKey) -> list[tuple[int, int, int]]:
    """The shards of ``key`` that hold at least one element."""
    return [k for k in key if k[2] > 0]
