"""Data-parallel training on N local processes over a network that loses 10% of packets.

    .venv/bin/python examples/train_lossy.py                  # 4 peers, about a minute
    .venv/bin/python examples/train_lossy.py --loss 0.3 --peers 3

Each process is one peer.  Compared with a single-process PyTorch loop, only two
lines are new: ``gossipnet.join(...)`` and ``net.optimizer(...)``.  The task is
next-character prediction on Python's own standard-library sources (no download).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import gossipnet

CONTEXT = 32  # characters the model sees to predict the next one


def load_text() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte streams from the standard library; ASCII only."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"\n".join(f.read_bytes() for f in files)), dtype=torch.uint8)
    data = data.long().clamp(max=127)
    cut = int(len(data) * 0.95)
    return data[:cut], data[cut:]


def batch(text: torch.Tensor, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(text) - CONTEXT - 1, (size,), generator=gen).tolist()
    x = torch.stack([text[s : s + CONTEXT] for s in starts])
    y = torch.stack([text[s + CONTEXT] for s in starts])
    return x, y


def train(rank: int, addresses: list[str], args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the peers share the machine's cores
    train_text, held_out = load_text()
    # every peer reads its own part of the data: every peers-th 4 KiB block, so that each
    # part mixes all the files (as DistributedSampler does) and the gradients agree in mean
    blocks = train_text[: len(train_text) // 4096 * 4096].view(-1, 4096)
    shard = blocks[rank :: args.peers].reshape(-1)
    gen = torch.Generator().manual_seed(rank)
    torch.manual_seed(0)  # the same initial model on every peer
    model = nn.Sequential(
        nn.Embedding(128, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 256), nn.GELU(),
        nn.Linear(256, 128),
    )  # fmt: skip
    faults = gossipnet.FaultPlan(loss=args.loss, seed=7)  # drop packets on purpose
    with gossipnet.join(
        peers=addresses, listen=addresses[rank], secret=b"example", faults=faults
    ) as net:
        opt = net.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
        for step in range(1, args.steps + 1):
            x, y = batch(shard, 64, gen)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            report = opt.step()  # averages gradients across peers, tolerating loss
            if rank == 0 and step % 50 == 0:
                expected = report.packets_lost + report.packets_received
                who = f"{len(report.contributors)}/{args.peers}"
                print(f"step {step:4d}  loss {loss.item():.3f}  lost {report.packets_lost:3d}"
                      f"/{expected} packets  contributors {who}", flush=True)  # fmt: skip
        with torch.no_grad():
            x, y = batch(held_out, 4096, torch.Generator().manual_seed(123))
            held = F.cross_entropy(model(x), y).item()
        print(f"peer {rank}: held-out loss {held:.3f} nats/char", flush=True)


def free_addresses(n: int) -> list[str]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addresses = [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()
    return addresses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--loss", type=float, default=0.1, help="packet loss rate")
    args = parser.parse_args()
    addresses = free_addresses(args.peers)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=train, args=(r, addresses, args)) for r in range(args.peers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    raise SystemExit(max(p.exitcode or 0 for p in procs))
