"""Every transport backend passes the public conformance suite.

The suite is :mod:`gossipnet.testing.conformance`; here it runs on memory,
ZeroMQ over tcp, ipc and inproc, UDP (batched with GSO/GRO, forced to one
datagram per call, and paced), and the fault wrapper with no faults
(around the memory network), one test per (backend, check), so a failure names
both.  Socket backends bind 127.0.0.1 port 0 or a fresh ipc path.
"""

from __future__ import annotations

import itertools
import os
import socket
import tempfile
from collections.abc import Callable

import pytest

from gossipnet.clock import MonotonicClock
from gossipnet.config import Config
from gossipnet.testing import (
    CHECKS,
    FaultPlan,
    FaultyTransport,
    MemoryNetwork,
    MemoryTransport,
    TransportSpec,
    free_tcp_ports,
    run,
    run_check,
)
from gossipnet.transport import Transport, create_transport

#: Deadline of one check: each takes well under 1 s on 2 idle cores.
CHECK_TIMEOUT_S = 10.0

pytestmark = pytest.mark.timeout(30)

_names = itertools.count()


def _socket_spec(listen: Callable[[], str], unbound: Callable[[], str]) -> TransportSpec:
    return TransportSpec(
        make=lambda: create_transport(listen(), Config()),
        unbound_address=unbound,
        timeout_s=CHECK_TIMEOUT_S,
    )


def _free_udp_port() -> int:
    (port,) = free_tcp_ports(1, kind=socket.SOCK_DGRAM)
    return port


def _udp_garbage(address: str, count: int) -> None:
    """Datagrams whose framing lies about their frame lengths."""
    host, port = address.removeprefix("udp://").rsplit(":", 1)
    garbage = [b"\x00", b"\x01\x00\x00\x00\x05abc", b"\x02\x00\x00"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
        for i in range(count):
            raw.sendto(garbage[i % len(garbage)], (host, int(port)))


def _ipc_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"gossipnet-conf-{os.getpid()}-{next(_names)}")


def _memory() -> TransportSpec:
    network = MemoryNetwork()
    return TransportSpec(
        make=lambda: MemoryTransport(network),
        unbound_address=lambda: "mem://nobody",
        timeout_s=CHECK_TIMEOUT_S,
    )


def _faulty_memory() -> TransportSpec:
    network = MemoryNetwork()

    def make() -> Transport:
        return FaultyTransport(MemoryTransport(network), FaultPlan(loss=0.0), MonotonicClock())

    return TransportSpec(
        make=make, unbound_address=lambda: "mem://nobody", timeout_s=CHECK_TIMEOUT_S
    )


def _zmq_tcp() -> TransportSpec:
    return _socket_spec(
        lambda: "tcp://127.0.0.1:0", lambda: f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"
    )


def _zmq_ipc() -> TransportSpec:
    return _socket_spec(lambda: f"ipc://{_ipc_path()}", lambda: f"ipc://{_ipc_path()}")


def _zmq_inproc() -> TransportSpec:
    return _socket_spec(
        lambda: f"inproc://conf-{next(_names)}", lambda: f"inproc://nobody-{next(_names)}"
    )


def _udp(config: Config | None = None) -> TransportSpec:
    """UDP with GSO/GRO where the kernel allows (the default), or forced off."""
    return TransportSpec(
        make=lambda: create_transport("udp://127.0.0.1:0", config or Config()),
        unbound_address=lambda: f"udp://127.0.0.1:{_free_udp_port()}",
        timeout_s=CHECK_TIMEOUT_S,
        send_malformed=_udp_garbage,
    )


BACKENDS: dict[str, Callable[[], TransportSpec]] = {
    "memory": _memory,
    "faulty-memory": _faulty_memory,
    "zmq-tcp": _zmq_tcp,
    "zmq-ipc": _zmq_ipc,
    "zmq-inproc": _zmq_inproc,
    "udp": _udp,
    "udp-plain": lambda: _udp(Config(udp_gso=False)),
    "udp-paced": lambda: _udp(Config(udp_pace_mbps=1000.0)),
}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_passes_check(backend: str, check: str) -> None:
    if backend.startswith("zmq"):
        pytest.importorskip("zmq")
    run(run_check(BACKENDS[backend](), check), timeout_s=CHECK_TIMEOUT_S * 2)


def test_spec_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        TransportSpec(
            make=lambda: MemoryTransport(MemoryNetwork()), unbound_address=str, timeout_s=0
        )


# ---------------------------------------------------------------- the suite catches faults
class _NoCopy(MemoryTransport):
    """Breaks the contract: delivers the sender's buffers, not copies made at send."""

    def send(self, dst: str, frames: object, *, urgent: bool = False) -> bool:
        target = self.network.lookup(dst)
        if target is None or not isinstance(frames, list) or not frames:
            return super().send(dst, frames, urgent=urgent)  # type: ignore[arg-type]
        self.stats.sent_packets += 1
        self.stats.sent_bytes += sum(len(memoryview(f)) for f in frames)
        asyncio_loop = target._loop
        assert asyncio_loop is not None
        asyncio_loop.call_soon(target._deliver, [memoryview(f) for f in frames], 0)
        return True


class _Raising(MemoryTransport):
    """Breaks the contract: raises for a peer nobody serves."""

    def send(self, dst: str, frames: object, *, urgent: bool = False) -> bool:
        if self.network.lookup(dst) is None:
            raise ConnectionError(dst)
        return super().send(dst, frames, urgent=urgent)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "check", "match"),
    [
        (_NoCopy, "round_trip", "frames changed on the way"),
        (_Raising, "unreachable_never_raises", "nobody"),
    ],
)
def test_suite_fails_a_backend_that_breaks_the_contract(
    cls: type[MemoryTransport], check: str, match: str
) -> None:
    network = MemoryNetwork()
    spec = TransportSpec(make=lambda: cls(network), unbound_address=lambda: "mem://nobody")
    with pytest.raises((AssertionError, ConnectionError), match=match):
        run(run_check(spec, check))
