"""Two channels to one same-host peer: which packets take the stream, which the alias.

With ``Config.local_stream`` a ``127.0.0.1`` peer is reachable over two local channels:
the loop-served stream and ZeroMQ's alias. ``ZmqTransport.send`` picks one per packet
from its ``group_bytes`` (a collective round's chunk size) alone: groups above
``STREAM_GROUP_MAX_BYTES`` take the alias once it is connected, everything else the
stream, unless the stream carries payloads through shared memory (``Config.local_shm``):
then every group takes it. These tests pin the sender to ``local_shm=False`` except the
last, which checks that rule. What could go wrong, and is checked here: a group split
across the two channels (an END overtaking its round's data on the faster one); a large
group sent over the alias before it is connected (ZeroMQ drops those) or over TCP
unsigned; and a peer missing either channel losing packets instead of using the other.
Waits poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import pytest

from gossipnet.config import Config
from gossipnet.transport.base import Buffer, LocalFrames
from gossipnet.transport.zeromq import local_ipc as _local_ipc
from gossipnet.transport.zeromq.backend import ZmqTransport
from gossipnet.transport.zeromq.local_stream import STREAM_GROUP_MAX_BYTES

pytestmark = [
    pytest.mark.timeout(20),
    pytest.mark.skipif(_local_ipc.stream_path(1) is None, reason="no same-host sockets here"),
]

WAIT_S = 5.0  # deadline of every wait on a condition (the conftest's ``wait_until``)
LARGE = 4 * 1024 * 1024  # a 25M-element round's chunk size: above the limit
SMALL = 1024 * 1024  # a 1M-element round's over 4 peers: at the limit, stream


class _Channels:
    """Records which channel ``tx`` handed each packet to: "alias" or "stream"."""

    def __init__(self, tx: ZmqTransport) -> None:
        self.log: list[tuple[bytes, str]] = []  # (first frame, channel)
        push, stream = tx._push, tx._send_stream

        def on_push(sock: Any, frames: Sequence[Buffer]) -> bool:
            self.log.append((bytes(frames[0]), "alias"))
            return push(sock, frames)

        def on_stream(writer: Any, frames: Sequence[Buffer]) -> bool:
            self.log.append((bytes(frames[0]), "stream"))
            return stream(writer, frames)

        tx._push = on_push  # type: ignore[method-assign]
        tx._send_stream = on_stream  # type: ignore[method-assign]

    def of(self, prefix: bytes) -> set[str]:
        return {ch for head, ch in self.log if head.startswith(prefix)}


async def _pair(
    rx_config: Config, tx_config: Config | None = None
) -> tuple[ZmqTransport, ZmqTransport, list[Any]]:
    got: list[Any] = []  # (frame type, first frame) per packet, in arrival order
    tx_config = tx_config or Config(local_stream=True, local_shm=False)
    rx, tx = ZmqTransport(rx_config), ZmqTransport(tx_config)
    await rx.start(lambda frames: got.append((type(frames), bytes(frames[0]))))
    await tx.start(lambda frames: None)
    return rx, tx, got


def _round(tag: bytes, n: int, size: int) -> list[list[bytes]]:
    """``n`` data packets of ``size`` payload bytes, then a small END: one round's."""
    data = [[b"%s-%02d" % (tag, i), os.urandom(size)] for i in range(n)]
    return [*data, [b"%s-end" % tag, b"n=%d" % n]]


def _heads(got: list[Any], tag: bytes) -> list[bytes]:
    return [head for _, head in got if head.startswith(tag)]


def test_a_large_group_takes_the_alias_a_small_one_the_stream_each_in_order(
    wait_until: Any,
) -> None:
    """Two rounds interleaved packet by packet, one of 4 MiB chunks and one of
    1 MiB: every packet of each round (data and END) takes one channel, the large
    one the alias, the small one the stream, and each arrives in its send order."""

    assert SMALL <= STREAM_GROUP_MAX_BYTES < LARGE  # the premise: one each side

    async def main() -> None:
        rx, tx, got = await _pair(Config(local_stream=True))
        channels = _Channels(tx)
        assert tx.send(rx.address, [b"hello"])  # control: the stream, dials the alias too
        assert rx.address in tx._routes.push
        ready = lambda: tx._routes.ready_alias(rx.address) is not None  # noqa: E731
        await wait_until(ready, WAIT_S, what="the alias to connect")
        big, small = _round(b"big", 6, 100_000), _round(b"small", 6, 3000)
        for pair in zip(big[:-1], small[:-1], strict=True):
            assert tx.send(rx.address, pair[0], group_bytes=LARGE)
            assert tx.send(rx.address, pair[1], group_bytes=SMALL)
        # the ENDs as a run (send_batch), with one more data packet of each round first
        more_big, more_small = [b"big-06", b"x"], [b"small-06", b"y"]
        assert tx.send_batch(rx.address, [more_big, big[-1]], group_bytes=LARGE) == 2
        assert tx.send_batch(rx.address, [more_small, small[-1]], group_bytes=SMALL) == 2
        total = 1 + len(big) + len(small) + 2
        await wait_until(lambda: len(got) == total, WAIT_S, what="every packet")
        assert channels.of(b"big") == {"alias"}
        assert channels.of(b"small") == {"stream"}
        assert channels.of(b"hello") == {"stream"}
        for tag in (b"big", b"small"):
            assert _heads(got, tag) == [b"%s-%02d" % (tag, i) for i in range(7)] + [b"%s-end" % tag]
        assert all(kind is LocalFrames for kind, _ in got)  # both channels are local
        assert tx.stats.dropped_queue_full == 0
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_a_large_group_before_the_alias_answers_stays_on_the_stream(wait_until: Any) -> None:
    """A destination whose alias is gone (or not connected yet): large groups go
    over the stream, never over TCP (their unsigned MACs would be rejected there)
    and never into a ZeroMQ socket that drops them."""

    async def main() -> None:
        rx, tx, got = await _pair(Config(local_stream=True))
        channels = _Channels(tx)
        assert rx._alias is not None
        os.unlink(rx._alias)  # the alias is gone before the sender looks for it
        big = _round(b"big", 4, 200_000)
        for frames in big:
            assert tx.send(rx.address, frames, group_bytes=LARGE)
        await wait_until(lambda: len(got) == len(big), WAIT_S, what="every packet")
        assert channels.of(b"big") == {"stream"}
        assert _heads(got, b"big") == [f[0] for f in big]
        assert all(kind is LocalFrames for kind, _ in got)
        assert not tx._routes.is_local(rx.address)  # its ZeroMQ route is TCP: unused
        assert tx.is_local(rx.address)  # the stream is, so packets may go unsigned
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_without_a_stream_every_group_takes_zeromq_in_order(wait_until: Any) -> None:
    """A peer that serves no stream (``local_stream=False``): small and large
    groups alike take ZeroMQ's alias, in order, none dropped."""

    async def main() -> None:
        rx, tx, got = await _pair(Config(local_stream=False))
        channels = _Channels(tx)
        assert rx._inbox is None
        assert await tx.connect(rx.address, 3.0)
        big, small = _round(b"big", 4, 200_000), _round(b"small", 4, 3000)
        for frames in big:
            assert tx.send(rx.address, frames, group_bytes=LARGE)
        for frames in small:
            assert tx.send(rx.address, frames, group_bytes=SMALL)
        await wait_until(lambda: len(got) == len(big) + len(small), WAIT_S, what="every packet")
        assert channels.of(b"big") == channels.of(b"small") == {"alias"}
        assert _heads(got, b"big") == [f[0] for f in big]
        assert _heads(got, b"small") == [f[0] for f in small]
        assert all(kind is LocalFrames for kind, _ in got)
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_a_peer_that_closes_leaves_neither_its_stream_nor_its_alias_open(
    wait_until: Any,
) -> None:
    """The alias dialed beside a stream goes when the stream's receiver closes (a
    peer that left): 50 guests joining and leaving must not leave 50 sockets."""

    async def main() -> None:
        rx, tx, got = await _pair(Config(local_stream=True))
        assert tx.send(rx.address, [b"hello"])
        ready = lambda: tx._routes.ready_alias(rx.address) is not None  # noqa: E731
        await wait_until(ready, WAIT_S, what="the alias to connect")
        await wait_until(lambda: len(got) == 1, WAIT_S, what="the packet")
        await rx.close()
        assert tx._streams is not None
        gone = lambda: not tx._streams.writers and rx.address not in tx._routes.push  # type: ignore[union-attr] # noqa: E731
        await wait_until(gone, WAIT_S, what="both sockets to close")
        assert not tx._routes.is_local(rx.address)
        await tx.close()

    asyncio.run(main())


def test_with_shared_memory_every_group_takes_the_stream_in_order(wait_until: Any) -> None:
    """``local_shm``: large rounds' payloads go through slots, so the alias's I/O
    thread has no kernel copies to take off the loop: every group takes the stream."""

    async def main() -> None:
        rx, tx, got = await _pair(Config(local_stream=True), Config(local_stream=True))
        channels = _Channels(tx)
        assert tx.send(rx.address, [b"hello"])
        ready = lambda: tx._routes.ready_alias(rx.address) is not None  # noqa: E731
        await wait_until(ready, WAIT_S, what="the alias to connect")
        big = _round(b"big", 6, 100_000)
        for frames in big:
            assert tx.send(rx.address, frames, group_bytes=LARGE)
        await wait_until(lambda: len(got) == 1 + len(big), WAIT_S, what="every packet")
        assert channels.of(b"big") == {"stream"}
        assert _heads(got, b"big") == [b"big-%02d" % i for i in range(6)] + [b"big-end"]
        writer = tx._streams.writers[rx.address]  # type: ignore[union-attr]
        assert writer.shm is not None
        assert writer.shm.full == 0  # the payloads took slots
        await tx.close()
        await rx.close()

    asyncio.run(main())
