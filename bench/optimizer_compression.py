"""The optimizer's ``compress=`` against the ``all_reduce(step=)`` path and dense, at 10% loss.

Why: ``compress=`` must mean the same on every path.  ``net.optimizer(adam,
compress=...)`` steps each shard at its owner and broadcasts the parameters;
``net.all_reduce(grads, compress=..., step=adam)`` broadcasts the averaged
gradients and every peer steps Adam.  Both must send far fewer bytes than dense
in *both* directions and train as well as dense under loss.  This bench runs
them side by side in one process, same data, init and loss seeds.

Task: a synthetic 10-class problem shaped like scikit-learn's digits (64
features, 1,600 training samples split over the peers, 2,000 held out), made
here from a seed: each class is a mixture of 4 prototypes, each sample one
prototype at a random scale plus noise.  Model: an MLP 64-128-10 (9,610
parameters), Adam (lr 1e-3), batch 32 per peer, 4 peers (``run_peers``: joined
peers with their own loop threads on a memory network), seeded random loss on
every packet (``FaultPlan(loss=...)``).  Every run ends with a resync
(``opt.resync()`` / ``net.resync(opt)``: one model on every peer) and reports
held-out accuracy (the mean over peers; ``spread`` the largest parameter
difference between replicas after the resync: 0) and wire bytes per step: every
byte the peers' transports sent during training, resyncs and heartbeats
included, summed over peers, divided by the steps.

Rows: ``dense`` (``net.optimizer(adam)``), ``opt`` (``net.optimizer(adam,
compress=C)``), ``ar`` (``net.all_reduce(grads, compress=C, step=adam)``), with
``C = ArcTopK(density, values)`` (``--compress``: DCT, Int8 or bf16).  The summary gives
per row the median over
seeds with the range, and ``bytes_ratio`` (dense bytes / the row's) and
``acc_delta`` (the row's median accuracy minus dense's, points).

    PYTHONPATH=$PWD .venv/bin/python bench/optimizer_compression.py            # 3 seeds, 600 steps
    PYTHONPATH=$PWD .venv/bin/python bench/optimizer_compression.py --quick    # 1 seed, 150 steps
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from _common import bench_parser, emit_json

import gossipnet
from gossipnet.testing import run_peers

PEERS = 4
FEATURES, CLASSES, PROTOS = 64, 10, 4
TRAIN_PER_PEER, HELD_OUT = 400, 2000
BATCH = 32
LR = 1e-3


@dataclass(frozen=True)
class Data:
    x: torch.Tensor
    y: torch.Tensor


def make_data(seed: int) -> tuple[list[Data], Data]:
    """Each peer's training samples and the held-out set, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randn(CLASSES, PROTOS, FEATURES, generator=gen)

    def draw(n: int) -> Data:
        y = torch.randint(0, CLASSES, (n,), generator=gen)
        which = torch.randint(0, PROTOS, (n,), generator=gen)
        scale = 0.7 + 0.6 * torch.rand(n, 1, generator=gen)
        x = protos[y, which] * scale + 1.1 * torch.randn(n, FEATURES, generator=gen)
        return Data(x, y)

    train = [draw(TRAIN_PER_PEER) for _ in range(PEERS)]
    return train, draw(HELD_OUT)


def make_model(seed: int) -> torch.nn.Module:
    """The MLP, initialised from ``seed`` alone (the peers are threads sharing torch's
    global RNG: the weights are drawn from a generator of their own)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES)
    )
    gen = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for p in model.parameters():
            bound = 1.0 / (p.shape[-1] ** 0.5) if p.dim() > 1 else 0.05
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return model


def compressor(family: str, density: float, values: str) -> Any:
    """``--compress``: ArcTopK or DCT at ``density`` with ``values``, or a quantiser."""
    if family == "arctopk":
        return gossipnet.ArcTopK(density=density, values=values)
    if family == "dct":
        return gossipnet.DCT(density=density, values=values)
    return gossipnet.Int8() if family == "int8" else family


def run(row: str, seed: int, steps: int, loss: float, spec: Any) -> dict[str, Any]:
    """One training run of ``row`` on 4 peers; accuracy, bytes per step, spread."""
    train, held = make_data(seed)

    def body(rank: int, net: gossipnet.Peer) -> tuple[float, int, torch.Tensor]:
        torch.set_num_threads(1)
        model = make_model(seed)
        params = list(model.parameters())
        base = torch.optim.Adam(params, lr=LR)
        opt = None
        if row == "dense":
            opt = net.optimizer(base)
        elif row == "opt":
            opt = net.optimizer(base, compress=spec)
        data, gen = train[rank], torch.Generator().manual_seed(seed * 100 + rank)
        sent0 = net.stats()["transport"]["sent_bytes"]
        for _ in range(steps):
            idx = torch.randint(0, data.x.shape[0], (BATCH,), generator=gen)
            loss_t = torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
            base.zero_grad(set_to_none=False)
            loss_t.backward()
            if opt is not None:
                opt.step()
            else:
                net.all_reduce([p.grad for p in params], compress=spec, step=base)  # type: ignore[misc]
        if opt is not None:
            opt.resync()
        else:
            net.resync(base)
        sent = net.stats()["transport"]["sent_bytes"] - sent0
        with torch.no_grad():
            acc = float((model(held.x).argmax(dim=1) == held.y).float().mean())
        return acc, sent, torch.cat([p.detach().reshape(-1) for p in params])

    faults = gossipnet.FaultPlan(loss=loss, seed=seed) if loss else None
    t0 = time.perf_counter()
    out = run_peers(
        PEERS, body, timeout_s=900, faults=faults, collective_timeout_s=2.0,
        heartbeat_interval_s=0.5,
    )  # fmt: skip
    return {
        "row": row,
        "seed": seed,
        "loss": loss,
        "acc": 100 * statistics.fmean(o[0] for o in out),
        "bytes_per_step": sum(o[1] for o in out) / steps,
        "spread": max(float((o[2] - out[0][2]).abs().max()) for o in out),
        "wall_s": time.perf_counter() - t0,
    }


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row: medians and ranges over seeds; ratios against dense."""
    rows: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["row"] for r in results):
        got = [r for r in results if r["row"] == name]
        acc = [r["acc"] for r in got]
        nbytes = [r["bytes_per_step"] for r in got]
        rows[name] = {
            "acc_median": statistics.median(acc),
            "acc_range": [min(acc), max(acc)],
            "bytes_per_step_median": statistics.median(nbytes),
            "bytes_range": [min(nbytes), max(nbytes)],
            "spread_max": max(r["spread"] for r in got),
        }
    dense = rows.get("dense")
    if dense is not None:
        for r in rows.values():
            r["bytes_ratio"] = dense["bytes_per_step_median"] / r["bytes_per_step_median"]
            r["acc_delta"] = r["acc_median"] - dense["acc_median"]
    return rows


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--loss", type=float, default=0.1)
    parser.add_argument("--compress", default="arctopk", choices=["arctopk", "dct", "int8", "bf16"])
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--values", default="int8")
    parser.add_argument("--rows", nargs="+", default=["dense", "opt", "ar"])
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps = 1, 150
    spec = compressor(args.compress, args.density, args.values)
    results = []
    for seed in range(args.seeds):
        for row in args.rows:
            r = run(row, seed, args.steps, args.loss, None if row == "dense" else spec)
            print(
                f"{row:6s} seed {seed}: acc {r['acc']:.2f}%  {r['bytes_per_step']:,.0f} B/step"
                f"  spread {r['spread']:.3g}  ({r['wall_s']:.0f} s)",
                flush=True,
            )
            results.append(r)
    rows = summary(results)
    for name, r in rows.items():
        print(
            f"{name:6s} acc {r['acc_median']:.2f} [{r['acc_range'][0]:.2f}-{r['acc_range'][1]:.2f}]"
            f"  {r['bytes_per_step_median']:,.0f} B/step"
            f"  x{r.get('bytes_ratio', float('nan')):.2f} fewer"
            f"  {r.get('acc_delta', float('nan')):+.2f} pt vs dense",
            flush=True,
        )
    emit_json(
        {
            "loss": args.loss,
            "steps": args.steps,
            "seeds": args.seeds,
            "compress": repr(spec),
            "rows": rows,
        }
    )


if __name__ == "__main__":
    main()
