"""The event-loop thread runs its tensor kernels on one thread; the caller keeps its own.

Why it matters: on a machine whose cores are busy, a loop thread that fans each
chunk's sum or add out to PyTorch's OpenMP pool waits for pool threads that are
not running (25M float32 over 4 processes on 2 cores: 8% more CPU per call).
"""

from __future__ import annotations

import pytest
import torch

from gossipnet.runtime._threads import limit_intraop_threads
from gossipnet.runtime.loop import LoopThread


async def _threads_here() -> int:
    return torch.get_num_threads()


@pytest.mark.timeout(30)
def test_loop_thread_kernels_use_one_thread_and_the_caller_keeps_its_own() -> None:
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("torch runs one intra-op thread here already: nothing to limit")
    loop = LoopThread("test-threads")
    try:
        assert loop.call(_threads_here(), timeout_s=10) == 1
        # the loop thread's kernels still compute right on one thread
        x = torch.arange(1 << 20, dtype=torch.float64)

        async def total() -> float:
            return float(x.sum())

        assert loop.call(total(), timeout_s=10) == float(x.sum())
    finally:
        loop.stop()
    assert torch.get_num_threads() == before


def test_limit_is_a_no_op_where_torch_already_uses_fewer_threads() -> None:
    before = torch.get_num_threads()
    assert limit_intraop_threads(64)
    assert torch.get_num_threads() == before  # never raised to the limit
