"""The shared training harness: a tiny character-level transformer LM, data-parallel
over N local peer processes that talk gossipnet over lossy loopback TCP.

Why a real task and not a toy quadratic: the claim to check is about *training*
(Weintraub et al. 2025: 10% random loss moves LM perplexity by under 1%), and a
noisy real loss curve is what exposes bias (zero-filled gradients) or unbounded
drift (stale parameters that never heal).  Why the standard library's own
sources as text: they are on every machine that runs Python, need no download,
and are large enough (several MB) that a one-minute run does not memorise them.

Used by ``gossipnet demo``, ``bench/quality.py`` and the integration tests;
internal (``_demo``): its names may change without notice.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import queue
import socket
import sysconfig
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .peer import Peer, join
from .rounds import CollectiveReport
from .transport.faults import FaultPlan, GilbertElliott

__all__ = ("VOCAB", "DemoConfig", "DemoResult", "EvalRecord", "StepRecord", "run_demos")

#: Fixed vocabulary: 0 = unknown byte, then newline, tab and printable ASCII.  Fixed
#: (not derived from the text) so that every peer and every run agree on token ids.
VOCAB = "\x00\n\t" + "".join(chr(c) for c in range(32, 127))
_LUT = np.zeros(256, dtype=np.uint8)
for _i, _ch in enumerate(VOCAB[1:], start=1):
    _LUT[ord(_ch)] = _i
STRATEGIES = ("allreduce", "grads")


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """One training run; the defaults finish in about a minute on 2 CPU cores.

    ``loss`` is the mean packet loss rate; with ``burst`` (mean burst length in
    packets) it is Gilbert-Elliott bursty loss instead of independent loss.
    ``strategy``: ``"allreduce"`` = ``net.optimizer`` (sharded step + parameter
    broadcast + a resync every ``resync_every`` rounds); ``"grads"`` =
    ``loss.backward(); net.all_reduce(grads); base.step()``: each peer steps a full
    replica, and wherever its averaged gradient chunk was lost it steps with its
    own, so replicas drift apart (nothing pulls them back; compare the two).
    """

    peers: int = 4
    steps: int = 300
    batch: int = 16
    context: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup_steps: int = 20
    eval_every: int = 50
    eval_windows: int = 128
    loss: float = 0.0
    burst: float | None = None
    seed: int = 7
    data_seed: int = 0
    model_seed: int = 0
    strategy: str = "allreduce"
    chunk_bytes: int | None = 16384
    resync_every: int = 100
    redundancy: int = 1  # Config.redundancy: copies of every data packet
    timeout_s: float = 2.0  # per collective: 30x a loaded round on loopback; caps stalls
    corpus_bytes: int = 4_000_000
    #: First step with loss (random loss only); the steps before it are loss-free, to
    #: see what loss costs late in training, near the paper's fine-tuning setting.
    loss_from: int = 0

    def __post_init__(self) -> None:
        if self.peers < 1 or self.steps < 1 or self.batch < 1 or self.context < 2:
            raise ValueError("peers, steps, batch must be >= 1 and context >= 2")
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of heads={self.heads}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.burst is not None and self.burst < 1.0:
            raise ValueError(f"burst is a mean burst length in packets (>= 1), got {self.burst}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not 1 <= self.redundancy <= 8:
            raise ValueError(f"redundancy must be in [1, 8], got {self.redundancy}")
        if self.eval_every < 1 or self.eval_windows < 1:
            raise ValueError("eval_every and eval_windows must be >= 1")
        if not 0 <= self.loss_from < self.steps or (self.loss_from and self.burst is not None):
            raise ValueError(
                f"loss_from must be in [0, steps) and needs random (not bursty) loss,"
                f" got {self.loss_from}"
            )

    def fault_plan(self, late: LateLoss | None = None) -> FaultPlan | None:
        """The :class:`gossipnet.FaultPlan` of this run (None when lossless).

        ``late``: with ``loss_from``, the switch the training loop turns on at that step.
        """
        if self.loss == 0.0:
            return None
        if self.burst is not None:
            return FaultPlan(seed=self.seed, burst=GilbertElliott.from_rate(self.loss, self.burst))
        if late is not None:
            return FaultPlan(seed=self.seed, link_loss=late)
        return FaultPlan(seed=self.seed, loss=self.loss)

    def label(self) -> str:
        """A short name for tables and plot legends, e.g. ``loss=10% burst=8``."""
        text = f"loss={self.loss:.0%}" if self.loss else "lossless"
        text += f" burst={self.burst:g}" if self.burst and self.loss else ""
        text += f" from step {self.loss_from}" if self.loss_from and self.loss else ""
        return text + (f" x{self.redundancy} copies" if self.redundancy > 1 else "")


class LateLoss:
    """``FaultPlan.link_loss`` that is 0 until the training loop sets ``on``."""

    def __init__(self, loss: float) -> None:
        self.loss = loss
        self.on = False

    def __call__(self, src: str, dst: str, t: float) -> float:
        return self.loss if self.on else 0.0


@dataclass(slots=True)
class StepRecord:
    """What one peer reports after one step (one CSV row)."""

    rank: int
    step: int
    round: int  # the collective's round number (the same on every peer in lockstep)
    train_loss: float
    packets_sent: int
    packets_received: int
    packets_lost: int
    contributors: int
    chunks_stale: int
    elapsed_s: float  # the collective
    step_s: float  # the whole step: batch, forward, backward, collective
    timed_out: bool


@dataclass(slots=True)
class EvalRecord:
    """Held-out loss (nats per character) of one peer's replica after ``step`` steps."""

    rank: int
    step: int
    eval_loss: float


@dataclass(slots=True)
class DemoResult:
    """Everything a run produced, gathered in the parent process."""

    config: DemoConfig
    steps: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    wall_s: float = 0.0
    startup_s: float = 0.0  # spawn + import + data + join, until the first step

    def eval_curve(self) -> list[tuple[int, float]]:
        """(step, eval loss averaged over peers) at every evaluation."""
        by_step: dict[int, list[float]] = {}
        for e in self.evals:
            by_step.setdefault(e.step, []).append(e.eval_loss)
        return [(s, sum(v) / len(v)) for s, v in sorted(by_step.items())]

    @property
    def final_eval_loss(self) -> float:
        curve = self.eval_curve()
        return curve[-1][1] if curve else float("nan")

    @property
    def final_ppl(self) -> float:
        """Per-character perplexity, exp(final eval loss)."""
        return math.exp(self.final_eval_loss)

    @property
    def lost_fraction(self) -> float:
        """Data packets lost / expected, over the whole run and all peers."""
        lost = sum(r.packets_lost for r in self.steps)
        got = sum(r.packets_received for r in self.steps)
        return lost / (lost + got) if lost + got else 0.0


# ---------------------------------------------------------------------- data
def load_corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) token streams from the standard library's top-level ``.py`` files.

    Files are read in sorted name order; every 10th file is held out for
    evaluation, so train and eval share no file.  Bytes outside the vocabulary
    map to 0.  Deterministic for a given Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no .py files under {root}: the demo's corpus is missing")
    train: list[bytes] = []
    held: list[bytes] = []
    size = 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        (held if i % 10 == 9 else train).append(data)
        size += len(data)
        if size >= max_bytes:
            break

    def encode(parts: list[bytes]) -> torch.Tensor:
        raw = np.frombuffer(b"\n".join(parts), dtype=np.uint8)
        return torch.from_numpy(_LUT[raw].astype(np.int64))

    return encode(train), encode(held)


def eval_windows(stream: torch.Tensor, n: int, context: int) -> torch.Tensor:
    """``n`` evenly spaced windows of ``context + 1`` tokens: the fixed held-out set."""
    starts = torch.linspace(0, len(stream) - context - 2, n).long()
    return torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


def sample_windows(
    stream: torch.Tensor, n: int, context: int, gen: torch.Generator
) -> torch.Tensor:
    """``n`` random windows of ``context + 1`` tokens (inputs and next-token targets)."""
    starts = torch.randint(0, len(stream) - context - 1, (n,), generator=gen).tolist()
    return torch.stack([stream[s : s + context + 1] for s in starts])


# ---------------------------------------------------------------------- model
class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """A pre-LayerNorm GPT (nanoGPT's shape) over :data:`VOCAB`, tied embeddings."""

    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.tok = nn.Embedding(len(VOCAB), d)
        self.pos = nn.Parameter(torch.zeros(cfg.context, d))
        self.blocks = nn.Sequential(*[_Block(d, cfg.heads) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.ln(self.blocks(x)) @ self.tok.weight.T

    def loss(self, windows: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy (nats) over windows of context + 1 tokens."""
        logits = self(windows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: CharLM, windows: torch.Tensor, batch: int = 64) -> float:
    """Mean held-out loss (nats per character)."""
    model.eval()
    total = sum(model.loss(w).item() * len(w) for w in windows.split(batch))
    model.train()
    return total / len(windows)


def lr_at(cfg: DemoConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to 10%: a decayed LR makes the final loss
    less noisy, so that lossy and lossless runs can be compared closely."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, frac))))


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


def _exchange(net: Peer, cfg: DemoConfig, model: CharLM, base: torch.optim.Optimizer) -> Any:
    """``cfg.strategy``'s per-step exchange as one callable ``step -> CollectiveReport``."""
    if cfg.strategy == "allreduce":
        opt = net.optimizer(base, strategy="allreduce")
        return lambda step: opt.step()
    params = list(model.parameters())

    def grads_then_step(step: int) -> CollectiveReport:
        rep = net.all_reduce([p.grad for p in params])  # type: ignore[misc]
        base.step()
        return rep

    return grads_then_step


def _train(run: int, rank: int, cfg: DemoConfig, addrs: list[str], out: Any) -> None:
    """Run ``run`` on peer ``rank``: join, barrier, train, evaluate, barrier, leave."""
    train, held = load_corpus(cfg.corpus_bytes)
    shard_len = len(train) // cfg.peers  # each peer trains on its own slice of the stream
    shard = train[rank * shard_len : (rank + 1) * shard_len]
    held_out = eval_windows(held, cfg.eval_windows, cfg.context)
    gen = torch.Generator().manual_seed(cfg.data_seed * 1000 + rank)
    torch.manual_seed(cfg.model_seed)  # the same initial weights on every peer
    model = CharLM(cfg)
    base = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    overrides: dict[str, Any] = {
        "resync_every_steps": cfg.resync_every,
        "redundancy": cfg.redundancy,
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
        exchange = _exchange(net, cfg, model, base)
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
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
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
