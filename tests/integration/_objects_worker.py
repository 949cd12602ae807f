"""Object collectives through ``init_process_group("gossipnet")`` (started with env://).

Rank 0 prints one JSON line: what ``all_gather_object`` and ``broadcast_object_list``
returned, the settings ``pg_options`` gave the group, the error ``gather_object``
(built on the unsupported ``gather``) raised, and the exact collectives' refused parts.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from gossipnet import Config
from gossipnet.distributed import GossipnetOptions, ProcessGroupGossipnet, totals


def main() -> None:
    options = GossipnetOptions(config=Config(collective_timeout_s=7.5), exact_max_bytes=64)
    dist.init_process_group("gossipnet", pg_options=options)
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, ProcessGroupGossipnet)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {"rank": rank, "text": "x" * (100 + 5000 * rank), "nested": [rank, [rank * 2.5]]}
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, mine)
    sent = [{"from": "root", "blob": list(range(2000))}, "second"] if rank == 1 else [None, None]
    dist.broadcast_object_list(sent, src=1)
    try:
        dist.gather_object(mine, [None] * world if rank == 0 else None, dst=0)
        unsupported = ""
    except RuntimeError as err:
        unsupported = str(err)
    dist.barrier()
    if rank == 0:
        seen = {"timeout": pg.peer.config.collective_timeout_s, "exact": pg.options.exact_max_bytes}
        seen["refused"] = {
            k: v for k, v in totals().items() if "dropped" in k or k == "exact_malformed"
        }
        out = {"gathered": gathered, "broadcast": sent, "gather_error": unsupported, **seen}
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
