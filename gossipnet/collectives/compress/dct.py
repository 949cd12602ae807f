"""DCT (Dynamic Communication Thresholding)'s pure functions.

``theta`` is the ``1 - keep`` quantile of ``|u|``, computed on a refresh round and
kept for ``refresh_every`` rounds; between refreshes compressing is one
comparison.  A chunk sends at most ``cap`` entries (what fits its packet): when
more pass the threshold, the largest ``cap`` go and the rest stays in the error
feedback, never dropped.
"""

from __future__ import annotations

import torch

__all__ = ("select", "threshold")

_SAMPLE = 1 << 20  # elements a quantile looks at: torch.quantile's size limit is 2**24


def threshold(u: torch.Tensor, keep: float) -> float:
    """The ``1 - keep`` quantile of ``|u|`` (on a strided sample of large tensors)."""
    a = u.detach().abs().flatten().to(torch.float32)
    if a.numel() == 0:
        return 0.0
    if a.numel() > _SAMPLE:
        a = a[:: -(-a.numel() // _SAMPLE)]
    return float(torch.quantile(a, max(0.0, min(1.0, 1.0 - keep))))


def select(u: torch.Tensor, theta: float, cap: int) -> torch.Tensor:
    """Indices (int64, ascending) of the entries with ``|u| >= theta``, at most ``cap``
    (the largest ones where more pass)."""
    a = u.abs()
    idx = torch.nonzero(a >= theta).flatten() if theta > 0 else torch.nonzero(a).flatten()
    if idx.numel() > cap:
        top = torch.topk(a[idx], cap, sorted=False).indices
        idx = torch.sort(idx[top]).values
    return idx
