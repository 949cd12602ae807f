"""A DDP worker for the churn and misconfiguration tests (started with env:// variables).

Arguments: ``steps die_rank die_step``.  Rank ``die_rank`` kills itself with SIGKILL
(no goodbye) before step ``die_step``, in the first attempt only (under ``torchrun
--max-restarts`` the restarted group then runs through); the others train on and
print one JSON line: steps done, seconds after the death step, rounds that missed a
peer, and a digest of their parameters (survivors must still agree).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gossipnet.distributed as gdist


def main() -> None:
    steps, die_rank, die_step = (int(a) for a in sys.argv[1:4])
    dist.init_process_group("gossipnet")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    net = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    t_death = None
    for step in range(steps):
        if step == die_step:
            if rank == die_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            t_death = time.monotonic()
        x = torch.randn(16, 32)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
    totals = gdist.totals()
    # one write() of one line: both ranks share torchrun's stdout, and print() may
    # write the text and its newline separately, so two ranks' lines could interleave
    line = json.dumps(
        {
            "rank": rank,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "steps": steps,
            "after_death_s": time.monotonic() - t_death if t_death else None,
            "rounds_missing_peers": totals.get("rounds_missing_peers", 0),
            "digest": digest.hexdigest(),
        }
    )
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
