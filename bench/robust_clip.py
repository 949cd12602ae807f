"""CPU of an owner's reduction, weighted mean against centered clipping, and what one
peer sending garbage does to each.

The owner of a shard of ``--elems`` float32 takes ``--peers - 1`` contributions to it
(8 KiB chunks, in drains of ``--drain`` as the receive path hands them over) and
averages, with the plain reducer (:class:`ShardReducer`) and with
:class:`ClippingReducer` (``--tau``, ``--iters``), started from the owner's own
values (``clip``) and from the median (``clip_median``); no network, the
arithmetic alone:

- ``mean_ms`` / ``clip_ms`` / ``clip_median_ms``: process CPU per reduction (taking
  the parts and averaging), the median of ``--reps``; ``clip_over_mean``: the ratio.
- ``*_err_quiet`` / ``*_err_garbage``: ``||result - honest mean|| / ||honest mean||``
  where every contribution is ``signal + 0.1 noise`` (``signal`` of unit RMS), with no
  attacker and with one peer sending its contribution times ``--scale``.

    .venv/bin/python bench/robust_clip.py --quick    # < 30 s

The last stdout line is one JSON object with those keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from _common import bench_parser, emit_json, median

from gossipnet.collectives.lossy.reducer import ShardReducer
from gossipnet.collectives.lossy.robust import CenteredClip, ClippingReducer

STEP = 2048  # float32 elements of an 8 KiB chunk


def _contributions(peers: int, elems: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(elems, generator=gen)
    return [signal + 0.1 * torch.randn(elems, generator=gen) for _ in range(peers)]


def _reduce(
    make: Callable[[torch.Tensor], ShardReducer], xs: list[torch.Tensor], drain: int
) -> tuple[torch.Tensor, float]:
    """Row 0 is ours; the others arrive as chunks in drains.  (result, CPU seconds)."""
    t0 = time.process_time()
    red = make(xs[0].clone())
    nchunks = -(-xs[0].numel() // STEP)
    parts = [
        (f"p{i}", c, x[c * STEP : (c + 1) * STEP], 1.0)
        for i, x in enumerate(xs[1:], start=1)
        for c in range(nchunks)
    ]
    for k in range(0, len(parts), drain):
        red.accumulate_batch(parts[k : k + drain])
    out = red.average(xs[0])
    return out, time.process_time() - t0


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--elems", type=int, default=1 << 20)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--drain", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tau", type=float, default=0.3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1e3)
    args = parser.parse_args()
    if args.quick:
        args.reps = 3
    torch.set_num_threads(1)  # one owner's loop thread
    ids = [f"p{i}" for i in range(args.peers)]
    n = -(-args.elems // STEP)
    rules = {
        start: CenteredClip(tau=args.tau, iters=args.iters, start=start)
        for start in ("own", "median")
    }

    store = torch.empty(args.peers - 1, n * STEP)  # the engine's pooled store, reused

    def mean(acc: torch.Tensor) -> ShardReducer:
        return ShardReducer(acc, range(n), STEP, 1.0, ids[1:], store=store)

    def clip(acc: torch.Tensor) -> ShardReducer:
        return ClippingReducer(acc, range(n), STEP, 1.0, rules["own"], ids, "p0")

    def clip_median(acc: torch.Tensor) -> ShardReducer:
        return ClippingReducer(acc, range(n), STEP, 1.0, rules["median"], ids, "p0")

    kinds = (("mean", mean), ("clip", clip), ("clip_median", clip_median))

    out: dict[str, float] = {"elems": args.elems, "peers": args.peers, "tau": args.tau}
    xs = _contributions(args.peers, args.elems, 0)
    for name, make in kinds:
        out[f"{name}_ms"] = 1e3 * median(
            [_reduce(make, xs, args.drain)[1] for _ in range(args.reps)]
        )
    out["clip_over_mean"] = out["clip_ms"] / out["mean_ms"]
    honest = torch.stack(xs).mean(0)
    bad = [*xs[:-1], xs[-1] * args.scale]
    honest_bad = torch.stack(xs[:-1]).mean(0)
    for name, make in kinds:
        quiet = _reduce(make, xs, args.drain)[0]
        garbage = _reduce(make, bad, args.drain)[0]
        out[f"{name}_err_quiet"] = float((quiet - honest).norm() / honest.norm())
        out[f"{name}_err_garbage"] = float((garbage - honest_bad).norm() / honest_bad.norm())
    emit_json(out)


if __name__ == "__main__":
    main()
