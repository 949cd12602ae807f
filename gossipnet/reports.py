"""Values that describe what a collective did.

A round that lost packets or peers is not an error: it returns a
:class:`CollectiveReport` saying who contributed, what was sent, received
and lost, and which chunks kept stale values, so the training loop can log
it and go on (torchft's "record, don't raise").
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ("CollectiveReport", "PeerId", "RoundId")

PeerId = str
RoundId = int


@dataclass(slots=True)
class CollectiveReport:
    """Outcome of one collective call on this peer.

    Attributes:
        round: the collective's round number (same on every participant).
        method: "allreduce", "moshpit", "broadcast", ...
        participants: peers this peer expected in the round (sorted).
        contributors: peers from which at least one packet of the round arrived
            (this peer included).
        missing: participants that had data to send this peer in the round and sent
            nothing that arrived (dead, cut, or all lost).  In an all-reduce every
            other participant owes its contributions to a peer that owns a chunk, and
            each chunk's owner its broadcast to everyone; a participant that owns no
            chunk owes nothing to another that owns none, so with fewer chunks than
            participants it is never missing there (the owners name it if it was
            absent, and their averages lack its contribution).
        packets_sent / packets_received / packets_lost: data packets of this round;
            ``packets_lost`` counts expected packets that never arrived.
        chunks_total: chunks of the flat buffer in the round.
        chunks_stale: chunks this peer kept its own (stale) values for because the
            averaged value never arrived.
        delivered_fraction: received / expected data packets, in [0, 1].
        elapsed_s: wall time of the call on this peer's clock.
        timed_out: a phase ended at its deadline instead of on completion.
        extra: method-specific figures; the all-reduce's: ``bytes_sent`` (frame
            bytes of every packet of the round this peer put on the wire: data,
            copies, parity, ENDs, repairs), ``late`` (packets that came after
            their phase), ``copies_sent`` (``redundancy``,
            ``compressed_copies``), ``arrived_behind`` (compressed packets that came
            behind a later one of their sender: copies standing in for lost
            originals, counted as loss so the copies do not switch themselves off),
            ``parity_sent`` and ``recovered`` (``parity_group``: chunks rebuilt
            from parity, which ``packets_lost`` still counts as lost on the wire),
            ``estimated`` (``net.optimizer`` with ``Config.stale_step``: stale
            parameter chunks moved by an estimated step; still in ``chunks_stale``).
            Every all-reduce, optimizer round (gradients, resync), Moshpit and route
            average also carries ``cpu_s``: CPU seconds of this peer's event-loop
            thread over the collective (two ``time.thread_time`` reads on that thread,
            never per packet; the loop may serve other work meanwhile, heartbeats or
            membership, so it is the loop's cost while the collective ran), and
            ``cpu_caller_s``: CPU seconds the calling thread spent on it (flattening,
            staging copies, writing results back).  Their sum is what the network cost
            this machine's CPU (:mod:`gossipnet.runtime.cputime`).
    """

    round: RoundId = 0
    method: str = ""
    participants: tuple[PeerId, ...] = ()
    contributors: tuple[PeerId, ...] = ()
    missing: tuple[PeerId, ...] = ()
    packets_sent: int = 0
    packets_received: int = 0
    packets_lost: int = 0
    chunks_total: int = 0
    chunks_stale: int = 0
    delivered_fraction: float = 1.0
    elapsed_s: float = 0.0
    timed_out: bool = False
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing was lost and no participant is :attr:`missing`."""
        return not self.missing and self.packets_lost == 0 and self.chunks_stale == 0
