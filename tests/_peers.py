"""Thread harness shared by tests that run several joined peers in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import gossipnet
from gossipnet.testing import MemoryNetwork


def run_peers(
    n: int, body: Callable[[int, gossipnet.Peer], Any], *, timeout_s: float = 60, **config: Any
) -> list[Any]:
    """Run ``body(rank, peer)`` on ``n`` MemoryNetwork peers in threads; their results.

    Peers are ``mem://p<i>`` with ids ``p<i>``, each with its own event-loop thread
    as under ``gossipnet.join``.  They leave only after every body returned, so no
    departure cuts a round (or a repair) another peer is still in; a failing body
    aborts the barrier so the others do not wait for it.  The first error is raised.
    """
    net = MemoryNetwork()
    done = threading.Barrier(n, timeout=timeout_s)
    addrs = [f"mem://p{i}" for i in range(n)]
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with gossipnet.join(
                addrs, listen=addrs[i], network=net, secret=b"t", peer_id=f"p{i}", **config
            ) as peer:
                results[i] = body(i, peer)
                done.wait()
        except BaseException as err:  # surfaced in the calling thread below
            errors.append(err)
            done.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    if errors:
        raise errors[0]
    return results
