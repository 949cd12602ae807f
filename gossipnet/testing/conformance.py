"""The transport conformance suite: checks every :class:`Transport` backend must pass.

Why one suite: the layers above a transport (the wire codec, membership, the
collectives) rely on its contract (:mod:`gossipnet.transport.base`), not on a
backend; a backend that delivers a mutated buffer, raises on an unknown peer or
forgets to count a drop breaks them in ways their own tests, run on the memory
network, never see.  So each rule is written once, here, and every backend runs
all of them: memory, ZeroMQ (tcp, ipc, inproc), UDP, the fault wrapper, and
yours (trio's ``check_one_way_stream`` is the model).

The contract, as checked:
- ``start`` returns the bound, concrete address (no port 0, no wildcard host),
  distinct per endpoint; ``max_packet_bytes`` and ``default_chunk_bytes`` are
  positive and the chunk fits in a packet.
- A packet is a list of frames; it arrives frame by frame, byte for byte (empty
  frames, read-only views and buffers the sender mutates once ``send``
  returned included) on the loop thread, as memoryviews.
- ``send`` never raises and never blocks; every call is counted exactly once
  while the endpoint is open: True and ``sent_packets`` (+ ``sent_bytes``), or
  False and one drop counter.  Unknown or malformed addresses are
  ``dropped_unreachable``, packets over the limit ``dropped_oversize``, a packet
  of no frames ``dropped_malformed``; a handler that raises does not stall delivery.
- ``connect`` (where a backend has one) to a peer nobody serves returns a bool
  within its deadline, never raises; ``forget`` and ``is_local`` never raise.
- ``close`` is idempotent; afterwards ``send`` returns False without raising, and
  the closed endpoint's handler is not called again.

Every check runs under a deadline and waits on conditions, never on a sleep.

Example (pytest)::

    SPEC = TransportSpec(make=lambda: MyTransport("my://127.0.0.1:0"),
                         unbound_address=lambda: "my://127.0.0.1:9")
    @pytest.mark.parametrize("check", sorted(CHECKS))
    def test_my_transport(check: str) -> None:
        gossipnet.testing.run(run_check(SPEC, check))
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields

from gossipnet.testing.virtual_time import wait_until
from gossipnet.transport.base import Buffer, Transport, TransportStats

__all__ = ("CHECKS", "TransportFactory", "TransportSpec", "check_transport", "run_check")

#: Builds one new, unstarted endpoint; called on the running loop.
TransportFactory = Callable[[], Transport]

#: The counters of a send that did not go out (each send increments one, or sent_packets).
_DROPS = (*(f.name for f in fields(TransportStats) if f.name.startswith("dropped_")), "send_errors")


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportSpec:
    """A backend under test.

    Args:
        make: builds a new, unstarted endpoint; every endpoint it builds must be
            able to reach every other one.
        unbound_address: a valid address of this backend that no endpoint serves
            (a free port, a name nobody bound), called once per use.
        timeout_s: deadline of each check, in real seconds.
        send_malformed: writes ``count`` packets that this backend's framing
            rejects to the given address (e.g. truncated UDP datagrams); None for
            backends with no framing of their own.  The receiver must count each
            in ``dropped_malformed`` and deliver none.

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """

    make: TransportFactory
    unbound_address: Callable[[], str]
    timeout_s: float = 10.0
    send_malformed: Callable[[str, int], None] | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class _Inbox:
    """A handler that keeps copies of what arrives, and the thread it ran on."""

    def __init__(self) -> None:
        self.packets: list[list[bytes]] = []
        self.threads: set[int] = set()
        self.types_ok = True

    def has(self, count: int) -> bool:
        return len(self.packets) >= count

    def __call__(self, frames: list[memoryview]) -> None:
        self.threads.add(threading.get_ident())
        self.types_ok = self.types_ok and all(isinstance(f, memoryview) for f in frames)
        self.packets.append([bytes(f) for f in frames])


def _accounted(stats: TransportStats) -> int:
    return stats.sent_packets + sum(getattr(stats, name) for name in _DROPS)


def _send(tx: Transport, dst: str, frames: Sequence[Buffer], *, urgent: bool = False) -> bool:
    """``tx.send`` plus the rule that an open endpoint counts every call exactly once."""
    before = _accounted(tx.stats)
    sent_before = tx.stats.sent_packets
    ok = tx.send(dst, frames, urgent=urgent)
    assert isinstance(ok, bool), f"send returned {ok!r}, not a bool"
    assert _accounted(tx.stats) == before + 1, f"send to {dst!r} was not counted exactly once"
    assert (tx.stats.sent_packets == sent_before + 1) is ok, "send's verdict disagrees with stats"
    return ok


def _connector(t: Transport) -> Callable[[str, float], Awaitable[bool]] | None:
    """The backend's optional ``connect(dst, timeout_s)``, also through a wrapper's inner."""
    connect = getattr(t, "connect", None) or getattr(getattr(t, "inner", None), "connect", None)
    return connect if callable(connect) else None


async def _eventually(spec: TransportSpec, pred: Callable[[], bool], what: str) -> None:
    await wait_until(pred, spec.timeout_s, step_s=0.001, what=what)


@contextlib.asynccontextmanager
async def _pair(spec: TransportSpec) -> AsyncIterator[tuple[Transport, Transport, _Inbox]]:
    """A started sender and receiver (connected where the backend connects)."""
    inbox = _Inbox()
    rx, tx = spec.make(), spec.make()
    try:
        await rx.start(inbox)
        await tx.start(lambda frames: None)
        connect = _connector(tx)
        if connect is not None:
            assert await connect(rx.address, spec.timeout_s), f"could not connect to {rx.address}"
        yield tx, rx, inbox
    finally:
        await tx.close()
        await rx.close()


# ---------------------------------------------------------------------- the checks
async def check_addresses(spec: TransportSpec) -> None:
    """``start`` returns the concrete bound address, distinct per endpoint."""
    async with _pair(spec) as (tx, rx, _):
        for t in (tx, rx):
            assert t.address, "start left the address empty"
            assert "0.0.0.0" not in t.address, f"wildcard advertised: {t.address}"
            assert not t.address.endswith(":0"), f"port 0 advertised: {t.address}"
        assert tx.address != rx.address
        assert isinstance(rx.max_packet_bytes, int)
        assert rx.max_packet_bytes > 0
        assert 0 < rx.default_chunk_bytes <= rx.max_packet_bytes
        assert isinstance(rx.stats, TransportStats)


async def check_round_trip(spec: TransportSpec) -> None:
    """Frames arrive byte for byte on the loop thread, even if the sender reuses its buffer."""
    async with _pair(spec) as (tx, rx, inbox):
        size = min(16 * 1024, rx.max_packet_bytes // 2)
        payload = bytearray(bytes(range(256)) * (size // 256))
        floats = memoryview(array.array("f", [1.5, -2.0, 3.25]))
        frozen = memoryview(bytes(payload)).toreadonly()
        frames: list[Buffer] = [b"header", payload, floats, b"", frozen]
        expect = [b"header", bytes(payload), floats.tobytes(), b"", bytes(frozen)]
        assert _send(tx, rx.address, frames)
        payload[:8] = b"mutated!"  # allowed once send returned
        await _eventually(spec, lambda: len(inbox.packets) == 1, "the packet")
        assert inbox.packets[0] == expect, "frames changed on the way"
        assert inbox.types_ok, "the handler got frames that are not memoryviews"
        assert inbox.threads == {threading.get_ident()}, "handler ran off the loop thread"
        nbytes = sum(len(f) for f in expect)
        assert tx.stats.sent_bytes == rx.stats.recv_bytes == nbytes
        assert rx.stats.recv_packets == 1


async def check_many_packets_and_urgent(spec: TransportSpec) -> None:
    """A modest stream arrives whole; ``urgent`` packets are delivered too."""
    n = 200
    async with _pair(spec) as (tx, rx, inbox):
        for i in range(n):
            assert _send(tx, rx.address, [i.to_bytes(4, "big"), bytes(512)], urgent=i % 7 == 0)
            if i % 20 == 19:  # a modest rate: wait until the previous burst is in
                await _eventually(spec, functools.partial(inbox.has, i - 19), "the burst")
        await _eventually(spec, lambda: len(inbox.packets) == n, f"{n} packets")
        assert sorted(int.from_bytes(p[0], "big") for p in inbox.packets) == list(range(n))


async def check_handler_error_does_not_stall(spec: TransportSpec) -> None:
    """A handler that raises loses that packet only; later ones are still delivered."""
    got: list[bytes] = []
    errors: list[object] = []

    def handler(frames: list[memoryview]) -> None:
        got.append(bytes(frames[0]))
        if len(got) == 1:
            raise RuntimeError("handler failed on purpose")

    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context.get("exception")))
    rx, tx = spec.make(), spec.make()
    try:
        await rx.start(handler)
        await tx.start(lambda frames: None)
        connect = _connector(tx)
        if connect is not None:
            assert await connect(rx.address, spec.timeout_s)
        for i in range(5):
            _send(tx, rx.address, [bytes([i])])
        await _eventually(spec, lambda: len(got) == 5, "5 packets after a failing handler")
    finally:
        await tx.close()
        await rx.close()
        loop.set_exception_handler(previous)
    assert all(e is None or isinstance(e, RuntimeError) for e in errors), errors


async def check_unreachable_never_raises(spec: TransportSpec) -> None:
    """Unknown peers and malformed addresses are counted drops, never exceptions."""
    tx = spec.make()
    await tx.start(lambda frames: None)
    try:
        nobody = spec.unbound_address()
        for _ in range(3):
            _send(tx, nobody, [b"h", bytes(256)])
        connect = _connector(tx)
        if connect is not None:
            async with asyncio.timeout(spec.timeout_s):
                assert isinstance(await connect(spec.unbound_address(), 0.05), bool)
        unreachable = tx.stats.dropped_unreachable
        for bad in ("no-scheme", "", "bogus://x", "tcp:"):
            assert not _send(tx, bad, [b"x"]), f"send to {bad!r} claimed success"
        assert tx.stats.dropped_unreachable == unreachable + 4
        tx.forget(nobody)
        tx.forget("no-scheme")
        assert isinstance(tx.is_local(nobody), bool)
    finally:
        await tx.close()


async def check_oversize_and_malformed(spec: TransportSpec) -> None:
    """Too-large and frameless packets are dropped and counted; the link still works."""
    async with _pair(spec) as (tx, rx, inbox):
        limit = tx.max_packet_bytes
        assert not _send(tx, rx.address, [b"h", bytes(limit)]), "an oversized packet went out"
        assert tx.stats.dropped_oversize == 1, "an oversized packet not counted as such"
        assert not _send(tx, rx.address, []), "a packet of no frames went out"
        assert tx.stats.dropped_malformed == 1, "a packet of no frames not counted as malformed"
        if spec.send_malformed is not None:
            spec.send_malformed(rx.address, 3)
        assert _send(tx, rx.address, [b"ok"])
        await _eventually(spec, lambda: inbox.packets == [[b"ok"]], "the packet after drops")
        if spec.send_malformed is not None:
            await _eventually(spec, lambda: rx.stats.dropped_malformed == 3, "3 malformed drops")
            assert rx.stats.recv_packets == 1


async def check_close(spec: TransportSpec) -> None:
    """``close`` twice is fine; a closed endpoint neither sends nor hears."""
    async with _pair(spec) as (tx, rx, inbox):
        witness_inbox = _Inbox()
        witness = spec.make()
        await witness.start(witness_inbox)
        try:
            connect = _connector(tx)
            if connect is not None:
                assert await connect(witness.address, spec.timeout_s)
            await rx.close()
            await rx.close()
            assert not rx.send(tx.address, [b"x"]), "a closed endpoint sent"
            tx.send(rx.address, [b"late"])  # may be queued; must never reach the handler
            assert _send(tx, witness.address, [b"after"])
            await _eventually(spec, lambda: witness_inbox.packets == [[b"after"]], "the witness")
            assert inbox.packets == [], "a closed endpoint's handler was called"
        finally:
            await witness.close()
    await tx.close()  # a third time, after the pair closed it


#: Every check by name, in the order :func:`check_transport` runs them.
CHECKS: Mapping[str, Callable[[TransportSpec], Awaitable[None]]] = {
    "addresses": check_addresses,
    "round_trip": check_round_trip,
    "many_packets_and_urgent": check_many_packets_and_urgent,
    "handler_error_does_not_stall": check_handler_error_does_not_stall,
    "unreachable_never_raises": check_unreachable_never_raises,
    "oversize_and_malformed": check_oversize_and_malformed,
    "close": check_close,
}


async def run_check(spec: TransportSpec, name: str) -> None:
    """Run the check ``name`` of :data:`CHECKS` under ``spec.timeout_s``.

    Raises:
        KeyError: no such check.
        AssertionError: the backend broke the contract; the message says how.
        TimeoutError: the check did not finish in time (a send or close blocked).
    """
    check = CHECKS[name]
    async with asyncio.timeout(spec.timeout_s):
        await check(spec)


async def check_transport(spec: TransportSpec) -> None:
    """Run every check of the suite on one backend, stopping at the first failure.

    Raises:
        AssertionError: the first broken rule, prefixed with the check's name.
        TimeoutError: a check did not finish within ``spec.timeout_s``.
    """
    for name in CHECKS:
        try:
            await run_check(spec, name)
        except AssertionError as err:
            raise AssertionError(f"transport check {name!r} failed: {err}") from err
