"""The runtime alone: a loop thread and a node on a MemoryNetwork, engines by key.

:class:`~gossipnet.runtime.runtime.Runtime` knows no collective; these tests give it a
toy engine and check what the facade relies on: engines are built on the loop thread
as the node starts, handed back typed, calls from the loop thread raise instead of
deadlocking, and close is idempotent and final.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from gossipnet import Config
from gossipnet.errors import ClosedError, ConfigError
from gossipnet.runtime.node import Node
from gossipnet.runtime.runtime import Runtime
from gossipnet.testing import MemoryNetwork

from ..conftest import FAST


class Toy:
    """An engine that records where it was built and whether the node had started."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.thread = threading.current_thread().name
        self.address_at_build = node.address


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    node = Node(config=Config(**FAST), listen="mem://solo", peer_id="solo", network=MemoryNetwork())
    rt = Runtime(node)
    rt.start({"toy": Toy}, expected_peers=1)
    try:
        yield rt
    finally:
        rt.close()


@pytest.mark.timeout(20)
def test_engines_are_built_on_the_loop_thread_after_the_node_started(runtime: Runtime) -> None:
    toy = runtime.engine("toy", Toy)
    assert toy.thread == "gossipnet-solo"
    assert toy.address_at_build == "mem://solo"  # the node was bound first
    assert toy.node is runtime.node
    with pytest.raises(TypeError, match="not a int"):
        runtime.engine("toy", int)
    with pytest.raises(KeyError):
        runtime.engine("missing", Toy)


@pytest.mark.timeout(20)
def test_call_submit_and_the_loop_thread_guard(runtime: Runtime) -> None:
    async def where() -> str:
        return threading.current_thread().name

    assert runtime.call(where()) == "gossipnet-solo"
    assert runtime.submit(where()).result(timeout=10) == "gossipnet-solo"
    assert runtime.alive_peers() == ["solo"]
    assert runtime.stats()["peer_id"] == "solo"

    async def reenter() -> None:
        inner = asyncio.sleep(0)
        runtime.call(inner)  # from the loop thread: would deadlock

    with pytest.raises(RuntimeError, match="own event-loop thread"):
        runtime.call(reenter())
    with pytest.raises(TimeoutError):
        runtime.call(asyncio.sleep(60), timeout_s=0.05)


@pytest.mark.timeout(20)
def test_close_is_idempotent_and_final(runtime: Runtime) -> None:
    runtime.close()
    runtime.close()
    assert runtime.closed
    assert runtime.node.closed
    assert not runtime.loop_thread.thread.is_alive()
    coro = asyncio.sleep(0)
    with pytest.raises(ClosedError):
        runtime.call(coro)
    with pytest.raises(ClosedError):
        runtime.submit(asyncio.sleep(0))


@pytest.mark.parametrize(
    ("before", "setting", "after"),
    [(700, 10_000, 10_000), (50_000, 10_000, 50_000), (700, None, 700), (0, 10_000, 0)],
)
def test_gc_threshold_at_join_is_raised_never_lowered(
    before: int, setting: int | None, after: int
) -> None:
    """``Config.gc_threshold``: the young generation's threshold goes up to the
    setting at start-up; a higher one (the user's) stays, None leaves it, and 0
    (automatic collection off) stays off.  The older generations' are untouched."""
    import gc

    saved = gc.get_threshold()
    gc.set_threshold(before, 7, 9)
    try:
        cfg = Config(**FAST, gc_threshold=setting, gc_freeze=False)
        rt = Runtime(Node(config=cfg, listen="mem://gct", peer_id="gct", network=MemoryNetwork()))
        rt.close()
        assert gc.get_threshold() == (after, 7, 9)
    finally:
        gc.set_threshold(*saved)


@pytest.mark.parametrize("bad", [0, -1, 10_000_001, 1.5, True, "10000"])
def test_gc_threshold_out_of_range_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="gc_threshold"):
        Config(gc_threshold=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("freeze", [True, False])
def test_gc_freeze_at_join_is_a_setting(freeze: bool) -> None:
    """``Config.gc_freeze``: what the collector tracks at start-up moves to its
    permanent generation (no full-collection pauses over it mid-round), or not."""
    import gc

    gc.unfreeze()
    cfg = Config(**FAST, gc_freeze=freeze)
    rt = Runtime(Node(config=cfg, listen="mem://gcf", peer_id="gcf", network=MemoryNetwork()))
    try:
        assert (gc.get_freeze_count() > 0) is freeze
    finally:
        rt.close()
        gc.unfreeze()
