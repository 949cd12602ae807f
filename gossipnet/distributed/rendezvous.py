"""Start one rank's peer and find the others through the Store torch passes.

Each rank starts a solo peer on a free port (so no port is guessed or raced),
publishes the address it got under its rank in the group's store, reads the other
ranks' addresses, adds them as bootstrap addresses and waits for all of them to be
alive (:meth:`gossipnet.runtime.runtime.Runtime.await_peers`, whose error names
silent addresses and peers failing authentication: another secret).

The MAC secret: ``GOSSIPNET_SECRET`` (or ``GossipnetOptions.secret``) when given;
else rank 0 draws a random per-job key (:data:`KEY_BYTES`) and hands it to the others
through the same store, before any peer starts.  Why the store: it is what
``init_process_group`` already trusts with every rank's rendezvous (whoever can
write to it can already redirect the group), and nothing public (run id, group
name) yields the key.  A store that cannot carry it is an error asking for
``GOSSIPNET_SECRET``, never a fall back to a key anyone could derive.

Keys carry torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``) and the rank's
own count of rendezvous on the store (``store.add``), so a restarted worker group never
reads its previous incarnation's addresses (or key) from torchrun's long-lived agent
store.  :func:`publish` and :func:`read_ranks` put and get any per-rank value under
that generation (an address, the group key, a rank's public key).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets

from torch._C._distributed_c10d import Store

from gossipnet._join import join
from gossipnet.config import Config
from gossipnet.distributed.exchange import Exchange, rank_id
from gossipnet.distributed.options import GossipnetOptions
from gossipnet.errors import ConfigError, JoinError
from gossipnet.peer import Peer
from gossipnet.runtime.join import advertise_host

__all__ = (
    "KEY_BYTES",
    "generation",
    "group_key",
    "listen_host",
    "publish",
    "read_ranks",
    "start_peer",
)

log = logging.getLogger(__name__)

#: Bytes of the random per-job key rank 0 draws when no secret is given.
KEY_BYTES = 32
_LOOPBACK = ("127.", "localhost", "::1")


class StoreUnusable(Exception):
    """A store operation failed for another reason than a rank not having written yet."""


def listen_host(options: GossipnetOptions, env: dict[str, str] | None = None) -> str:
    """The address to bind: the option, else the interface toward ``MASTER_ADDR``."""
    if options.listen_host:
        return options.listen_host
    env = dict(os.environ) if env is None else env
    master = env.get("MASTER_ADDR", "127.0.0.1")
    if master in ("localhost", "") or master.startswith("127."):
        return "127.0.0.1"
    return advertise_host([f"tcp://{master}:1"]) or "127.0.0.1"


def _key(generation: str, name: str, rank: int) -> str:
    return f"gossipnet/{generation}/{name}/{rank}"


def generation(store: Store, rank: int) -> str:
    """This rendezvous's generation: torchrun's restart count and this rank's count of
    rendezvous on ``store`` (the same on every rank of a group)."""
    count = store.add(f"gossipnet/rendezvous/{rank}", 1)
    return f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{count}"


def publish(store: Store, generation: str, name: str, rank: int, value: str) -> None:
    """Put rank ``rank``'s ``name`` (``"addr"``, ``"key"`` ...) under ``generation``.

    ``value`` is text; bytes go as hex (what every store type round-trips alike).

    Raises:
        StoreUnusable: the store refused the write.
    """
    try:
        store.set(_key(generation, name, rank), value)
    except Exception as err:  # c10d stores raise RuntimeError, Python ones anything
        raise StoreUnusable(f"{type(store).__name__}.set failed: {err}") from err


def read_ranks(
    store: Store, generation: str, name: str, ranks: list[int], world: int, timeout_s: float
) -> dict[int, bytes]:
    """Rank -> its ``name`` under ``generation``, once every rank of ``ranks`` wrote it.

    Raises:
        JoinError: some of ``ranks`` did not write it within ``timeout_s``; names them.
        StoreUnusable: the store cannot wait, check or read.
    """
    keys = {r: _key(generation, name, r) for r in ranks}
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # the store's timeout: name who never came
        try:
            absent = [r for r, k in keys.items() if not store.check([k])]
        except Exception as check_err:
            raise StoreUnusable(
                f"{type(store).__name__}.wait failed ({err}) and check too: {check_err}"
            ) from err
        if not absent:
            raise StoreUnusable(f"{type(store).__name__}.wait failed: {err}") from err
        raise JoinError(
            f"gossipnet backend: ranks {absent} of {world} did not start within"
            f" {timeout_s:g} s (Config.join_timeout_s); is WORLD_SIZE right, and did every"
            " rank call init_process_group('gossipnet')?"
        ) from err
    try:
        return {r: store.get(k) for r, k in keys.items()}
    except Exception as err:
        raise StoreUnusable(f"{type(store).__name__}.get failed: {err}") from err


def group_key(store: Store, rank: int, world: int, gen: str, timeout_s: float) -> bytes:
    """The group's random MAC secret: drawn by rank 0, read by the others from ``store``.

    Rank 0 reads its own write back, so a store that cannot carry the key fails on
    every rank alike, before any peer starts.

    Raises:
        ConfigError: the store cannot carry the key (set ``GOSSIPNET_SECRET``).
        JoinError: rank 0 did not publish the key within ``timeout_s``.
    """
    if world <= 1:
        return secrets.token_bytes(KEY_BYTES)  # no one to share it with
    try:
        if rank == 0:
            key = secrets.token_bytes(KEY_BYTES)
            publish(store, gen, "key", 0, key.hex())
            text = read_ranks(store, gen, "key", [0], world, timeout_s)[0]
            if text != key.hex().encode():
                raise StoreUnusable(f"{type(store).__name__} returned another value than set")
        else:
            text = read_ranks(store, gen, "key", [0], world, timeout_s)[0]
            key = bytes.fromhex(text.decode("ascii"))
            if len(key) != KEY_BYTES:
                raise StoreUnusable(f"rank 0's key is {len(key)} bytes, not {KEY_BYTES}")
    except (StoreUnusable, ValueError) as err:  # ValueError: not hex text
        raise ConfigError(
            f"gossipnet backend: no GOSSIPNET_SECRET is set, and torch's store cannot carry"
            f" the group's random key ({err}); set GOSSIPNET_SECRET to the same secret on"
            " every rank (or pass GossipnetOptions(secret=...))"
        ) from err
    return key


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

    The secret is settled first (:func:`group_key` when none is given): a peer is
    started with its key, so nothing is bound before the ranks share one.

    Why the exchange is made here, before our address is published: a rank that
    finishes the rendezvous first may broadcast at once; a part arriving before anyone
    subscribed to its kind would be acknowledged (the reliable layer acks every
    request) and then dropped as unhandled, and its sender would never resend it.

    Raises:
        JoinError: a rank did not publish its address (or rank 0 the key), or did not
            answer, within ``Config.join_timeout_s``; the message names the ranks.
        ConfigError: invalid options; no secret and a store that cannot carry a key.
    """
    config = options.config or Config()
    config = config.replace(peer_id=rank_id(rank), run=f"{config.run}:pg{group}")
    host = listen_host(options)
    listen = f"{options.transport}://{host}:0"
    gen = generation(store, rank) if world > 1 else ""
    secret = options.secret
    if not secret:
        secret = group_key(store, rank, world, gen, config.join_timeout_s)
        if rank == 0 and world > 1 and not host.strip("[]").startswith(_LOOPBACK):
            log.warning(
                "gossipnet backend: no GOSSIPNET_SECRET; the group's random key went"
                " through torch's store, so whoever can read that store (MASTER_ADDR:"
                "MASTER_PORT under torchrun) can send this group gradients and objects;"
                " set GOSSIPNET_SECRET to the same secret on every rank on a network you"
                " do not trust"
            )
    peer = join(
        [],
        listen,
        secret=secret,
        faults=options.faults,
        config=config,
        handle_sigterm=options.handle_sigterm,
    )
    try:
        chunk = getattr(peer.node.transport, "default_chunk_bytes", 1024)
        members = [rank_id(r) for r in range(world) if r != rank]
        exchange = peer.runtime.call(_make_exchange(peer, chunk, members))
        _meet(peer, store, rank, world, gen, config.join_timeout_s)
    except BaseException:
        peer.close(announce=False)
        raise
    return peer, exchange


def _identity_of(rank: int, value: bytes) -> tuple[int, bytes]:
    """A rank's ``epoch:public-key-hex`` from the store, parsed.

    Raises:
        JoinError: the value is malformed (another gossipnet version, or a corrupted store).
    """
    try:
        epoch_text, _, key_hex = value.decode().partition(":")
        epoch, public = int(epoch_text), bytes.fromhex(key_hex)
    except (UnicodeDecodeError, ValueError):
        epoch, public = -1, b""
    if epoch < 0 or len(public) != 32:
        raise JoinError(
            f"gossipnet backend: rank {rank} published no usable public key in the store"
            " (every rank must run the same gossipnet version)"
        )
    return epoch, public


async def _make_exchange(peer: Peer, chunk_bytes: int, members: list[str]) -> Exchange:
    """The exchange, made (and subscribed) on the loop thread that runs it."""
    return Exchange(peer.node, chunk_bytes, members)


def _meet(peer: Peer, store: Store, rank: int, world: int, gen: str, timeout_s: float) -> None:
    """Publish our address and public key, read the others', pin their keys, say hello,
    wait for them all.

    Why pin: a rank id is a name any holder of the secret could introduce first (the
    run's key went through this store, or is shared by all ranks); binding each rank's
    id to the public key that rank published in the store leaves no name to take.
    """
    if world <= 1:
        return
    epoch, public = peer.node.identity
    try:
        publish(store, gen, "addr", rank, peer.address)
        publish(store, gen, "pubkey", rank, f"{epoch}:{public.hex()}")
        others = [r for r in range(world) if r != rank]
        addresses = read_ranks(store, gen, "addr", others, world, timeout_s)
        keys = read_ranks(store, gen, "pubkey", others, world, timeout_s)
    except StoreUnusable as err:
        raise JoinError(f"gossipnet backend: the rendezvous store failed: {err}") from err
    pins = [(rank_id(r), *_identity_of(r, keys[r]), addresses[r].decode()) for r in others]

    async def add() -> None:
        node = peer.node
        for peer_id, their_epoch, their_key, address in pins:
            node.pin(peer_id, their_epoch, their_key, address)
        members = node.members
        members.bootstrap.extend(a for *_, a in pins if a not in members.bootstrap)

    peer.runtime.call(add())
    peer.runtime.await_peers(world)
