"""CPU per data packet: the wire codec alone, and whole rounds on an in-process network.

Why: the packet path's cost is per packet (issue #21), so this bench reports it as
microseconds of CPU per data packet, apart from sockets and the kernel:

- ``encode_us`` / ``decode_us``: one reduce-scatter data packet (``--chunk-kib``
  payload) through ``WireCodec.encode`` and ``WireCodec.decode`` (network MAC under
  the pair key of two codecs introduced to each other), one at a time;
  ``decode_batch_us``: the same packets through ``WireCodec.decode_batch`` (one
  call per drain of ``--batch`` packets).
- ``round_us_per_packet``: 4 nodes on one ``MemoryNetwork`` in this process run
  ``LossyAllReduce`` rounds of ``--elems`` float32; the process CPU time of the
  timed rounds divided by the data packets they sent, which is the send and the
  receive side of every packet together (the memory transport delivers one
  packet per call).  ``drain_us_per_packet``: the same with each node's arrivals
  handed over in drains of up to ``--drain`` packets (``PacketIO.on_batch``), as
  the socket backends' drains do, where the node offers it.
- ``parity_us_per_packet`` (``--parity K``): the drained rounds again with one XOR
  parity packet per K data packets of a stream, sent although nothing is lost
  (``parity_always``): their extra CPU per parity packet, against
  ``drain_us_per_packet`` for a data packet.

    .venv/bin/python bench/packet_path.py --quick    # < 30 s

The last stdout line is one JSON object with those keys.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from _common import bench_parser, emit_json

from gossipnet.collectives.lossy.engine import LossyAllReduce
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.config import Config
from gossipnet.runtime.dispatch import PacketIO
from gossipnet.testing import introduce
from gossipnet.testing.cluster import cluster
from gossipnet.transport.wire import WireCodec

SECRET = b"bench-packet-path"


def _introduced(cfg: Config) -> tuple[WireCodec, WireCodec]:
    """A sender ``a`` and a receiver ``b``, each bound to the other's key."""
    tx, rx = WireCodec(SECRET, cfg, "a"), WireCodec(SECRET, cfg, "b")
    introduce(tx, rx)
    return tx, rx


def _codec_figures(n: int, chunk_bytes: int, batch: int) -> dict[str, float]:
    """Microseconds of CPU per packet: encode, decode one by one, decode per batch
    (pairwise MACs: each receiver gets packets signed for its own key)."""
    cfg = Config(run="bench")
    payload = torch.randn(chunk_bytes // 4).numpy().tobytes()
    fields: dict[str, Any] = {
        "r": 7, "m": 0, "L": 123456789, "b": 0, "c": 5, "w": 1.0, "dt": "f32",
        "n": chunk_bytes // 4,
    }  # fmt: skip
    tx, rx = _introduced(cfg)
    t0 = time.process_time()
    packets = [tx.encode(LossyKind.RS_DATA, fields, payload, dst="b") for _ in range(n)]
    encode = time.process_time() - t0
    views = [[memoryview(f) for f in p] for p in packets]
    t0 = time.process_time()
    ok = sum(rx.decode(p) is not None for p in views)
    decode = time.process_time() - t0
    out = {"encode_us": 1e6 * encode / n, "decode_us": 1e6 * decode / n}
    if ok != n:
        raise SystemExit(f"only {ok} of {n} packets decoded: {dict(rx.rejects)}")
    batched = getattr(WireCodec, "decode_batch", None)
    if batched is not None:
        tx, rx = _introduced(cfg)  # a fresh receiver (window), so a fresh pair key
        packets = [tx.encode(LossyKind.RS_DATA, fields, payload, dst="b") for _ in range(n)]
        views = [[memoryview(f) for f in p] for p in packets]
        t0 = time.process_time()
        got = 0
        for i in range(0, n, batch):
            got += sum(p is not None for p in rx.decode_batch(views[i : i + batch]))
        out["decode_batch_us"] = 1e6 * (time.process_time() - t0) / n
        if got != n:
            raise SystemExit(f"only {got} of {n} packets decoded per batch: {dict(rx.rejects)}")
    return out


def _drains(node: Any, drain: int) -> None:
    """Hand ``node`` its arrivals in drains of up to ``drain`` packets, in order."""
    queue: list[list[memoryview]] = []

    def flush() -> None:
        while queue:
            batch, queue[:] = queue[:drain], queue[drain:]
            node.io.on_batch(batch)

    def handler(views: list[memoryview]) -> None:
        if not queue:
            asyncio.get_running_loop().call_soon(flush)
        queue.append(views)

    node.transport._handler = handler


async def _rounds(
    elems: int, chunk_bytes: int, reps: int, drain: int = 0, parity: int = 0
) -> dict[str, float]:
    """CPU per data packet of whole rounds, 4 in-process nodes (``parity``: a parity
    packet per that many data packets of a stream, sent on a clean network too)."""
    cfg = Config(
        run="bench", chunk_bytes=chunk_bytes, parity_group=parity, parity_always=bool(parity)
    )
    async with cluster(4, config=cfg) as nodes:
        if drain:
            for node in nodes:
                _drains(node, drain)
        engines = [LossyAllReduce(n) for n in nodes]
        bufs = [torch.randn(elems, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        for _ in range(2):  # warm-up: pools, spans
            await asyncio.gather(*(e.run([b]) for e, b in zip(engines, bufs, strict=True)))
        sent = parity_sent = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            reports = await asyncio.gather(
                *(e.run([b]) for e, b in zip(engines, bufs, strict=True))
            )
            sent += sum(r.packets_sent for r in reports)
            parity_sent += int(sum(r.extra.get("parity_sent", 0) for r in reports))
            if any(r.chunks_stale for r in reports):
                raise SystemExit("a lossless round left chunks stale")
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {
        "round_us_per_packet": 1e6 * cpu / max(1, sent),
        "round_cpu_s": cpu / reps,
        "round_wall_s": wall / reps,
        "packets_per_round": sent / reps,
        "parity_per_round": parity_sent / reps,
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--packets", type=int, default=20000)
    parser.add_argument("--chunk-kib", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--elems", type=int, default=4_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--drain", type=int, default=32, help="packets per drain")
    parser.add_argument(
        "--parity", type=int, default=0, help="also: CPU per parity packet at this group size"
    )
    args = parser.parse_args()
    if args.quick:
        args.packets, args.elems, args.reps = 10000, 1_000_000, 5
    torch.set_num_threads(1)
    chunk = args.chunk_kib * 1024
    out: dict[str, Any] = {"chunk_kib": args.chunk_kib, "elems": args.elems}
    out.update(_codec_figures(args.packets, chunk, args.batch))
    out.update(asyncio.run(_rounds(args.elems, chunk, args.reps)))
    if hasattr(PacketIO, "on_batch"):
        drained = asyncio.run(_rounds(args.elems, chunk, args.reps, args.drain))
        out["drain_us_per_packet"] = drained["round_us_per_packet"]
        out["drain_round_cpu_s"] = drained["round_cpu_s"]
        if args.parity:  # the same drained rounds, each stream followed by its parity
            par = asyncio.run(_rounds(args.elems, chunk, args.reps, args.drain, args.parity))
            extra = par["round_cpu_s"] - drained["round_cpu_s"]
            out["parity_per_round"] = par["parity_per_round"]
            out["parity_us_per_packet"] = 1e6 * extra / max(1.0, par["parity_per_round"])
    for key, value in out.items():
        print(f"{key:>22}: {value:.2f}" if isinstance(value, float) else f"{key:>22}: {value}")
    emit_json(out)


if __name__ == "__main__":
    main()
