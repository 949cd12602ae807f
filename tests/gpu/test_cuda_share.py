"""Blink islands' CUDA IPC path: buckets shared with another process on one GPU.

The island path of ``island_average`` maps each member's flat buckets into its
leader's process; on CUDA that is ``SharedBuckets.handles`` -> ``open_handles``
(CUDA IPC). Islands need >= 2 GPUs to form, but the mapping itself is per device,
so one GPU tests it: a child process maps the parent's buckets, adds into them and
fills one of its own that the parent maps back. Skipped without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gossipnet.collectives.island.share import SharedBuckets, load_handles, open_handles

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ROOT = Path(__file__).resolve().parents[2]
LAYOUT = [(100_003, torch.float32), (4_099, torch.float64)]

CHILD = """
import sys, torch
from gossipnet.collectives.island.share import SharedBuckets, load_handles, open_handles
layout = [(100_003, torch.float32), (4_099, torch.float64)]
theirs = open_handles(load_handles(sys.stdin.buffer.read()), layout)
for t in theirs:
    t.add_(1)
torch.cuda.synchronize()
mine = SharedBuckets(layout, torch.device("cuda:0"))
for i, b in enumerate(mine.buckets):
    b.fill_(7 + i)
torch.cuda.synchronize()
import os
sys.stdout.buffer.write(mine.handles())
sys.stdout.buffer.flush()
os.close(1)  # EOF for the parent's read; sys.stdout.close() would leave fd 1 open
# keep our buckets alive until the parent has checked them: it writes to this pipe
os.read(int(sys.argv[1]), 1)
"""


def test_cuda_buckets_map_across_processes() -> None:
    ours = SharedBuckets(LAYOUT, torch.device("cuda:0"))
    g = torch.Generator().manual_seed(3)
    want = []
    for b in ours.buckets:
        host = torch.randn(b.numel(), generator=g, dtype=b.dtype)
        b.copy_(host.cuda())
        want.append(host + 1)
    torch.cuda.synchronize()
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        cwd=ROOT, pass_fds=(r,),
    )  # fmt: skip
    os.close(r)
    try:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write(ours.handles())
        proc.stdin.close()
        data = proc.stdout.read()
        theirs = open_handles(load_handles(data), LAYOUT)
        for i, t in enumerate(theirs):
            assert torch.all(t == 7 + i)
        for b, w_ in zip(ours.buckets, want, strict=True):
            torch.testing.assert_close(b.cpu(), w_)
        del theirs
    finally:
        os.write(w, b"x")
        os.close(w)
        assert proc.wait(timeout=60) == 0
        if proc.stdout is not None:
            proc.stdout.close()
