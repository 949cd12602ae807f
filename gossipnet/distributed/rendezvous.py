"""Start one rank's peer and find the others through the Store torch passes.

Each rank starts a solo peer on a free port (so no port is guessed or raced),
publishes the address it got under its rank in the group's store, reads the other
ranks' addresses, adds them as bootstrap addresses and waits for all of them to be
alive (:meth:`gossipnet.runtime.runtime.Runtime.await_peers`, whose error names
silent addresses and peers failing authentication: another secret).

Keys carry torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``) and the rank's
own count of rendezvous on the store (``store.add``), so a restarted worker group never
reads its previous incarnation's addresses from torchrun's long-lived agent store.
"""

from __future__ import annotations

import datetime
import os

from torch._C._distributed_c10d import Store

from gossipnet._join import join
from gossipnet.config import Config
from gossipnet.distributed.exchange import Exchange
from gossipnet.distributed.options import GossipnetOptions
from gossipnet.errors import JoinError
from gossipnet.peer import Peer
from gossipnet.runtime.join import advertise_host

__all__ = ("listen_host", "start_peer")


def listen_host(options: GossipnetOptions, env: dict[str, str] | None = None) -> str:
    """The address to bind: the option, else the interface toward ``MASTER_ADDR``."""
    if options.listen_host:
        return options.listen_host
    env = dict(os.environ) if env is None else env
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if master in ("localhost", "") or master.startswith("127."):
        return "127.0.0.1"
    return advertise_host([f"tcp://{master}:1"]) or "127.0.0.1"


def _key(generation: str, rank: int) -> str:
    return f"gossipnet/{generation}/addr/{rank}"


def start_peer(
    store: Store,
    rank: int,
    world: int,
    options: GossipnetOptions,
    *,
    group: str,
    timeout: datetime.timedelta,
) -> tuple[Peer, Exchange]:
    """A running peer, connected to every other rank of the group, and its exchange.

    Why the exchange is made here, before our address is published: a rank that
    finishes the rendezvous first may broadcast at once; a part arriving before anyone
    subscribed to its kind would be acknowledged (the reliable layer acks every
    request) and then dropped as unhandled, and its sender would never resend it.

    Raises:
        JoinError: a rank did not publish its address, or did not answer, within
            ``Config.join_timeout_s``; the message names the ranks.
        ConfigError: invalid options.
    """
    config = options.config or Config()
    config = config.replace(peer_id=f"rank{rank}", run=f"{config.run}:pg{group}")
    listen = f"{options.transport}://{listen_host(options)}:0"
    peer = join(
        [],
        listen,
        secret=options.secret,
        faults=options.faults,
        config=config,
        handle_sigterm=options.handle_sigterm,
    )
    try:
        chunk = getattr(peer.node.transport, "default_chunk_bytes", 1024)
        exchange = peer.runtime.call(_make_exchange(peer, chunk))
        _meet(peer, store, rank, world, config.join_timeout_s)
    except BaseException:
        peer.close(announce=False)
        raise
    return peer, exchange


async def _make_exchange(peer: Peer, chunk_bytes: int) -> Exchange:
    """The exchange, made (and subscribed) on the loop thread that runs it."""
    return Exchange(peer.node, chunk_bytes)


def _meet(peer: Peer, store: Store, rank: int, world: int, timeout_s: float) -> None:
    """Publish our address, read the others', say hello, wait for them all."""
    if world <= 1:
        return
    # this rank's count of rendezvous on this store: the same on every rank of a group
    count = store.add(f"gossipnet/rendezvous/{rank}", 1)
    generation = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{count}"
    store.set(_key(generation, rank), peer.address)
    keys = [_key(generation, r) for r in range(world) if r != rank]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # the store's timeout: name who never came
        absent = [r for r in range(world) if r != rank and not store.check([_key(generation, r)])]
        raise JoinError(
            f"gossipnet backend: ranks {absent} of {world} did not start within"
            f" {timeout_s:g} s (Config.join_timeout_s); is WORLD_SIZE right, and did every"
            " rank call init_process_group('gossipnet')?"
        ) from err
    addresses = [store.get(k).decode() for k in keys]

    async def add() -> None:
        members = peer.node.members
        members.bootstrap.extend(a for a in addresses if a not in members.bootstrap)

    peer.runtime.call(add())
    peer.runtime.await_peers(world)
