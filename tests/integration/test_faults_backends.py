"""The same FaultPlan on the real backends: delivered fraction within binomial
bounds, and the same seed drops the same packets (ZeroMQ and UDP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket

import pytest

from gossipnet.clock import MonotonicClock
from gossipnet.config import Config
from gossipnet.transport import create_transport
from gossipnet.transport.faults import FaultPlan

N_PACKETS = 3000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _deliver(backend: str, loss: float, seed: int, port: int = 0) -> list[int]:
    """Send N numbered packets through a fault plan; return the numbers that arrived.

    Link fates are keyed by (sender name, destination address), so runs that must
    replay the same drops use the same receiver port.
    """
    cfg = Config(chunk_bytes=1024)
    got: list[int] = []
    target = [N_PACKETS + 1]
    arrived = asyncio.Event()

    def on_packet(frames: list[memoryview]) -> None:
        got.append(int.from_bytes(frames[0], "big"))
        if len(got) >= target[0]:
            arrived.set()

    recv = create_transport(f"{backend}://127.0.0.1:{port}", cfg)
    addr = await recv.start(on_packet)
    # link names are fixed strings, so the fates do not depend on the random ports
    send = create_transport(
        f"{backend}://127.0.0.1:0",
        cfg,
        clock=MonotonicClock(),
        faults=FaultPlan(loss=loss, seed=seed),
    )
    await send.start(lambda frames: None)
    send.name = "sender"  # type: ignore[attr-defined]
    try:
        connect = getattr(getattr(send, "inner", send), "connect", None)
        if connect is not None:
            assert await connect(addr, 2.0)
        for i in range(N_PACKETS):
            send.send(addr, [i.to_bytes(4, "big")])
            if i % 200 == 199:
                await asyncio.sleep(0.001)  # pace: loopback UDP must not overflow buffers
        target[0] = send.fault_stats.passed  # type: ignore[attr-defined]
        passed = target[0]
        if len(got) < passed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), 5.0)
        assert len(got) == passed, f"{passed - len(got)} packets lost outside the fault plan"
    finally:
        await send.close()
        await recv.close()
    return sorted(got)


@pytest.mark.parametrize("backend", ["tcp", "udp"])
@pytest.mark.parametrize("loss", [0.1, 0.3])
@pytest.mark.timeout(30)
def test_delivered_fraction_within_binomial_bounds(backend: str, loss: float) -> None:
    got = asyncio.run(_deliver(backend, loss, seed=5))
    sigma = math.sqrt(N_PACKETS * loss * (1 - loss))
    expected = N_PACKETS * (1 - loss)
    assert abs(len(got) - expected) <= 4.5 * sigma, (len(got), expected)


@pytest.mark.parametrize("backend", ["tcp", "udp"])
@pytest.mark.timeout(30)
def test_same_seed_same_drops_on_real_backends(backend: str) -> None:
    port = _free_port()
    first = asyncio.run(_deliver(backend, 0.2, seed=9, port=port))
    again = asyncio.run(_deliver(backend, 0.2, seed=9, port=port))
    other = asyncio.run(_deliver(backend, 0.2, seed=10, port=port))
    assert first == again
    assert first != other
