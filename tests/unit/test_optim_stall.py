"""A peer stalled past the collective timeout: the others finish a round without it.

Why this file: on a loaded machine one peer's thread can be starved for longer
than ``collective_timeout_s``; the others then complete that step's round
without it (timed out), and it comes back.  The stall is made deterministic
here (the stalled peer waits until the others have finished the step without
it), instead of hoping a loaded machine produces it, which is how
``test_drift_bounded_under_loss_and_zero_after_resync`` used to fail
(``chunks_stale == 6`` after its resync): rounds were paired by a per-peer call
counter, so the cut peer paired its step k with the others' step k + 1 for good
and its resync met their gradient round.  Rounds are now numbered by step
(``averaging/_round_id.py``), so it rejoins the others at its next step.
"""

from __future__ import annotations

import threading

import pytest
import torch

import gossipnet
from gossipnet.testing import run_peers

#: The round bound the others time out on while the stalled peer waits (short: the
#: stall lasts two such timeouts); the failure timeout is longer than the stall, so
#: the stalled peer stays a member (its event loop and heartbeats keep running).
CONFIG = {
    "heartbeat_interval_s": 0.05,
    "failure_timeout_s": 5.0,
    "chunk_bytes": 1024,
    "collective_timeout_s": 1.0,
}
STALL_AT = 5
STEPS = 12


# 12 steps of < 0.1 s, a stall of two collective timeouts (2 s), a resync: ~3 s idle;
# 60 s bounds a hang: every round timing out takes 13 x 1 s, at any load.
@pytest.mark.timeout(60)
def test_peer_stalled_past_the_collective_timeout_ends_identical_after_resync() -> None:
    n_params = 3 * 4 * 256  # 1 KiB chunks: 4 per owner
    # ranks 0 and 1 pass it after steps STALL_AT and STALL_AT + 1 (two rounds without
    # rank 2, so rank 2 has heard of their later round before it comes back), rank 2
    # before its step STALL_AT
    others_done = threading.Barrier(3, timeout=30)

    def body(rank: int, peer: gossipnet.Peer) -> tuple[torch.Tensor, int]:
        p = torch.nn.Parameter(torch.zeros(n_params))
        opt = peer.optimizer(torch.optim.SGD([p], lr=0.1), resync_every_steps=0)
        gen = torch.Generator().manual_seed(500 + rank)
        for t in range(STEPS):
            if rank == 2 and t == STALL_AT:
                others_done.wait()  # stalled: the others finish two steps without us
            p.grad = torch.randn(n_params, generator=gen)
            opt.step()
            if rank != 2 and t == STALL_AT + 1:
                others_done.wait()
        rep = opt.resync()
        return p.detach().clone(), rep.chunks_stale

    out = run_peers(3, body, timeout_s=60, **CONFIG)
    assert [stale for _, stale in out] == [0, 0, 0], "a resync left chunks stale"
    finals = [p for p, _ in out]
    assert all(torch.equal(finals[0], f) for f in finals[1:]), "resync left a gap"
