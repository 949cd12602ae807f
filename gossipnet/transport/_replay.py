"""Per-sender replay windows: which ``(epoch, seq)`` a receiver has already taken.

Why a per-sender window: transports and fault plans duplicate and reorder,
and an on-path attacker can replay; a sliding bitmap of sequence numbers
(IPsec's, RFC 4303 section 3.4.3) drops both in O(1) while taking
out-of-order packets.  The epoch (sender incarnation) lets a restarted peer
count from zero again without being taken for a replayer.

Why bounds on epoch and seq: they move the window, and a window moved by one
authenticated packet stays moved.  An epoch (the sender's start,
``time.time_ns()``) further than the allowed clock skew ahead of our clock is
``future_epoch``: 2**63 would otherwise lock the real peer out for ever.  A
seq beyond what the sender could have sent since its epoch (one packet per
100 ns) is ``seq_range``.  Only authenticated, well-formed packets reach the
window (:class:`~gossipnet.transport.wire.WireCodec` checks first), so a
forger cannot move it at all.
"""

from __future__ import annotations

import time

__all__ = ("INT64_MAX", "ReplayWindow")

INT64_MAX = (1 << 63) - 1
#: A sender cannot have sent more than one packet per this many ns since its epoch.
_MIN_NS_PER_PACKET = 100


class _SenderState:
    """Replay state of one sender: epoch, highest seq, bitmap of the window below it.

    Bit ``i`` of ``seen`` stands for seq ``top - i``.  A Python int is the
    bitset: shifting a window of a few thousand bits costs well under a
    microsecond, and no per-seq allocation happens.
    """

    __slots__ = ("epoch", "seen", "top")

    def __init__(self, epoch: int, top: int) -> None:
        self.epoch = epoch
        self.top = top
        self.seen = 1


class ReplayWindow:
    """The windows of every sender one receiver has heard.

    Args:
        packets: window length (``Config.replay_window_packets``).
        skew_s: how far a sender's epoch may be ahead of our clock
            (``Config.max_clock_skew_s``).
    """

    def __init__(self, packets: int, skew_s: float) -> None:
        self._window = packets
        self._mask = (1 << packets) - 1
        self._skew_ns = int(skew_s * 1e9)
        self._senders: dict[str, _SenderState] = {}

    def check(self, src: str, epoch: int, seq: int) -> str | None:
        """``None`` if ``(epoch, seq)`` from ``src`` is new and the newest yet (fresh),
        ``""`` if new but older than the newest (reordered), else the reject reason
        (``future_epoch``, ``seq_range``, ``stale_epoch``, ``replay``); a packet that
        is not refused is marked taken.
        """
        state = self._senders.get(src)
        if state is None or epoch > state.epoch:
            # First contact or a new incarnation: start a fresh window.
            if epoch > time.time_ns() + self._skew_ns:
                return "future_epoch"
            if seq > self._max_seq(epoch):
                return "seq_range"
            self._senders[src] = _SenderState(epoch, seq)
            return None
        if epoch < state.epoch:
            return "stale_epoch"
        if seq > state.top:
            shift = seq - state.top
            if shift >= self._window and seq > self._max_seq(epoch):
                return "seq_range"
            state.seen = ((state.seen << shift) | 1) & self._mask if shift < self._window else 1
            state.top = seq
            return None
        back = state.top - seq
        if back >= self._window or (state.seen >> back) & 1:
            return "replay"
        state.seen |= 1 << back
        return ""

    def _max_seq(self, epoch: int) -> int:
        """The highest seq a sender started at ``epoch`` can have reached by now.

        Checked only on a jump past the whole window (rare: the sender sent more
        than a window of packets to others since its last one to us), so the
        common path pays no clock read.
        """
        return (time.time_ns() + self._skew_ns - epoch) // _MIN_NS_PER_PACKET

    def forget(self, src: str) -> None:
        """Release the window of a departed peer.

        The sender's epoch and highest seq stay (two ints), with the whole
        window marked seen: its old packets stay rejected even after it left,
        while the same incarnation may come back with newer seqs and a
        restart (higher epoch) starts afresh.  Dropping the entry outright
        would let anyone replay the departed peer's captured packets once.
        """
        state = self._senders.get(src)
        if state is not None:
            state.seen = self._mask  # a shared int: no per-peer bitmap memory
