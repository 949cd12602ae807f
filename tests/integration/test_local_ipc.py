"""Peers on 127.0.0.1 reach each other over Unix-socket aliases, and fall back to TCP.

What could go wrong, and is checked here: a sender that dialed before its peer
was up stays on TCP (the move to the alias must happen, without losing the
packets sent while it happens); a stale socket file or a directory another
user could write must never be used; ``local_ipc=False`` must mean TCP; and
closing must remove the alias file.  Waits poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from gossipnet.config import Config
from gossipnet.transport.base import LocalFrames
from gossipnet.transport.zeromq import local_ipc as _local_ipc
from gossipnet.transport.zeromq.backend import ZmqTransport

pytestmark = [
    pytest.mark.timeout(20),
    pytest.mark.skipif(_local_ipc.alias_path(1) is None, reason="no same-host aliases here"),
]


WAIT_S = 5.0  # deadline of every wait on a condition (the conftest's ``wait_until``)
#: These tests are about ZeroMQ's alias; the loop-served stream that takes same-host
#: packets first where it is on is tested in test_local_stream.py.
ALIAS = Config(local_stream=False)


def route(tx: ZmqTransport, dst: str) -> str:
    """The endpoint ``tx``'s socket for ``dst`` is connected to."""
    return tx._routes.push[dst].getsockopt_string(zmq.LAST_ENDPOINT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "tcp://0.0.0.0:0"])
def test_loopback_peer_is_reached_over_its_alias(listen: str, wait_until: Any) -> None:
    async def main() -> None:
        got: list[bytes] = []
        rx = ZmqTransport(ALIAS, listen)
        tx = ZmqTransport(ALIAS)
        await rx.start(lambda frames: got.append(bytes(frames[1])))
        await tx.start(lambda frames: None)
        assert rx.address.startswith("tcp://127.0.0.1:")  # the identity stays TCP
        alias = rx._alias
        assert alias is not None
        assert stat.S_ISSOCK(os.lstat(alias).st_mode)
        assert await tx.connect(rx.address, 3.0)
        assert route(tx, rx.address) == f"ipc://{alias}"
        payload = os.urandom(300_000)
        assert tx.send(rx.address, [b"h", payload])
        await wait_until(lambda: got == [payload], WAIT_S, what="the packet")
        await tx.close()
        await rx.close()
        aliases.append(alias)

    aliases: list[str] = []
    asyncio.run(main())
    assert not os.path.exists(aliases[0])  # close removed it


def test_sender_that_dialed_first_moves_to_the_alias_without_loss(wait_until: Any) -> None:
    """Dial a port nobody listens on yet: TCP first, then the alias once the peer is up."""

    async def main() -> None:
        port = _free_port()
        got: list[int] = []
        tx = ZmqTransport(ALIAS)
        await tx.start(lambda frames: None)
        dst = f"tcp://127.0.0.1:{port}"
        assert not tx.send(dst, [b"early"])  # not up: dropped and counted, as on UDP
        assert route(tx, dst) == dst
        rx = ZmqTransport(ALIAS, dst)
        await rx.start(lambda frames: got.append(int.from_bytes(frames[0], "big")))
        sent: list[int] = []
        seq = 0

        def send_one() -> bool:
            nonlocal seq
            seq += 1
            if tx.send(dst, [seq.to_bytes(4, "big")]):
                sent.append(seq)
            return route(tx, dst).startswith("ipc://") and len(sent) >= 50

        deadline = time.monotonic() + 5.0
        while not send_one():  # zmq's reconnect brings TCP up first, then the move
            assert time.monotonic() < deadline, "never moved to the alias"
            await asyncio.sleep(0.002)
        await wait_until(lambda: got[-1:] == sent[-1:], WAIT_S, what="the last packet")
        # Accepted packets may be lost only in the hand-over: those the TCP socket
        # still queued when the alias socket took over.  At most a few.
        missing = set(sent) - set(got)
        assert len(missing) <= 3, missing
        assert route(tx, dst) == f"ipc://{rx._alias}"
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_alias_arrivals_are_local_frames_and_tcp_ones_are_not(wait_until: Any) -> None:
    """Only what came through the private alias may skip the MAC check."""

    async def main() -> None:
        got: list[type] = []
        rx = ZmqTransport(ALIAS)
        via_alias, via_tcp = ZmqTransport(ALIAS), ZmqTransport(Config(local_ipc=False))
        await rx.start(lambda frames: got.append(type(frames)))
        for tx in (via_alias, via_tcp):
            await tx.start(lambda frames: None)
            assert await tx.connect(rx.address, 3.0)
        assert via_alias.is_local(rx.address)
        assert not via_tcp.is_local(rx.address)
        assert via_alias.send(rx.address, [b"a"])
        await wait_until(lambda: len(got) == 1, WAIT_S)
        assert via_tcp.send(rx.address, [b"t"])
        await wait_until(lambda: len(got) == 2, WAIT_S)
        assert got == [LocalFrames, list]
        via_alias.forget(rx.address)
        assert not via_alias.is_local(rx.address)  # until it dials again
        for t in (via_alias, via_tcp, rx):
            await t.close()

    asyncio.run(main())


def test_local_ipc_false_keeps_tcp(wait_until: Any) -> None:
    async def main() -> None:
        got: list[bytes] = []
        config = Config(local_ipc=False)
        rx, tx = ZmqTransport(config), ZmqTransport(config)
        await rx.start(lambda frames: got.append(bytes(frames[0])))
        await tx.start(lambda frames: None)
        assert rx._alias is None
        assert await tx.connect(rx.address, 3.0)
        assert tx.send(rx.address, [b"x"])
        await wait_until(lambda: got == [b"x"], WAIT_S)
        assert route(tx, rx.address) == rx.address
        await tx.close()
        await rx.close()

    asyncio.run(main())


def test_stale_or_foreign_files_are_not_aliases(tmp_path: Path) -> None:
    port = _free_port()
    path = _local_ipc.alias_path(port)
    assert path is not None
    try:
        with open(path, "w"):  # a regular file where the socket should be
            pass
        assert _local_ipc.live_alias(port) is None
        os.unlink(path)
        with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: refuses
            dead.bind(path)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert _local_ipc.live_alias(port) is None
        os.unlink(path)
        with socket.socket(socket.AF_UNIX) as live:
            live.bind(path)
            live.listen()
            assert _local_ipc.live_alias(port) == path
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def test_a_directory_others_can_write_disables_aliases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_local_ipc.tempfile, "gettempdir", lambda: str(tmp_path))
    private = tmp_path / f"gossipnet-{os.getuid()}"
    netns = os.stat("/proc/self/ns/net").st_ino
    assert _local_ipc.alias_path(5) == str(private / f"{netns}-5.ipc")
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    os.chmod(private, 0o777)
    assert _local_ipc.alias_path(5) is None
    os.rmdir(private)
    os.symlink(tmp_path, private)  # a link is never ours
    assert _local_ipc.alias_path(5) is None
    monkeypatch.setattr(_local_ipc.tempfile, "gettempdir", lambda: "/" + "x" * 120)
    assert _local_ipc.alias_path(5) is None  # longer than a Unix socket path allows


def test_alias_names_differ_between_network_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """127.0.0.1:port in one namespace is not 127.0.0.1:port in another."""
    here = _local_ipc.alias_path(7000)
    monkeypatch.setattr(_local_ipc, "_netns", lambda: 12345)
    there = _local_ipc.alias_path(7000)
    assert here is not None
    assert there is not None
    assert here != there
    monkeypatch.setattr(_local_ipc, "_netns", lambda: None)  # no /proc: no aliases
    assert _local_ipc.alias_path(7000) is None
