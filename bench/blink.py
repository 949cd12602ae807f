"""Blink spanning trees vs NCCL-style rings: packed rates, tree counts, modelled speed-up.

Per topology fixture (``tests/fixtures/nvidia-smi-topo``, parsed by
``topology.parse_topo_matrix``) and per allocation (every 3- to 8-GPU subset of a
DGX-1 V100 and P100, ALGORITHMS.md 5.2):

* broadcast from the allocation's first GPU, NVLink only: the max-flow min cut, the
  MWU packing's rate and gap (must be <= 1%), the reduced packing's rate and tree count;
* all-reduce: the packed undirected-tree rate vs the partition bound, over NVLink only
  and over NVLink + PCIe (Blink's hybrid); the ring model (NCCL: NVLink rings, or PCIe
  when no NVLink Hamiltonian cycle exists); the modelled speed-up t_ring / t_tree for
  a 256 MB buffer, 64 chunks per tree (formulas in ``gossipnet/collectives/blink/ring.py``);
* the DGX-1 broadcast min cut (in links) per allocation size, next to ALGORITHMS.md's
  table, and Blink's published figure (abstract: up to 8x faster than NCCL).

With >= 2 CUDA devices it also times ``CudaExecutor`` against ``torch.distributed``
NCCL all-reduce on the visible GPUs; otherwise it says that part was skipped.

    .venv/bin/python bench/blink.py --quick   # fixtures + 3/4/8-GPU subsets with GPU 0
    .venv/bin/python bench/blink.py --plot blink.png

The last stdout line is JSON with at least ``fixtures``, ``max_gap_to_min_cut`` and
``best_speedup_vs_ring``.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import bench_parser, emit_json, free_ports, run_workers

from gossipnet.collectives.blink import packing as P
from gossipnet.collectives.blink.ring import ring_allreduce_time, ring_model, tree_allreduce_time
from gossipnet.collectives.blink.topology import GpuTopology, parse_topo_matrix

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi-topo"
#: P100 NVLink 1.0 is 20 GB/s per direction per link (ALGORITHMS.md 5.2); the text
#: matrix cannot say so, the others keep the parser's default (25).
LINK_GBPS = {"dgx1-p100.txt": 20.0}
SIZE_GB = 0.256
CHUNKS = 64
#: ALGORITHMS.md 5.2: NVLink-only broadcast min cut in links over k-GPU allocations.
PUBLISHED_CUTS = {
    "v100": {2: "0-2", 3: "0-3", 4: "0-4", 5: "1-3", 6: "2-4", 7: "4", 8: "6"},
    "p100": {2: "0-1", 3: "0-2", 4: "0-3", 5: "1-2", 6: "2-3", 7: "3", 8: "4"},
}
PUBLISHED = "Blink (MLSys 2020, abstract): up to 8x faster than NCCL; up to 40% less training time"


def analyse(topo: GpuTopology, gpus: tuple[int, ...], full: bool = True) -> dict[str, Any]:
    """All figures of one allocation (see the module docstring)."""
    k = len(gpus)
    nv = topo.capacity_matrix(gpus)
    hybrid = topo.capacity_matrix(gpus, include_pcie=True)
    row: dict[str, Any] = {"gpus": gpus, "k": k}
    bc = P.pack_broadcast(nv, 0)
    row["bcast_min_cut"] = bc.min_cut
    row["bcast_rate"] = bc.rate
    row["bcast_trees"] = len(bc.trees)
    row["bcast_min_cut_any_root"] = min(P.broadcast_min_cut(nv, r) for r in range(k))
    if full and bc.min_cut > 0:
        mwu = P.pack_broadcast(nv, 0, max_trees=None)
        row["mwu_gap"] = mwu.gap
        row["mwu_trees"] = len(mwu.trees)
        assert P.fits(mwu, nv, "down")
        assert P.fits(bc, nv, "down")
        assert P.fits(bc, nv, "up")
    ring = ring_model(nv, topo.pcie_gbps)
    row["ring_gbps"] = ring.bandwidth
    row["ring_transport"] = ring.transport
    t_ring = ring_allreduce_time(SIZE_GB, k, ring.bandwidth)
    for name, cap in (("nvl", nv), ("hyb", hybrid)):
        ar = P.pack_allreduce(cap)
        assert P.fits(ar, cap, "both")
        height = max((t.height for t in ar.trees), default=0)
        t_tree = tree_allreduce_time(SIZE_GB, ar.rate, height, CHUNKS)
        row[f"{name}_rate"] = ar.rate
        row[f"{name}_bound"] = ar.min_cut
        row[f"{name}_trees"] = len(ar.trees)
        row[f"{name}_speedup"] = t_ring / t_tree if t_tree > 0 else float("nan")
    return row


def _fmt(row: dict[str, Any]) -> str:
    gap = row.get("mwu_gap")
    nvl = f"{row['nvl_speedup']:.2f}x" if row["nvl_rate"] > 0 else "-"
    return (
        f"{row['label']:<34} {row['k']:>2} {row['bcast_min_cut']:>7.1f} {row['bcast_rate']:>7.1f}"
        f" {(f'{100 * gap:.2f}%' if gap is not None else '-'):>6} {row['bcast_trees']:>3}"
        f" {row['nvl_rate']:>6.1f}/{row['nvl_bound']:<6.1f} {row['nvl_trees']:>2}"
        f" {row['hyb_rate']:>6.1f} {row['hyb_trees']:>2}"
        f" {row['ring_gbps']:>6.1f} {row['ring_transport']:<6}"
        f" {nvl:>7} {row['hyb_speedup']:>6.2f}x"
    )


HEADER = (
    f"{'allocation':<34} {'k':>2} {'mincut':>7} {'packed':>7} {'MWUgap':>6} {'#T':>3}"
    f" {'AR nvl/bound':>13} {'#T':>2} {'AR hyb':>6} {'#T':>2} {'ring':>6} {'via':<6}"
    f" {'nvl x':>7} {'hyb x':>7}"
)


def fixture_rows(full: bool) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(FIXTURES.glob("*.txt")):
        if "nvlink-status" in path.name:
            continue  # an `nvlink -s` status, not a matrix
        topo = parse_topo_matrix(path.read_text(), link_gbps=LINK_GBPS.get(path.name))
        row = analyse(topo, topo.gpus, full)
        row["label"] = f"{path.stem} (islands {len(topo.islands())})"
        rows.append(row)
    return rows


def dgx_rows(quick: bool, full: bool) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for machine, name in (("v100", "dgx1-v100.txt"), ("p100", "dgx1-p100.txt")):
        topo = parse_topo_matrix((FIXTURES / name).read_text(), link_gbps=LINK_GBPS.get(name))
        sizes = (3, 4, 8) if quick else range(2, 9)
        rows = []
        for k in sizes:
            for sub in itertools.combinations(topo.gpus, k):
                if quick and sub[0] != 0:
                    continue
                row = analyse(topo, sub, full and k >= 3)
                row["label"] = f"{machine} {sub}"
                rows.append(row)
        out[machine] = rows
    return out


def cut_table(rows: list[dict[str, Any]], machine: str, link: float) -> list[str]:
    lines = []
    for k in sorted({r["k"] for r in rows}):
        cuts = [round(r["bcast_min_cut_any_root"] / link) for r in rows if r["k"] == k]
        ours = f"{min(cuts)}-{max(cuts)}" if min(cuts) != max(cuts) else f"{min(cuts)}"
        pub = PUBLISHED_CUTS[machine][k]
        lines.append(f"  {machine} k={k}: ours {ours:<5} ALGORITHMS.md {pub}")
    return lines


def _nccl_worker(rank: int, world: int, port: int, numel: int, iters: int) -> float:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        x = torch.ones(numel, device=f"cuda:{rank}")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters
    finally:
        dist.destroy_process_group()


def gpu_timing(numel: int, iters: int) -> dict[str, Any] | None:
    """Seconds per all-reduce: CudaExecutor (one process) vs NCCL (one per GPU)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"GPU timing skipped: {n} CUDA device(s), needs >= 2")
        return None
    from gossipnet.collectives.blink.detect import detect
    from gossipnet.collectives.blink.executor import CudaExecutor

    topo = detect()
    gpus = tuple(range(n))
    cap = topo.capacity_matrix(gpus, include_pcie=True) if topo else np.full((n, n), 12.0)
    ex = CudaExecutor(P.pack_allreduce(cap), chunks=16)
    xs = [torch.ones(numel, device=f"cuda:{i}") for i in gpus]
    for _ in range(3):
        ex.all_reduce(xs)
    for i in gpus:
        torch.cuda.synchronize(i)
    t0 = time.perf_counter()
    for _ in range(iters):
        ex.all_reduce(xs)
    for i in gpus:
        torch.cuda.synchronize(i)
    blink_s = (time.perf_counter() - t0) / iters
    assert all(torch.allclose(x, torch.ones_like(x)) for x in xs)
    port = free_ports(1)[0]
    nccl = run_workers(_nccl_worker, n, (n, port, numel, iters), timeout_s=300)
    nccl_s = max(nccl)
    print(
        f"GPU timing, {n} GPUs, {numel * 4 / 1e6:.0f} MB fp32: blink {blink_s * 1e3:.2f} ms,"
        f" NCCL {nccl_s * 1e3:.2f} ms, ratio {nccl_s / blink_s:.2f}x"
    )
    return {"gpus": n, "blink_s": blink_s, "nccl_s": nccl_s}


def plot(rows: dict[str, list[dict[str, Any]]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot skipped: matplotlib is not installed")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for machine, rs in rows.items():
        ax.scatter([r["k"] for r in rs], [r["hyb_speedup"] for r in rs], label=machine, alpha=0.6)
    ax.set_xlabel("GPUs in the allocation")
    ax.set_ylabel("modelled speed-up, trees vs rings")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--plot", metavar="PATH", help="scatter of speed-ups (matplotlib)")
    parser.add_argument("--gpu-mb", type=float, default=256.0, help="buffer for GPU timing")
    args = parser.parse_args()
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    fixtures = fixture_rows(full=True)
    dgx = dgx_rows(args.quick, full=True)
    print(HEADER)
    for r in fixtures:
        print(_fmt(r))
    all_rows = fixtures + [r for rs in dgx.values() for r in rs]
    for machine, rs in dgx.items():
        print(f"\n{machine}: per allocation size (modelled all-reduce speed-up, hybrid trees)")
        for k in sorted({r["k"] for r in rs}):
            sp = [r["hyb_speedup"] for r in rs if r["k"] == k]
            nv = [r["nvl_speedup"] for r in rs if r["k"] == k and r["nvl_rate"] > 0]
            print(
                f"  k={k}: {len(sp):>3} allocations, speed-up min {min(sp):.2f}x median"
                f" {statistics.median(sp):.2f}x max {max(sp):.2f}x"
                f" (NVLink-only trees, connected ones: max {max(nv, default=float('nan')):.2f}x)"
            )
        best = sorted(rs, key=lambda r: -r["hyb_speedup"])[:5]
        print("  best allocations:")
        for r in best:
            print("   ", _fmt(r))
        link = 20.0 if machine == "p100" else 25.0
        print("  broadcast min cut in links (min over roots), vs ALGORITHMS.md 5.2:")
        print("\n".join(cut_table(rs, machine, link)))
    print(f"\npublished: {PUBLISHED}")
    gaps = [r["mwu_gap"] for r in all_rows if "mwu_gap" in r]
    kept = [r["bcast_rate"] / r["bcast_min_cut"] for r in all_rows if r["bcast_min_cut"] > 0]
    ar_kept = [r["hyb_rate"] / r["hyb_bound"] for r in all_rows if r["hyb_bound"] > 0]
    timing = None
    try:
        timing = gpu_timing(int(args.gpu_mb * 2**20 / 4), 5 if args.quick else 20)
    except ImportError:
        print("GPU timing skipped: torch unavailable")
    if args.plot:
        plot(dgx, args.plot)
    dgx_all = [r for rs in dgx.values() for r in rs]
    summary = {
        "fixtures": len(fixtures),
        "allocations": len(dgx_all),
        "max_gap_to_min_cut": max(gaps),
        "min_reduced_bcast_fraction": min(kept),
        "min_reduced_allreduce_fraction": min(ar_kept),
        "max_trees": max(max(r["bcast_trees"], r["hyb_trees"]) for r in all_rows),
        "best_speedup_vs_ring": max(r["hyb_speedup"] for r in dgx_all),
        "best_speedup_vs_ring_nvlink_only": max(
            r["nvl_speedup"] for r in dgx_all if r["nvl_rate"] > 0
        ),
        "published_speedup": "up to 8x (abstract)",
        "gpu_timing": timing,
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - t_wall, 1),
        "cpu_s": round(time.process_time() - t_cpu, 1),
    }
    emit_json(summary)


if __name__ == "__main__":
    main()
