"""Deliberate, seeded, per-link network faults that wrap any transport backend.

Why a wrapper and not a backend feature: one :class:`FaultPlan` must mean the same
losses, delays and cuts on the memory hub, on ZeroMQ and on UDP, so that a failure
found in a unit test replays on real sockets (the trio ``FakeNet`` router and
Linux ``netem``/``tbf`` are the models).

Determinism: every directed link ``src -> dst`` owns one
``random.Random(f"{seed}:{src}->{dst}")`` (a string seed is stable across processes;
``hash()`` is not), created lazily, so adding a peer never changes another link's
fates.  Each packet draws the same seven values in the same order
whichever faults are switched on, so the i-th packet of a link is lost under
``loss=0.1`` whether or not jitter or duplication is also on.

Time: plan time is ``clock.now()`` minus the clock reading when the transport
started.  Delays are ``clock.call_later`` timers, never a task per packet, and the
hot path of an undelayed packet is a few draws and comparisons.

Dropped packets are lost "in the network": :meth:`FaultyTransport.send` still
returns True for them, as a real socket does for a datagram the network loses,
so the layers above cannot cheat; the counters in ``fault_stats`` say what happened.

The plan's value types (:class:`FaultPlan`, :class:`GilbertElliott`, :class:`Partition`,
:class:`Crash`, :class:`FaultStats`) live in :mod:`._fault_plan` and are importable from
here; this module is the transport that applies them.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Sequence
from typing import ClassVar

from gossipnet.clock import Clock, TimerHandle
from gossipnet.errors import ClosedError
from gossipnet.transport.base import BatchHandler, Buffer, PacketHandler, Transport, TransportStats
from gossipnet.transport.fault_plan import (
    Crash,
    FaultPlan,
    FaultStats,
    GilbertElliott,
    Link,
    Partition,
)

__all__ = ("Crash", "FaultPlan", "FaultStats", "FaultyTransport", "GilbertElliott", "Partition")

# Public home of the plan's classes: reprs, docs and pickles (a FaultPlan travels to
# spawned processes) name this module, not the private one they are defined in.
for _cls in (Crash, FaultPlan, FaultStats, GilbertElliott, Partition):
    _cls.__module__ = __name__
del _cls


class _LinkState:
    """Per directed link: its RNG, Gilbert-Elliott state, token bucket, counters."""

    __slots__ = ("bad", "last_refill_s", "plan", "rng", "stats", "tokens")

    def __init__(self, seed: int, src: str, dst: str, plan: FaultPlan, now_s: float) -> None:
        self.rng = random.Random(f"{seed}:{src}->{dst}")
        self.plan = plan
        self.bad = False
        self.tokens = float(plan.bucket_bytes)
        self.last_refill_s = now_s
        self.stats = FaultStats()

    def shape(self, nbytes: int, t: float) -> float | None:
        """Seconds the packet waits for tokens, or None if it would wait too long."""
        plan = self.plan
        rate = plan.bandwidth_bytes_per_s
        if rate is None:
            return 0.0
        # Tokens may go negative: that debt is the queue of packets already waiting.
        tokens = min(float(plan.bucket_bytes), self.tokens + (t - self.last_refill_s) * rate)
        self.last_refill_s = t
        wait = 0.0 if tokens >= nbytes else (nbytes - tokens) / rate
        if wait > plan.max_queue_delay_s:
            self.tokens = tokens
            return None
        self.tokens = tokens - nbytes
        return wait


def _nbytes(frames: Sequence[Buffer]) -> int:
    """A packet's frame bytes, as the backends count them (``sent_bytes``)."""
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


def _frozen(frames: Sequence[Buffer]) -> list[Buffer]:
    # A delayed packet outlives send(): keep what was sent, as a network would, even of
    # frames the sender promised not to change (is_frozen) while a real queue holds them.
    return [f if type(f) is bytes else bytes(f) for f in frames]


class FaultyTransport(Transport):
    """A :class:`Transport` that applies a :class:`FaultPlan` around another one.

    Args:
        inner: the backend that really moves packets (memory, ZeroMQ, UDP).
        plan: the faults.
        clock: time source for plan time and delay timers.
        name: this endpoint's name in the plan (links, partitions, crashes); None
            means the inner transport's bound address.
    """

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, inner: Transport, plan: FaultPlan, clock: Clock, name: str | None = None
    ) -> None:
        # Not calling Transport.__init__: stats and address are the inner backend's.
        self._handler: PacketHandler | None = None
        self._batch_handler: BatchHandler | None = None
        self.inner = inner
        self.plan = plan
        self.clock = clock
        self.name = name
        self.fault_stats = FaultStats()
        self.link_stats: dict[Link, FaultStats] = {}
        self._links: dict[str, _LinkState] = {}
        self._timers: dict[int, TimerHandle] = {}
        self._timer_ids = itertools.count()
        self._t0 = 0.0
        self._closed = False
        # packets (and their frame bytes) this endpoint sent that the plan's network
        # then lost, and the extra copies it duplicated into the inner transport
        self._lost = [0, 0]
        self._duplicated = [0, 0]
        self._crashes: dict[str, tuple[Crash, ...]] = {}
        for c in plan.crash:
            self._crashes[c.peer] = (*self._crashes.get(c.peer, ()), c)

    # -- forwarded to the inner transport ------------------------------------------
    @property
    def stats(self) -> TransportStats:
        return self.inner.stats

    @stats.setter
    def stats(self, value: TransportStats) -> None:
        self.inner.stats = value

    @property
    def address(self) -> str:
        return self.inner.address

    @address.setter
    def address(self, value: str) -> None:
        self.inner.address = value

    @property
    def default_chunk_bytes(self) -> int:  # type: ignore[override]  # per instance here
        return self.inner.default_chunk_bytes

    @property
    def max_packet_bytes(self) -> int:
        return self.inner.max_packet_bytes

    @property
    def max_chunk_bytes(self) -> int:
        return getattr(self.inner, "max_chunk_bytes", self.inner.default_chunk_bytes)

    def is_local(self, dst: str) -> bool:
        return self.inner.is_local(dst)

    def forget(self, dst: str) -> None:
        # The link's RNG and state stay: forgetting must not replay its fates.
        self.inner.forget(dst)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self, handler: PacketHandler) -> str:
        """Start the inner transport; plan time 0 is now."""
        if self._closed:
            raise ClosedError("this FaultyTransport was closed; create a new one")
        self._t0 = self.clock.now()
        self._handler = handler
        address = await self.inner.start(self._on_packet)
        if self.name is None:
            self.name = address
        return address

    async def close(self) -> None:
        """Cancel delayed packets (they are lost) and close the inner transport."""
        if not self._closed:
            self._closed = True
            for handle in self._timers.values():
                handle.cancel()
            self._timers.clear()
        await self.inner.close()

    @property
    def net_lost(self) -> tuple[int, int]:
        """``(packets, frame bytes)`` sent here that the plan's network lost: sent by
        this endpoint (``send`` returned True) but never in the inner transport's
        ``sent_bytes``.  A crashed sender's packets never left it: not counted."""
        return self._lost[0], self._lost[1]

    @property
    def net_duplicated(self) -> tuple[int, int]:
        """``(packets, frame bytes)`` of the copies the plan's network duplicated that
        the inner transport took: in its ``sent_bytes``, not sent by this endpoint."""
        return self._duplicated[0], self._duplicated[1]

    @property
    def plan_time_s(self) -> float:
        """Seconds of plan time since :meth:`start`."""
        return self.clock.now() - self._t0

    @property
    def pending_delayed(self) -> int:
        """Delayed packets (and duplicates) not yet handed to the inner transport."""
        return len(self._timers)

    def is_crashed(self, peer: str, t: float | None = None) -> bool:
        """Whether ``peer`` is crashed at plan time ``t`` (default: now)."""
        crashes = self._crashes.get(peer)
        if not crashes:
            return False
        when = self.plan_time_s if t is None else t
        return any(c.down(when) for c in crashes)

    # -- data path ---------------------------------------------------------------
    @property
    def batch_handler(self) -> BatchHandler | None:
        """Per-drain delivery, passed through to an inner backend that offers it.

        Why: faults act on the send side, so what the inner backend read in one drain
        can go up in one call as well (the node's per-drain intake); a receive-side
        crash drops the whole drain, counted per packet.
        """
        return self._batch_handler

    @batch_handler.setter
    def batch_handler(self, handler: BatchHandler | None) -> None:
        self._batch_handler = handler
        if hasattr(self.inner, "batch_handler"):
            setattr(self.inner, "batch_handler", None if handler is None else self._on_batch)  # noqa: B010

    def _on_batch(self, batch: list[list[memoryview]]) -> None:
        if self._closed or self._batch_handler is None:
            return
        if self._crashes and self.name is not None and self.is_crashed(self.name):
            self.fault_stats.dropped_crash += len(batch)
            return
        self._batch_handler(batch)

    def _on_packet(self, frames: list[memoryview]) -> None:
        if self._closed or self._handler is None:
            return
        if self._crashes and self.name is not None and self.is_crashed(self.name):
            self.fault_stats.dropped_crash += 1  # receive side: no per-link source known
            return
        self._handler(frames)

    def _link(self, dst: str) -> _LinkState:
        src = self.name or self.inner.address
        state = _LinkState(self.plan.seed, src, dst, self.plan.for_link(src, dst), self.plan_time_s)
        self._links[dst] = state
        self.link_stats[(src, dst)] = state.stats
        return state

    def _count(self, link: _LinkState, counter: str) -> None:
        setattr(link.stats, counter, getattr(link.stats, counter) + 1)
        setattr(self.fault_stats, counter, getattr(self.fault_stats, counter) + 1)

    def _drop(self, link: _LinkState, counter: str, frames: Sequence[Buffer] | None) -> bool:
        """Count a packet the network loses (``frames``: its bytes left this endpoint;
        None: they never did, its sender is crashed)."""
        self._count(link, counter)
        if frames is not None:
            self._lost[0] += 1
            self._lost[1] += _nbytes(frames)
        return True  # lost in the network: the sender cannot tell

    def send(
        self,
        dst: str,
        frames: Sequence[Buffer],
        *,
        urgent: bool = False,
        group_bytes: int = 0,
    ) -> bool:
        """Apply the plan to one packet for ``dst``; forward it now or on a timer.

        Returns True for packets the faults drop (as for network loss) or delay,
        otherwise the inner transport's verdict; False before start and once closed.
        """
        if self._closed or self._handler is None:
            return False
        link = self._links.get(dst) or self._link(dst)
        t = self.clock.now() - self._t0
        rnd = link.rng.random
        # Always seven draws in this order: fates do not depend on which faults are on.
        u_loss, u_state, u_burst, u_jit, u_reorder, u_dup, u_dup_jit = (
            rnd(), rnd(), rnd(), rnd(), rnd(), rnd(), rnd()
        )  # fmt: skip
        plan, burst = link.plan, link.plan.burst
        if burst is not None:  # step the chain on every packet, dropped or not
            link.bad = u_state >= burst.p_bad_to_good if link.bad else u_state < burst.p_good_to_bad
        src = self.name or self.inner.address
        if self._crashes and self.is_crashed(src, t):
            return self._drop(link, "dropped_crash", None)
        if self._crashes and self.is_crashed(dst, t):
            return self._drop(link, "dropped_crash", frames)
        if self.plan.partitions and any(p.cuts(src, dst, t) for p in self.plan.partitions):
            return self._drop(link, "dropped_partition", frames)
        loss = plan.loss if self.plan.link_loss is None else self.plan.link_loss(src, dst, t)
        if u_loss < loss:
            return self._drop(link, "dropped_loss", frames)
        if burst is not None and u_burst < (burst.loss_bad if link.bad else burst.loss_good):
            return self._drop(link, "dropped_burst", frames)
        base = plan.delay_s
        if plan.bandwidth_bytes_per_s is not None:
            wait = link.shape(_nbytes(frames), t)
            if wait is None:
                return self._drop(link, "dropped_bandwidth", frames)
            base += wait
        link.stats.passed += 1
        self.fault_stats.passed += 1
        delay = base + u_jit * plan.jitter_s
        if u_reorder < plan.reorder:
            delay += plan.reorder_delay_s
            self._count(link, "reordered")
        ok, frozen = True, None
        if delay > 0.0:
            frozen = self._delay(link, delay, dst, frames, group_bytes)
        elif urgent:
            ok = self.inner.send(dst, frames, urgent=True)
        else:
            ok = self._forward(dst, frames, group_bytes)
        if u_dup < plan.duplicate:
            dup_s = base + u_dup_jit * plan.jitter_s
            self._duplicate(link, dup_s, dst, frames, frozen, group_bytes)
        return ok

    def _forward(self, dst: str, frames: Sequence[Buffer], group_bytes: int) -> bool:
        """To the inner transport, with the group hint only where there is one (so
        inner transports written before ``group_bytes`` existed still take control)."""
        if group_bytes:
            return self.inner.send(dst, frames, group_bytes=group_bytes)
        return self.inner.send(dst, frames)

    # The two slow paths of send(), out of line: an undelayed packet never calls them.
    def _delay(
        self,
        link: _LinkState,
        delay_s: float,
        dst: str,
        frames: Sequence[Buffer],
        group_bytes: int,
    ) -> list[Buffer]:
        """Hold a packet that passed for ``delay_s`` on a timer; returns the frozen copy
        that the timer will send (a duplicate reuses it)."""
        self._count(link, "delayed")
        frozen = _frozen(frames)
        self._later(delay_s, dst, frozen, group_bytes)
        return frozen

    def _duplicate(
        self,
        link: _LinkState,
        delay_s: float,
        dst: str,
        frames: Sequence[Buffer],
        frozen: list[Buffer] | None,
        group_bytes: int,
    ) -> None:
        """Send the extra copy a duplicating network makes: now, or after its own delay
        ``delay_s``, from the original's frozen copy (``frozen``) when there is one."""
        self._count(link, "duplicated")
        if delay_s > 0.0:
            copy = frozen if frozen is not None else _frozen(frames)
            self._later(delay_s, dst, copy, group_bytes, duplicate=True)
        elif self._forward(dst, frames, group_bytes):
            self._duplicated[0] += 1
            self._duplicated[1] += _nbytes(frames)

    def _later(
        self,
        delay_s: float,
        dst: str,
        frames: list[Buffer],
        group_bytes: int,
        *,
        duplicate: bool = False,
    ) -> None:
        token = next(self._timer_ids)
        callback = functools.partial(self._fire, token, dst, frames, group_bytes, duplicate)
        self._timers[token] = self.clock.call_later(delay_s, callback)

    def _fire(
        self, token: int, dst: str, frames: list[Buffer], group_bytes: int, duplicate: bool
    ) -> None:
        if self._timers.pop(token, None) is None or self._closed:
            return
        if self._forward(dst, frames, group_bytes) and duplicate:
            self._duplicated[0] += 1
            self._duplicated[1] += _nbytes(frames)
