"""One process of the multi-process island test (``test_blink_island.py``).

Usage: ``python -m tests.integration._island_worker RANK ADDRESSES OUT_DIR SCENARIO``.
Ranks 0-2 drive the fake "GPUs" 0-2 of one NVLink island (CPU tensors in shared
memory), rank 3 has no GPU.  Results go to ``OUT_DIR/rank<R>-call<C>.pt`` (tensors
and the report's fields); then it prints ``done`` and leaves when stdin says so.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

import gossipnet
from gossipnet.collectives.blink.topology import GpuTopology

TOPOLOGY = GpuTopology(gpus=(0, 1, 2), nvlinks={(0, 1): 2, (1, 2): 1, (0, 2): 1})
NET = {
    "heartbeat_interval_s": 0.1,
    "failure_timeout_s": 1.0,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 10.0,
    "collective_timeout_s": 2.0,
}
TIMEOUT_S = 2.0


def values(rank: int, call: int) -> list[torch.Tensor]:
    """Seeded inputs of ``rank``'s ``call``-th round: two float dtypes, odd sizes."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    return [torch.randn(30_001, generator=g), torch.randn(3, 5, generator=g, dtype=torch.float64)]


def main() -> None:
    rank, addresses, out, scenario = (
        int(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3]), sys.argv[4],
    )  # fmt: skip
    device = rank if rank < 3 else None
    peer = gossipnet.join(
        addresses, listen=addresses[rank], peer_id=f"r{rank}", secret=b"island",
        handle_sigterm=False, **NET,
    )  # fmt: skip
    calls = 3 if scenario == "kill" else 1
    for call in range(calls):
        if scenario == "kill" and call == 1 and rank == 0:
            os._exit(0)  # the leader dies without a word (no LEAVE), between rounds
        ts = values(rank, call)
        rep = peer.island_average(ts, TIMEOUT_S, topology=TOPOLOGY, device=device)
        fields = dataclasses.asdict(rep)
        fields["stats"] = peer.stats()["transport"]
        torch.save({"tensors": ts, "report": fields}, out / f"rank{rank}-call{call}.pt")
    # stay until the test says every rank is done: a departure must not cut a round
    print("done", flush=True)
    sys.stdin.readline()
    peer.leave()


if __name__ == "__main__":
    main()
