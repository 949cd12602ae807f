"""The shared training harness: a tiny character-level transformer LM, data-parallel
over N local peer processes that talk gossipnet over lossy loopback TCP.

Why a real task and not a toy quadratic: the claim to check is about *training*
(Weintraub et al. 2025: 10% random loss moves LM perplexity by under 1%), and a
noisy real loss curve is what exposes bias (zero-filled gradients) or unbounded
drift (stale parameters that never heal).  Why the standard library's own
sources as text: they are on every machine that runs Python, need no download,
and are large enough (several MB) that a one-minute run does not memorise them.

This module runs the peers: one spawned process per peer (:func:`_worker`), the
training loop of each (:func:`_train`) and the parent that hands out addresses
and gathers the records (:func:`run_demos`).  The settings and records are in
``_demo_config.py``, the data and model in ``_demo_model.py``; every name the
CLI, ``bench/quality.py`` and the tests use is importable from here (the
``import X as X`` lines re-export them).

Used by ``gossipnet demo``, ``bench/quality.py`` and the integration tests;
internal (``_demo``): its names may change without notice.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gossipnet._join import join
from gossipnet.demo.config import SPLITS as SPLITS
from gossipnet.demo.config import STRATEGIES as STRATEGIES
from gossipnet.demo.config import DemoConfig, DemoResult, EvalRecord, StepRecord
from gossipnet.demo.config import LateLoss as LateLoss
from gossipnet.demo.model import VOCAB
from gossipnet.demo.model import CharLM as CharLM
from gossipnet.demo.model import eval_windows as eval_windows
from gossipnet.demo.model import evaluate as evaluate
from gossipnet.demo.model import load_corpus as load_corpus
from gossipnet.demo.model import lr_at as lr_at
from gossipnet.demo.model import sample_windows as sample_windows
from gossipnet.demo.model import shard_stream as shard_stream
from gossipnet.peer import Peer
from gossipnet.reports import CollectiveReport

__all__ = ("VOCAB", "DemoConfig", "DemoResult", "EvalRecord", "StepRecord", "run_demos")


# ---------------------------------------------------------------------- one peer
def _worker(rank: int, cfgs: list[DemoConfig], inbox: Any, out: Any) -> None:
    """One peer process: train every config in turn, reporting each step to ``out``.

    Why one process for several runs: importing torch costs seconds per process.
    Each run's addresses arrive just before it starts: ports picked minutes ahead
    may meanwhile have become some connection's ephemeral source port.
    """
    torch.set_num_threads(1)  # N processes share the cores; more threads only contend
    try:
        for i, cfg in enumerate(cfgs):
            out.put(("want", i, rank))
            _train(i, rank, cfg, inbox.get(timeout=600.0), out)
    except BaseException:
        out.put(("error", -1, rank, traceback.format_exc()))
        raise


def _barrier(net: Peer, cfg: DemoConfig) -> None:
    """One tiny all-reduce: a start (and end) barrier.

    Exactly one on every peer, whatever its outcome: rounds pair the peers'
    calls by round number, so a peer that made an extra call would pair its
    step k with the others' step k + 1 for the rest of the run.  Why at the
    start: ``join()`` returns once it has *heard* from every peer, but its own
    ZeroMQ connection to a peer may not be up yet, and the first step would
    lose a whole phase to it.  Why at the end: a peer that leaves while a slower
    one is still in the last step takes its queued packets with it.
    """
    net.all_reduce([torch.zeros(cfg.peers * (cfg.chunk_bytes or 65536) // 4)], timeout=2.0)


def _exchange(
    net: Peer, cfg: DemoConfig, model: CharLM, base: torch.optim.Optimizer
) -> tuple[Callable[[int], CollectiveReport], Callable[[], bool | None]]:
    """``cfg.strategy``'s per-step exchange ``step -> CollectiveReport``, and its
    ``finish``: a last resync and the replica-digest verdict (None: the strategy has
    no resync, so only the replicas' eval losses can be compared)."""
    if cfg.strategy == "allreduce":
        opt = net.optimizer(base, strategy="allreduce")

        def finish() -> bool:
            opt.resync()  # replicas must now be bit-identical: check, do not assume
            return bool(net.replicas_agree(timeout=5.0))

        return (lambda step: opt.step()), finish
    params = list(model.parameters())

    def grads_then_step(step: int) -> CollectiveReport:
        rep = net.all_reduce([p.grad for p in params])  # type: ignore[misc]
        base.step()
        return rep

    return grads_then_step, lambda: None


def _setup(
    rank: int, cfg: DemoConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Generator, CharLM, torch.optim.Optimizer]:
    """Peer ``rank``'s data and model: ``(shard, held_out, gen, model, base)``.

    ``shard``: its own slice of the training stream; ``held_out``: the evaluation
    windows (the same on every peer); ``gen``: its batch sampler's generator;
    ``model`` and the AdamW ``base``: the same initial weights on every peer.
    """
    train, held = load_corpus(cfg.corpus_bytes)
    shard = shard_stream(train, rank, cfg)
    held_out = eval_windows(held, cfg.eval_windows, cfg.context)
    gen = torch.Generator().manual_seed(cfg.data_seed * 1000 + rank)
    torch.manual_seed(cfg.model_seed)  # the same initial weights on every peer
    model = CharLM(cfg)
    base = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    return shard, held_out, gen, model, base


def _train(run: int, rank: int, cfg: DemoConfig, addrs: list[str], out: Any) -> None:
    """Run ``run`` on peer ``rank``: join, barrier, train, evaluate, barrier, leave."""
    shard, held_out, gen, model, base = _setup(rank, cfg)
    overrides: dict[str, Any] = {
        "resync_every_steps": cfg.resync_every,
        "redundancy": cfg.redundancy,
        "parity_group": cfg.parity_group,
        "stale_step": cfg.stale_step,
    }
    if cfg.chunk_bytes is not None:
        overrides["chunk_bytes"] = cfg.chunk_bytes
    late = LateLoss(cfg.loss) if cfg.loss_from else None
    with join(
        peers=addrs,
        listen=addrs[rank],
        secret=b"gossipnet-demo",
        faults=cfg.fault_plan(late),
        peer_id=f"peer{rank}",
        run=f"gossipnet-demo-{run}",
        collective_timeout_s=cfg.timeout_s,
        **overrides,
    ) as net:
        exchange, finish = _exchange(net, cfg, model, base)
        _barrier(net, cfg)
        out.put(("ready", run, rank, time.monotonic()))
        parent = mp.parent_process()
        for step in range(cfg.steps):
            if parent is not None and not parent.is_alive():
                raise SystemExit("the parent process is gone")  # killed: do not linger
            t0 = time.perf_counter()
            if late is not None and step == cfg.loss_from:
                late.on = True
            for group in base.param_groups:
                group["lr"] = lr_at(cfg, step)
            loss = model.loss(sample_windows(shard, cfg.batch, cfg.context, gen))
            base.zero_grad(set_to_none=False)
            loss.backward()
            rep = exchange(step)
            out.put(("step", run, StepRecord(
                rank, step + 1, rep.round, float(loss.item()), rep.packets_sent,
                rep.packets_received, rep.packets_lost, len(rep.contributors), rep.chunks_stale,
                rep.elapsed_s, time.perf_counter() - t0, rep.timed_out,
            )))  # fmt: skip
            if step + 1 == cfg.steps:
                agree = finish()
                rec = EvalRecord(rank, step + 1, evaluate(model, held_out), agree)
                out.put(("eval", run, rec))
            elif (step + 1) % cfg.eval_every == 0:
                out.put(("eval", run, EvalRecord(rank, step + 1, evaluate(model, held_out))))
        _barrier(net, cfg)
    out.put(("done", run, rank, time.monotonic()))


# ---------------------------------------------------------------------- the run
def free_tcp_addresses(n: int) -> list[str]:
    """``n`` distinct ``tcp://127.0.0.1:port`` addresses that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return [f"tcp://127.0.0.1:{p}" for p in ports]


def run_demos(
    cfgs: Sequence[DemoConfig],
    on_step: Callable[[int, StepRecord], None] | None = None,
    *,
    timeout_s: float | None = None,
) -> list[DemoResult]:
    """Train each config in turn on one set of spawned peer processes.

    All configs need the same ``peers``.  ``on_step(run_index, record)`` sees
    every peer's step records as they arrive.  A worker that fails stops
    everything: the others are killed (they would wait for it in every round)
    and RuntimeError carries the worker's traceback; so does passing
    ``timeout_s`` (default: scales with the total number of steps).

    Raises:
        ValueError: no configs, or configs with different ``peers``.
        RuntimeError: a worker failed or died, or the runs timed out.
    """
    if not cfgs or len({c.peers for c in cfgs}) != 1:
        raise ValueError("run_demos needs configs that all have the same number of peers")
    n = cfgs[0].peers
    ctx = mp.get_context("spawn")  # fork would copy torch's thread pools and our sockets
    out = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(n)]
    procs = [
        ctx.Process(target=_worker, args=(r, list(cfgs), inboxes[r], out), daemon=True)
        for r in range(n)
    ]
    results = [DemoResult(config=c) for c in cfgs]
    limit = timeout_s if timeout_s is not None else 120.0 + 2.0 * sum(c.steps for c in cfgs)
    ok = False
    for p in procs:
        p.start()
    try:
        _collect(results, procs, out, inboxes, on_step, time.monotonic() + limit)
        ok = True
    finally:
        for p in procs:
            p.join(timeout=5.0 if ok else 0.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        out.close()
    return results


def _collect(
    results: list[DemoResult],
    procs: list[Any],
    out: Any,
    inboxes: list[Any],
    on_step: Callable[[int, StepRecord], None] | None,
    deadline: float,
) -> None:
    """The parent's side of :func:`run_demos`: file the workers' messages until the
    last run is done; hand out each run's addresses once every worker asks."""
    n = len(procs)
    count: dict[tuple[str, int], int] = {}
    starts = [time.monotonic()] * len(results)  # run 0 counts spawning and imports
    while count.get(("done", len(results) - 1), 0) < n:
        try:
            kind, run, *payload = out.get(timeout=0.5)
        except queue.Empty:
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead and out.empty():
                raise RuntimeError(f"demo peer(s) died, exit codes {dead}") from None
            if time.monotonic() > deadline:
                raise RuntimeError("demo timed out; see run_demos(timeout_s=...)") from None
            continue
        if kind == "error":
            raise RuntimeError(f"demo peer {payload[0]} failed:\n{payload[1]}")
        res = results[run]
        count[kind, run] = count.get((kind, run), 0) + 1
        if kind == "step":
            res.steps.append(payload[0])
            if on_step is not None:
                on_step(run, payload[0])
        elif kind == "eval":
            res.evals.append(payload[0])
        elif kind == "want" and count[kind, run] == n:  # everyone is waiting: go
            starts[run] = starts[run] if run == 0 else time.monotonic()
            addrs = free_tcp_addresses(n)
            for box in inboxes:
                box.put(addrs)
        elif kind == "ready":
            res.startup_s = max(res.startup_s, payload[1] - starts[run])
        elif kind == "done" and count[kind, run] == n:
            res.wall_s = payload[1] - starts[run]
