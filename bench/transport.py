"""Goodput of gossipnet's transports against raw sockets, two processes on loopback.

Why: the transports promise UDP semantics without giving up the speed of
the socket under them.  This bench sends N packets of the wire shape
``[header 80 B, payload, mac 16 B]`` from one process to another and
measures, at the receiver, payload bytes received / (last - first arrival).

Rows, per payload size (ZeroMQ: 1 KiB and 64 KiB; UDP: 1 KiB, 8 KiB and 32 KiB):
  raw            pyzmq PUSH/PULL ``send_multipart`` (copying, as for a mutable
                 tensor buffer) / a plain UDP socket with the same datagram size
  raw-zc         pyzmq zero-copy send (``copy=False``) of an immutable ``bytes``
                 payload, ZeroMQ 64 KiB only
  gossipnet      ``Transport.send`` and the packet handler; the payload is a
                 mutable buffer, which ZmqTransport copies at send (as raw does)
  gossipnet-zc   the same with a ``bytes`` payload, which ZmqTransport sends
                 without a copy (compare with raw-zc)
  gossipnet+wire the same plus ``WireCodec.encode``/``decode`` (HMAC per packet)

UDP's gossipnet rows run twice: ``gso`` column ``on`` (``Config.udp_gso``: GSO
batches on send, GRO reads; the ``path`` column says what the kernel allowed,
sender/receiver) and ``off`` (one datagram per system call, as before #21).
``pkt/s`` is packets received per second; ``CPU s/MB`` is the CPU seconds both
processes spent (sender: its send loop; receiver: first to last packet) per
MB of payload received, the figure that matters on a busy machine.  Run with
another checkout's library first on ``PYTHONPATH`` to measure it with this bench
(its rows then show ``path`` ``plain``).

Senders go as fast as they can.  ZeroMQ is lossless once a packet is queued;
gossipnet's sender retries a dropped packet after 1 ms (``send`` never blocks).
UDP loses what the receiver cannot keep up with: the loss column says how much.
Every case runs ``--repeats`` times in interleaved rounds and the table shows
the median with the min..max spread: on a small shared machine the spread is
wide, so compare ratios, not single runs.

    .venv/bin/python bench/transport.py --quick      # < 60 s
    .venv/bin/python bench/transport.py              # 5x the packets

The last stdout line is one JSON object with the ratios at 64 KiB (ZeroMQ) and
32 KiB (UDP): ``{"zmq_vs_raw": ..., "udp_vs_raw": ..., ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import socket
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any

from gossipnet.collectives.lossy.kinds import LossyKind

HEADER = b"h" * 80
MAC = b"m" * 16
IDLE_S = 0.5  # a UDP receiver stops after this long without a packet


@dataclass(frozen=True)
class Case:
    backend: str  # "zmq" | "udp"
    variant: str  # "raw" | "raw-zc" | "gossipnet" | "gossipnet-zc" | "gossipnet+wire"
    payload_bytes: int
    packets: int
    uvloop: bool
    gso: bool = True  # UDP gossipnet rows: Config.udp_gso


@dataclass
class Result:
    packets: int = 0
    payload_bytes: int = 0
    first_s: float = 0.0
    last_s: float = 0.0
    sender_retries: int = 0
    cpu_first_s: float = 0.0  # receiver's process CPU time at the first and last packet
    cpu_last_s: float = 0.0
    sender_cpu_s: float = 0.0
    path: str = "-"  # "sender/receiver" UDP path (gso+gro, plain, ...)

    @property
    def cpu_s_per_mb(self) -> float:
        cpu = self.cpu_last_s - self.cpu_first_s + self.sender_cpu_s
        return cpu / (self.payload_bytes / 1e6) if self.payload_bytes else float("nan")

    @property
    def packets_per_s(self) -> float:
        span = self.last_s - self.first_s
        return self.packets / span if span > 0 and self.packets > 1 else 0.0

    @property
    def goodput_mbs(self) -> float:
        span = self.last_s - self.first_s
        return self.payload_bytes / span / 1e6 if span > 0 and self.packets > 1 else 0.0


def _config(case: Case) -> Any:
    from gossipnet.config import Config

    cfg = Config(chunk_bytes=case.payload_bytes, udp_socket_buffer_bytes=8 << 20)
    if "udp_gso" in Config.__dataclass_fields__:  # absent before #21: plain path only
        cfg = cfg.replace(udp_gso=case.gso)
    return cfg


def _run(case: Case, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if case.uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


# ---------------------------------------------------------------------- receivers
def _receive(case: Case, addr_q: Queue[str]) -> Result:
    res = Result()
    if case.variant.startswith("raw"):
        (_raw_zmq_recv if case.backend == "zmq" else _raw_udp_recv)(case, addr_q, res)
        return res

    async def main() -> None:
        from gossipnet.transport import create_transport

        cfg = _config(case)
        codec = None
        if case.variant == "gossipnet+wire":
            from gossipnet.transport.wire import WireCodec

            codec = WireCodec(b"bench", cfg, "receiver")
        done = asyncio.get_running_loop().create_future()

        def on_packet(frames: list[memoryview]) -> None:
            now = time.perf_counter()
            cpu = time.process_time()
            if codec is not None:
                pkt = codec.decode(frames)
                if pkt is None:
                    return
                size = pkt.payload.nbytes
            else:
                size = frames[1].nbytes
            if res.packets == 0:
                res.first_s, res.cpu_first_s = now, cpu
            res.last_s, res.cpu_last_s = now, cpu
            res.packets += 1
            res.payload_bytes += size
            if res.packets == case.packets and not done.done():
                done.set_result(None)

        listen = "tcp://127.0.0.1:0" if case.backend == "zmq" else "udp://127.0.0.1:0"
        t = create_transport(listen, cfg)
        addr_q.put(await t.start(on_packet))
        while not done.done():  # all packets, or (UDP) silence after the last one
            await asyncio.wait([done], timeout=0.05)
            idle_s = time.perf_counter() - res.last_s
            if case.backend == "udp" and res.packets and idle_s > IDLE_S:
                break
        res.path = getattr(t, "path", "plain") if case.backend == "udp" else "-"
        await t.close()

    _run(case, main)
    return res


def _raw_zmq_recv(case: Case, addr_q: Queue[str], res: Result) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, _config(case).recv_queue_packets)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    addr_q.put(f"tcp://127.0.0.1:{port}")
    copy = case.payload_bytes < zmq.COPY_THRESHOLD  # pyzmq's advice: zero-copy pays when large
    while res.packets < case.packets:
        parts = sock.recv_multipart(copy=copy)
        now = time.perf_counter()
        if res.packets == 0:
            res.first_s = now
        res.last_s = now
        res.packets += 1
        res.payload_bytes += memoryview(parts[1]).nbytes
    sock.close(linger=0)
    ctx.term()


def _raw_udp_recv(case: Case, addr_q: Queue[str], res: Result) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _config(case).udp_socket_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    addr_q.put(f"udp://127.0.0.1:{sock.getsockname()[1]}")
    sock.settimeout(IDLE_S)
    overhead = len(HEADER) + len(MAC)
    while res.packets < case.packets:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if res.packets:
                break
            continue
        now = time.perf_counter()
        if res.packets == 0:
            res.first_s = now
        res.last_s = now
        res.packets += 1
        res.payload_bytes += len(data) - overhead - 13  # 13: gossipnet's 3-frame framing
    sock.close()


# ---------------------------------------------------------------------- senders
def _send(case: Case, addr: str, release: Event) -> tuple[int, float, str]:
    """Send ``case.packets`` packets to ``addr``.

    Returns gossipnet's drop-and-retry count, the CPU seconds of the send loop
    and the sender's UDP path.
    """
    payload: Any = memoryview(bytearray(b"p" * case.payload_bytes))  # mutable, like a tensor
    if case.variant.endswith("-zc"):
        payload = b"p" * case.payload_bytes  # immutable: safe to send without a copy
    if case.variant.startswith("raw"):
        cpu0 = time.process_time()
        _raw_send(case, addr, payload, release)
        return 0, time.process_time() - cpu0, "-"
    retries, cpu_s, path = 0, 0.0, "-"

    async def main() -> None:
        nonlocal retries, cpu_s, path
        from gossipnet.transport import create_transport

        cfg = _config(case)
        listen = "tcp://127.0.0.1:0" if case.backend == "zmq" else "udp://127.0.0.1:0"
        t = create_transport(listen, cfg)
        await t.start(lambda frames: None)
        await t.connect(addr, 5.0)  # type: ignore[attr-defined]
        encode: Callable[[int], list[Any]] = lambda i: [HEADER, payload, MAC]  # noqa: E731
        if case.variant == "gossipnet+wire":
            from gossipnet.transport.wire import WireCodec

            codec = WireCodec(b"bench", cfg, "sender")
            encode = lambda i: codec.encode(LossyKind.RS_DATA, {"c": i}, payload)  # noqa: E731
        cpu0 = time.process_time()
        for i in range(case.packets):
            frames = encode(i)
            # send() never blocks and has no "writable" event: back off and retry.
            while not t.send(addr, frames):  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # the batched path flushes at the end of the loop turn
        cpu_s = time.process_time() - cpu0
        path = getattr(t, "path", "plain") if case.backend == "udp" else "-"
        retries = t.stats.dropped_queue_full
        await asyncio.to_thread(release.wait)  # closing (linger 0) would discard the queue
        await t.close()

    _run(case, main)
    return retries, cpu_s, path


def _raw_send(case: Case, addr: str, payload: Any, release: Event) -> None:
    if case.backend == "udp":
        host, port = addr.removeprefix("udp://").rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _config(case).udp_socket_buffer_bytes)
        datagram = bytes(13) + HEADER + bytes(payload) + MAC
        for _ in range(case.packets):
            sock.sendto(datagram, (host, int(port)))
        sock.close()
        return
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, _config(case).send_queue_packets)
    sock.connect(addr)
    copy = case.variant != "raw-zc"
    for _ in range(case.packets):
        sock.send_multipart([HEADER, payload, MAC], copy=copy)
    release.wait()
    sock.close(linger=0)
    ctx.term()


# ---------------------------------------------------------------------- workers
def _receiver_worker(cases: Queue[Case | None], addr_q: Queue[str], out: Queue[Result]) -> None:
    while (case := cases.get()) is not None:
        out.put(_receive(case, addr_q))


def _sender_worker(
    jobs: Queue[tuple[Case, str] | None], release: Event, out: Queue[tuple[int, float, str]]
) -> None:
    while (job := jobs.get()) is not None:
        out.put(_send(job[0], job[1], release))


def _get(q: Queue[Any], procs: list[mp.process.BaseProcess], timeout_s: float) -> Any:
    """``q.get`` that fails fast when a worker died instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            dead = [p.name for p in procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"bench worker(s) {dead or 'timed out'}") from None


def run_cases(
    one_round: list[Case], repeats: int, budget_s: float | None = None
) -> list[tuple[Case, Result]]:
    """Run ``repeats`` rounds of every case through one receiver and one sender process.

    Interleaved rounds spread slow phases of a shared machine over all rows
    instead of penalising whichever row ran during them.  With ``budget_s``,
    no round starts that would likely end past the budget (the first always runs).
    """
    ctx = mp.get_context("spawn")
    rx_q: Queue[Case | None] = ctx.Queue()
    tx_q: Queue[tuple[Case, str] | None] = ctx.Queue()
    addr_q: Queue[str] = ctx.Queue()
    rx_out: Queue[Result] = ctx.Queue()
    tx_out: Queue[tuple[int, float, str]] = ctx.Queue()
    release = ctx.Event()
    procs: list[mp.process.BaseProcess] = [
        ctx.Process(target=_receiver_worker, args=(rx_q, addr_q, rx_out), name="receiver"),
        ctx.Process(target=_sender_worker, args=(tx_q, release, tx_out), name="sender"),
    ]
    for p in procs:
        p.start()
    results = []
    started = time.monotonic()
    try:
        for done_rounds in range(repeats):
            elapsed_s = time.monotonic() - started
            if done_rounds and budget_s and elapsed_s * (1 + 1 / done_rounds) > budget_s:
                break
            for case in one_round:
                release.clear()
                rx_q.put(case)
                tx_q.put((case, _get(addr_q, procs, 60)))
                res = _get(rx_out, procs, 120)
                release.set()
                res.sender_retries, res.sender_cpu_s, tx_path = _get(tx_out, procs, 60)
                if case.backend == "udp" and not case.variant.startswith("raw"):
                    res.path = f"{tx_path}/{res.path}"
                results.append((case, res))
    finally:
        rx_q.put(None)
        tx_q.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def _wire_available() -> bool:
    try:
        import gossipnet.transport.wire  # noqa: F401
    except ImportError:
        return False
    return True


def build_cases(quick: bool, use_uvloop: bool) -> list[Case]:
    """One round: every (backend, size, variant)."""
    small, large = (30_000, 6_000) if quick else (200_000, 40_000)
    wire = ["gossipnet+wire"] if _wire_available() else []
    one_round = []
    for backend, sizes in (("zmq", (1024, 65536)), ("udp", (1024, 8192, 32768))):
        for size in sizes:
            zc = ["raw-zc", "gossipnet-zc"] if backend == "zmq" and size > 1024 else []
            packets = small if size <= 1024 else large
            for variant in ["raw", "gossipnet", *zc, *wire]:
                one_round.append(Case(backend, variant, size, packets, use_uvloop))
                if backend == "udp" and variant != "raw":  # the same with GSO/GRO off
                    one_round.append(Case(backend, variant, size, packets, use_uvloop, gso=False))
    return one_round


def report(results: list[tuple[Case, Result]]) -> dict[str, Any]:
    """Print the table of medians over repeats; return the summary for the JSON line.

    ``vs raw*``: median goodput over the raw row's median for the same backend and
    size; ``-zc`` rows are compared with ``raw-zc``, the others with ``raw``.
    """
    by_case: dict[Case, list[Result]] = {}
    for case, res in results:
        by_case.setdefault(case, []).append(res)

    def median_mbs(case: Case) -> float:
        return statistics.median(r.goodput_mbs for r in by_case[case])

    raw = {
        (c.backend, c.payload_bytes, c.variant.endswith("-zc")): median_mbs(c)
        for c in by_case
        if c.variant.startswith("raw")
    }
    print(
        f"{'backend':7} {'variant':15} {'gso':>3} {'payload':>8} {'MB/s':>9} {'min..max':>15} "
        f"{'vs raw*':>7} {'loss%':>6} {'retries':>8} {'pkt/s':>8} {'CPU s/MB':>8} path"
    )
    summary: dict[str, Any] = {"rounds": min(len(runs) for runs in by_case.values()), "rows": []}
    for case, runs in by_case.items():
        mbs = median_mbs(case)
        zc = case.variant.endswith("-zc")
        ratio = mbs / (raw.get((case.backend, case.payload_bytes, zc)) or float("nan"))
        loss = 100.0 * (1 - sum(r.packets for r in runs) / (case.packets * len(runs)))
        retries = sum(r.sender_retries for r in runs) // len(runs)
        spread = f"{min(r.goodput_mbs for r in runs):.0f}..{max(r.goodput_mbs for r in runs):.0f}"
        pps = statistics.median(r.packets_per_s for r in runs)
        cpu_mb = statistics.median(r.cpu_s_per_mb for r in runs)
        batched = case.backend == "udp" and not case.variant.startswith("raw")
        gso = ("on" if case.gso else "off") if batched else "-"
        print(
            f"{case.backend:7} {case.variant:15} {gso:>3} {case.payload_bytes:>8} {mbs:9.1f} "
            f"{spread:>15} {ratio:7.2f} {loss:6.1f} {retries:8d} {pps:8.0f} {cpu_mb:8.4f} "
            f"{runs[0].path}"
        )
        summary["rows"].append({**asdict(case), "goodput_mbs": round(mbs, 1),
                                "vs_raw": round(ratio, 3), "loss_pct": round(loss, 2),
                                "pkt_s": round(pps), "cpu_s_per_mb": round(cpu_mb, 5),
                                "path": runs[0].path})  # fmt: skip
        key = {("zmq", 65536): "zmq", ("udp", 32768): "udp"}.get((case.backend, case.payload_bytes))
        suffix = {"gossipnet": "", "gossipnet-zc": "_zc", "gossipnet+wire": "_wire"}
        if key and case.variant in suffix and case.gso:
            summary[f"{key}{suffix[case.variant]}_vs_raw"] = round(ratio, 3)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small N, finishes in < 60 s")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds (fewer if --quick runs late); medians"
    )
    args = parser.parse_args(argv)
    use_uvloop = args.loop == "uvloop"
    if use_uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            use_uvloop = False
    started = time.perf_counter()
    budget_s = 45.0 if args.quick else None  # --quick must end within a minute
    results = run_cases(build_cases(args.quick, use_uvloop), args.repeats, budget_s)
    summary = report(results)
    summary["loop"] = "uvloop" if use_uvloop else "asyncio"
    summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
