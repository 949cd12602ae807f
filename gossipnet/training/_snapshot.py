"""Serving this peer's training state to a peer that downloads it (``statesync``).

Shared by the all-reduce strategy (a realigning peer downloads a right one's
state) and the Moshpit strategy (a joiner downloads the current state).  Why
hash here and install on the loop: hashing a model's bytes takes a while and
must not stall the loop, and the loop thread never reads tensors the trainer
is writing, so the bytes are made on the training thread (or a worker holding
the trainer's lock) and only the finished snapshot crosses over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gossipnet.collectives.statesync.sync import Snapshot, StateSync
from gossipnet.training.host import TrainingHost

__all__ = ("install", "publish", "snapshot")


def snapshot(data: bytes, chunk_bytes: int, step: int) -> Snapshot:
    """A snapshot of packed state ``data`` at ``step`` (its time is set at install)."""
    return Snapshot.of(data, chunk_bytes, {"step": step}, 0.0)


def install(sync: StateSync, snap: Snapshot) -> None:
    """Serve ``snap`` from now on, stamped with the node's clock (loop thread only)."""
    sync.install(dataclasses.replace(snap, created=sync.node.clock.now()))


def publish(host: TrainingHost, pack: Callable[[], bytes], step: int) -> None:
    """Serve the state ``pack()`` returns at ``step``; nothing without statesync.

    Blocking: packs and hashes on the calling (training) thread, then installs
    on the loop thread and waits for it.
    """
    sync = host.statesync
    if sync is None:
        return
    snap = snapshot(pack(), sync.chunk_bytes, step)

    async def on_loop() -> None:
        install(sync, snap)

    host.call(on_loop())
