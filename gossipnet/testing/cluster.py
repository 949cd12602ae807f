"""Start several peers in one process: nodes on a memory network, or joined peers.

Two shapes of test need a cluster.  Protocol tests drive
:class:`~gossipnet.runtime.node.Node` s on one event loop over a
:class:`~gossipnet.transport.memory.MemoryNetwork` with a
:class:`~gossipnet.clock.FakeClock`, so they replay exactly (:func:`start_node`,
:func:`cluster`).  End-to-end tests run :func:`gossipnet.join` peers, each with
its own loop thread as in production, on a memory network or on real loopback
sockets (:func:`run_peers`, :func:`loopback_addresses`).  Names are ``p0..pN-1``;
memory addresses ``mem://p<i>``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from gossipnet.clock import Clock
from gossipnet.config import Config
from gossipnet.testing.virtual_time import wait_until
from gossipnet.transport.fault_plan import FaultPlan
from gossipnet.transport.memory import MemoryNetwork

if TYPE_CHECKING:
    from gossipnet.peer import Peer
    from gossipnet.runtime.node import Node

__all__ = (
    "TEST_SECRET",
    "cluster",
    "free_tcp_ports",
    "loopback_addresses",
    "run_peers",
    "start_node",
    "wait_until_sync",
)

#: The shared key of every cluster this module starts (tests need no secret of their own).
TEST_SECRET = b"test-secret"


async def start_node(
    network: MemoryNetwork,
    name: str,
    *,
    config: Config,
    clock: Clock | None = None,
    faults: FaultPlan | None = None,
    bootstrap: Sequence[str] = (),
    secret: bytes | None = TEST_SECRET,
) -> Node:
    """One started node ``name`` listening on ``mem://<name>``.

    Args:
        network: the memory network to listen on.
        name: the node's peer id and address name.
        config: its configuration.
        clock: its time source (a FakeClock for exact replays).
        faults: a fault plan applied to its transport, or None.
        bootstrap: addresses it announces itself to.
        secret: the cluster key, or None for unauthenticated packets.

    Returns:
        The started node; the caller closes it.
    """
    from gossipnet.runtime.node import Node  # runtime import on use: a top-layer helper

    node = Node(
        config=config,
        listen=f"mem://{name}",
        peer_id=name,
        secret=secret,
        bootstrap=bootstrap,
        clock=clock,
        faults=faults,
        network=network,
    )
    await node.start()
    return node


@contextlib.asynccontextmanager
async def cluster(
    n: int,
    *,
    config: Config,
    clock: Clock | None = None,
    faults: FaultPlan | Callable[[int], FaultPlan | None] | None = None,
    bootstrap: Callable[[int, list[str]], Sequence[str]] | None = None,
    network: MemoryNetwork | None = None,
    discover: bool = True,
    timeout_s: float = 5.0,
) -> AsyncIterator[list[Node]]:
    """``n`` started nodes ``p0..`` on one memory network, bootstrapping from everyone.

    Args:
        n: how many nodes.
        config: every node's configuration.
        clock: their shared time source.
        faults: one plan for all, or a function of the node's index.
        bootstrap: ``(index, all addresses) -> addresses`` (default: all of them).
        network: the network to use (default: a new one).
        discover: wait until every node sees all ``n`` alive before yielding.
        timeout_s: deadline of that wait (virtual seconds under a FakeClock).

    Yields:
        The nodes, in index order.  On exit they close without announcing their
        departure (a test that wants LEAVE packets closes them itself).

    Raises:
        AssertionError: ``discover`` and the nodes did not all meet in time.
    """
    network = network or MemoryNetwork()
    addresses = [f"mem://p{i}" for i in range(n)]
    nodes: list[Node] = []
    try:
        for i in range(n):
            plan = faults(i) if callable(faults) else faults
            boot = bootstrap(i, addresses) if bootstrap is not None else addresses
            nodes.append(
                await start_node(
                    network, f"p{i}", config=config, clock=clock, faults=plan, bootstrap=boot
                )
            )
        if discover:
            await wait_until(
                lambda: all(len(x.alive_peers()) == n for x in nodes),
                timeout_s,
                clock=clock,
                what=f"all {n} nodes alive everywhere",
            )
        yield nodes
    finally:
        for node in nodes:
            await node.close(announce=False)


def run_peers(
    n: int,
    body: Callable[[int, Peer], Any],
    *,
    timeout_s: float = 60,
    addresses: Sequence[str] | None = None,
    **config: Any,
) -> list[Any]:
    """Run ``body(rank, peer)`` on ``n`` joined peers, one thread each; their results.

    Each peer has its own event-loop thread, as under :func:`gossipnet.join`.  They
    leave only after every body returned, so no departure cuts a round (or a repair)
    another peer is still in; a failing body aborts that barrier so the others do
    not wait for it.

    Args:
        n: how many peers.
        body: what each peer does; its return value is collected.
        timeout_s: bound on the barrier and on joining each thread.
        addresses: ``n`` listen addresses (e.g. :func:`loopback_addresses`); by
            default ``mem://p<i>`` on a fresh memory network.
        config: keyword arguments for :func:`gossipnet.join` (Config fields,
            ``faults=`` ...).

    Returns:
        ``body``'s results by rank.

    Raises:
        BaseException: the first error a body (or a join) raised.
    """
    import gossipnet  # the facade, on use: this module is importable without it

    if addresses is None:
        addrs = [f"mem://p{i}" for i in range(n)]
        config.setdefault("network", MemoryNetwork())
    else:
        addrs = list(addresses)
        if len(addrs) != n:
            raise ValueError(f"{n} peers need {n} addresses, got {len(addrs)}")
    done = threading.Barrier(n, timeout=timeout_s)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with gossipnet.join(
                addrs, listen=addrs[i], secret=b"t", peer_id=f"p{i}", **config
            ) as peer:
                results[i] = body(i, peer)
                done.wait()
        except BaseException as err:  # surfaced in the calling thread below
            errors.append(err)
            done.abort()

    threads = [threading.Thread(target=worker, args=(i,), name=f"peer-p{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    if errors:
        raise errors[0]
    return results


def free_tcp_ports(count: int, *, kind: socket.SocketKind = socket.SOCK_STREAM) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (held open together, then released).

    ``kind=socket.SOCK_DGRAM`` finds free UDP ports instead of TCP ones.
    """
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, kind)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_addresses(n: int, scheme: str = "tcp") -> list[str]:
    """``n`` listen addresses on 127.0.0.1 with free ports, for real-socket peers.

    Args:
        n: how many.
        scheme: ``"tcp"`` (ZeroMQ) or ``"udp"``.

    Raises:
        ValueError: another scheme.
    """
    if scheme not in ("tcp", "udp"):
        raise ValueError(f"loopback addresses are tcp:// or udp://, not {scheme}://")
    kind = socket.SOCK_STREAM if scheme == "tcp" else socket.SOCK_DGRAM
    return [f"{scheme}://127.0.0.1:{port}" for port in free_tcp_ports(n, kind=kind)]


def wait_until_sync(
    pred: Callable[[], bool], timeout_s: float, *, interval_s: float = 0.01, what: str = "condition"
) -> float:
    """Thread-side :func:`~gossipnet.testing.wait_until`: poll ``pred``; seconds it took.

    Raises:
        AssertionError: ``pred`` still false after ``timeout_s`` real seconds.
    """
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 >= timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - t0
