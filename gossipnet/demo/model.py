"""The demo's task: a fixed character vocabulary, the standard library's sources as
text, and a tiny pre-LayerNorm transformer LM with its evaluation and LR schedule.

Why apart from the runner (:mod:`gossipnet.demo.harness`): this is the same in every
peer process and in ``bench/quality.py``'s in-process reference simulation, and
knows nothing of peers or the network.  Internal: import these names from
:mod:`gossipnet.demo.harness`.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gossipnet.demo.config import DemoConfig

__all__ = (
    "VOCAB",
    "CharLM",
    "eval_windows",
    "evaluate",
    "load_corpus",
    "lr_at",
    "sample_windows",
    "shard_stream",
)

#: Fixed vocabulary: 0 = unknown byte, then newline, tab and printable ASCII.  Fixed
#: (not derived from the text) so that every peer and every run agree on token ids.
VOCAB = "\x00\n\t" + "".join(chr(c) for c in range(32, 127))
_LUT = np.zeros(256, dtype=np.uint8)
for _i, _ch in enumerate(VOCAB[1:], start=1):
    _LUT[ord(_ch)] = _i


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


def shard_stream(
    train: torch.Tensor, rank: int, cfg: DemoConfig, block: int = 4096
) -> torch.Tensor:
    """Peer ``rank``'s disjoint share of the training stream, by ``cfg.split``.

    ``"shuffled"`` (default) is what a data-parallel job's sampler does (torch's
    ``DistributedSampler``): cut the stream into ``block``-token blocks, shuffle
    them with a seed every peer shares, deal them round-robin.  Every peer's
    gradient then has the same expectation, which the all-reduce's unbiasedness
    rests on (ALGORITHMS.md 1.1): a lost contribution costs variance, not bias.
    ``"contiguous"`` gives peer ``rank`` the ``rank``-th slice of the sorted
    files instead: each peer sees different modules (non-IID, as when sites or
    cars hold their own data), and a lost contribution tilts that step's
    gradient toward the other peers' text.
    """
    if cfg.split == "contiguous":
        span = len(train) // cfg.peers
        return train[rank * span : (rank + 1) * span]
    blocks = len(train) // block
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(cfg.data_seed))
    mine = order[rank :: cfg.peers].sort().values  # stream order within a peer's share
    return train[: blocks * block].view(blocks, block)[mine].reshape(-1)


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
