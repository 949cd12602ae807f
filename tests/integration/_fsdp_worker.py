"""FSDP2 (``fully_shard``) on CPU over the backend named in argv[1]; rank 0 prints JSON.

FSDP's parameter all-gather (``all_gather_single``) and gradient reduce-scatter
(``reduce_scatter_single``) are what this exercises; ranks draw different batches.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import gossipnet.distributed as gdist


def main() -> None:
    backend = sys.argv[1]
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(20):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    losses: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(losses, loss.item())
    totals = gdist.totals() if backend == "gossipnet" else {}
    if dist.get_rank() == 0:
        print(json.dumps({"losses": losses, "totals": totals}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo backend under FSDP2 sometimes aborts at interpreter exit
    # ("terminate called without an active exception": a joinable C++ thread destroyed
    # by a static destructor; seen once in CI on the gloo baseline run).  Everything this
    # worker reports is out and its groups are destroyed: leave without the destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
