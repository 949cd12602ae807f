"""Is gossipnet's lossless all-reduce bit-equal to gloo's?  Element counts, not a timing.

Four processes run ``torch.distributed.all_reduce(SUM)`` over gloo on seeded float32
inputs (standard normal, and ``wide``: each value times its own power of ten over
six decades); four in-process gossipnet nodes (a ``MemoryNetwork``, nothing lost) run
``LossyAllReduce`` on the same inputs, twice, with the owners hearing their senders
in two different orders (per-link delays).  Reported per size:

- ``replays``: whether gossipnet's two runs are bit-identical (its owner sums have
  a fixed order: its own part, then the others in rank order);
- ``equal_gloo_sum``: the fraction of elements where gossipnet's result times the
  world size (what the torch backend returns for SUM) equals gloo's sum bit for
  bit, and ``max_err_gloo`` the largest difference in ulps of the element's
  largest addend (what reordering a sum of four can move it by);
- ``equal_gloo_avg``: the same for gloo's sum divided by the world size against
  gossipnet's mean;
- ``equal_rank_fold``: the fraction equal to the plain rank-order sum
  ``((x0 + x1) + x2) + x3`` (``torch.stack(xs).sum(0)``, what the torch backend's
  exact path computes), against gloo's and gossipnet's.

    .venv/bin/python bench/gloo_bits.py --quick    # 64 k and 1 M elements, < 1 min

The last stdout line is one JSON object with those keys per size.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import bench_parser, emit_json

from gossipnet import Config, FaultPlan
from gossipnet.collectives.lossy.engine import LossyAllReduce, RoundOptions
from gossipnet.testing.cluster import cluster

WORLD = 4


def _inputs(numel: int, wide: bool) -> list[torch.Tensor]:
    """Rank ``i``'s input, seeded: standard normal values, or (``wide``) each times
    its own power of ten over six decades."""
    out = []
    for i in range(WORLD):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(numel, generator=g)
        if wide:
            x *= 10.0 ** (6 * torch.rand(numel, generator=g) - 3)
        out.append(x)
    return out


def _gloo_rank(rank: int, numel: int, wide: bool, init: str, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    x = _inputs(numel, wide)[rank].clone()
    dist.all_reduce(x)
    if rank == 0:
        torch.save(x, path)
    dist.barrier()
    dist.destroy_process_group()


def _gloo_sum(numel: int, wide: bool) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sum.pt")
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(_gloo_rank, args=(numel, wide, init, path), nprocs=WORLD, join=True)
        return torch.load(path)


def _arrangement(seed: int) -> Any:
    """Per-link delays: each owner hears its senders' streams in a seeded order."""
    rng = random.Random(seed)
    addrs = [f"mem://p{i}" for i in range(WORLD)]
    delay = {}
    for dst in addrs:
        senders = [a for a in addrs if a != dst]
        rng.shuffle(senders)
        for k, src in enumerate(senders):
            delay[(src, dst)] = 0.002 * (k + 1)

    def plan(i: int) -> FaultPlan:
        links = {(s, d): FaultPlan(delay_s=t) for (s, d), t in delay.items() if s == addrs[i]}
        return FaultPlan(seed=i, links=links)

    return plan


async def _gossipnet_mean(numel: int, wide: bool, seed: int) -> torch.Tensor:
    cfg = Config(run="gloo-bits", collective_timeout_s=30.0)
    async with cluster(WORLD, config=cfg, faults=_arrangement(seed)) as nodes:
        engines = [LossyAllReduce(n) for n in nodes]
        xs = [x.clone() for x in _inputs(numel, wide)]
        reps = await asyncio.gather(
            *(e.run([x], RoundOptions(timeout_s=30.0)) for e, x in zip(engines, xs, strict=True))
        )
        if any(r.chunks_stale or r.packets_lost for r in reps):
            raise SystemExit("a lossless round lost data")
        if not all(torch.equal(x, xs[0]) for x in xs):
            raise SystemExit("replicas differ")
        return xs[0]


def _err(a: torch.Tensor, b: torch.Tensor, xs: list[torch.Tensor]) -> float:
    """The largest ``|a - b|`` in ulps of each element's largest addend (a sum of four
    floats is off by at most a few of those, whatever its order)."""
    big = torch.stack(xs).abs().amax(0)
    ulp = torch.nextafter(big, torch.tensor(float("inf"))) - big
    return float(((a.double() - b.double()).abs() / ulp.double()).max())


def _figures(numel: int, wide: bool) -> dict[str, Any]:
    xs = _inputs(numel, wide)
    gloo = _gloo_sum(numel, wide)
    ours = [asyncio.run(_gossipnet_mean(numel, wide, seed)) for seed in (1, 2)]
    fold = torch.stack(xs).sum(0)
    mean = ours[0]
    as_sum = mean * WORLD  # the torch backend's SUM (exact: WORLD is a power of two)
    return {
        "numel": numel,
        "inputs": "wide" if wide else "normal",
        "replays": bool(torch.equal(ours[0], ours[1])),
        "equal_gloo_sum": float((as_sum == gloo).double().mean()),
        "max_err_gloo": _err(as_sum, gloo, xs),
        "equal_gloo_avg": float((mean == gloo / WORLD).double().mean()),
        "gloo_equal_rank_fold": float((gloo == fold).double().mean()),
        "ours_equal_rank_fold": float((as_sum == fold).double().mean()),
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[65_536, 1_000_000, 25_000_000])
    args = parser.parse_args()
    if args.quick:
        args.sizes = [65_536, 1_000_000]
    out = {"sizes": [_figures(n, wide) for n in args.sizes for wide in (False, True)]}
    for row in out["sizes"]:
        print(row)
    emit_json(out)


if __name__ == "__main__":
    main()
