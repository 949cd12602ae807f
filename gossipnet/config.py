"""Every knob in one frozen dataclass.

Units are in the names (``_s`` seconds, ``_bytes``, ``_packets``).  Values
are validated in ``__post_init__`` so a bad setting fails at ``join()``
with a message, not deep in a round.  ``Config.replace(**kw)`` derives a
variant; ``join(**overrides)`` uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gossipnet.errors import ConfigError

__all__ = ("Config",)

#: The parity group of the lossy optimizer's rounds while ``Config.parity_group`` is None.
OPTIMIZER_PARITY_GROUP = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """gossipnet's settings, with defaults that suit a LAN or loopback.

    Identity
        run: run id; packets of another run are dropped (also mixed into the MAC).
        peer_id: stable name of this peer; ``None`` derives one (``rank<N>`` under
            torchrun, else a random hex id).
    Transport
        chunk_bytes: payload bytes per data packet; ``None`` takes the backend's
            default (256 KiB for ZeroMQ, 1024 B for UDP so a datagram fits one MTU).
        send_queue_packets: per-destination send queue; a full queue drops the packet.
        recv_queue_packets: receive queue before the kernel/ZeroMQ drops.
        udp_socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF asked for UDP sockets.
        udp_pace_mbps: pace UDP sends to this many Mbit/s of wire bytes (token bucket,
            destinations served in turn); ``None`` sends at once.  Set it to the
            link's rate when a slower link or shaper would tail-drop bursts.
        udp_gso: send the datagrams one loop iteration queues for a destination in
            few system calls (``UDP_SEGMENT``, generic segmentation offload) and read
            coalesced datagrams (``UDP_GRO``), each datagram still one packet MAC'd on
            its own; a socket whose kernel or device refuses either falls back to one
            datagram per call, detected once (``UdpTransport.path`` says which runs).
            False forces the one-datagram-per-call path.
        use_uvloop: run the event loop on uvloop when it is installed.
        tune_malloc: on glibc, keep large allocations on the heap and freed memory
            mapped (``gossipnet.runtime._malloc``): received messages then stop costing
            page faults every round (~10% of a 25M all-reduce's CPU).  Process-wide,
            applied once at the first ``join``; False leaves the allocator alone.
        gc_freeze: at ``join``, move every object Python's cyclic garbage collector
            tracks into its permanent generation (``gc.freeze()``): with torch loaded
            a full collection walked them all and paused the process 0.15-0.29 s,
            measured mid-round on 2 cores; peers then cut this one as silent and its
            contributions left the round at 0% loss.  Frozen objects are still freed
            by reference counting; only reference cycles among them that become
            garbage later are never collected.  False leaves the collector alone.
        gc_threshold: at ``join``, raise the collector's young-generation threshold
            to this many net container allocations (CPython's default is 700): the
            packet path's in-flight objects started a collection every couple of
            hundred packets, 8-9% of a round's CPU, and their promotions brought
            on full collections (``runtime/_gc.py``; a 17 MB step on the namespace
            testbed about 8% faster, medians 0.407 against 0.375 s).  Never lowers a
            higher threshold, and a threshold of 0 (collection off) stays off;
            cyclic garbage waits that many allocations longer.  None leaves the
            threshold alone.
        local_ipc: reach peers on ``127.0.0.1`` over a Unix socket in a directory
            private to this user instead of TCP (ZeroMQ backend;
            ``transport/zeromq/local_ipc.py``), and skip the payload MAC there: only this
            user's processes can write to it (the pair's secret local token is still
            checked).  Addresses stay ``tcp://127.0.0.1:<port>``.  A 25M float32
            all-reduce across four local processes takes 0.99x gloo's time with it,
            1.41x without (``bench/allreduce.py``, rows ``gossipnet`` and
            ``gossipnet tcp``).
        local_stream: with ``local_ipc``, also reach peers on ``127.0.0.1`` over a Unix
            stream socket that the event loop reads and writes itself, not through
            ZeroMQ's I/O threads (``transport/zeromq/local_stream.py``; same private
            directory, same unsigned payloads).  Why: each thread hand-off after an
            idle gap costs scheduling latency.  Without ``local_shm`` a collective
            round chooses: chunks up to 1 MiB take the stream, larger ones ZeroMQ's
            alias, whose I/O thread makes the kernel copies beside the loop's
            reduction (``Transport.send``'s ``group_bytes``; one round never splits
            across the two, so its END never overtakes its data).  Peers without the
            stream are reached as before.  False: ZeroMQ's alias for everything.
        local_shm: with ``local_stream``, payloads of 64 KiB and more travel through
            shared memory (``transport/zeromq/local_shm.py``): the sender copies each
            into a slot of a segment its same-host receivers map (one copy for all of
            them when the same packet goes to several), the stream carries a 16-byte
            descriptor, and each receiver reads the payload in place: one copy
            instead of the socket's two, so every round takes the stream.  Up to 128
            MiB per sending peer (32 slots of 4 MiB, pages only where written; a full
            segment sends inline).  A 25M float32 all-reduce across four local
            processes: 0.75x gloo's time against 1.08x without it; 1M: 1.01x against
            1.30x (medians of three runs, ``bench/allreduce.py``, docs/benchmarks.md).
    Wire
        max_header_bytes: larger msgpack headers are dropped before parsing.
        max_payload_bytes: larger payloads are dropped before any copy.
        replay_window_packets: sliding window of accepted sequence numbers per sender.
        mac: ``"aes-gmac"`` (10-20 GB/s with AES-NI), ``"hmac-sha256"`` (about 1.8 GB/s
            with SHA extensions) or ``"blake2b"``; every peer of a run must agree.
        reject_log_interval_s: at most one log line per reject reason per interval.
        max_clock_skew_s: a sender's epoch (its start, ``time.time_ns()``) further ahead
            of our wall clock than this is rejected (``future_epoch``): a forged epoch
            from the far future would otherwise outrank every real packet of that
            peer, and its restarts, for ever.  Hosts' clocks must agree this closely.
    Membership
        heartbeat_interval_s: how often a peer announces itself.
        failure_timeout_s: silence after which a peer is declared dead.
        control_retry_s: first retry delay of an acknowledged control message (doubles).
        control_timeout_s: give up on a control message after this long.
        join_timeout_s: ``join()`` returns as soon as the expected peers are alive
            and waits up to this long for them; then it raises
            :class:`~gossipnet.JoinError` (naming the addresses that never answered
            or failed authentication) unless ``min_peers`` are alive.
        min_peers: peers (this one included) enough to go on with at
            ``join_timeout_s`` when not all expected peers came (a warning names the
            absent); ``None``: all of them, so a typo or a wrong secret fails loudly.
            A preemptible fleet, where some peers are always down, sets it.
        max_peers: most peers one peer keeps keys and state for (itself included):
            a member making up ids cannot make it dial, key and track without end.
            Introductions beyond it are dropped (``admission`` counter
            ``peers_full``); set it above the largest run you expect.
        admit_per_s: new peer ids bound to a key per second at most (a burst of 64
            passes at once): a member introducing made-up ids fills
            ``max_peers`` only this fast (``admission`` counter ``admit_rate``).
    Collectives
        collective_timeout_s: default upper bound of one all-reduce / averaging round.
        phase_min_wait_s: floor of the learned per-sender allowance: a sender is never
            cut sooner than this after its first packet of a phase, nor while any
            sender of the phase delivered something within this long.
        phase_deadline_factor: a sender's allowance is ``factor x`` the median span
            (first packet to END marker) of recent senders; never beyond the timeout.
        resync_every_steps: steps between full parameter resyncs (averages with repair, after
            which every replica is identical) of the lossy optimizer and of
            ``all_reduce(..., step=opt)``; both also resync at their first step (0: only then).
        redundancy: copies of every data packet of a collective (1 = none).  Proactive,
            never a retransmission: copies go out in a second pass over the phase, so
            a chunk is lost only if every copy is (about p^k under random loss) at k
            times the data traffic.  2 is worth it where loss is high and bandwidth
            plentiful; bench/quality.py shows what it buys in model quality.
        parity_group: one XOR parity packet per this many data packets of a stream
            (0 = none, at most 64).  Recovers any one lost packet of its group, so a
            chunk stays lost only if another of its group is lost too: at 10% loss,
            groups of 4 to 7 leave 3.4-5.2% lost at at most a quarter more traffic,
            where ``redundancy=2`` leaves 1% at twice the traffic.  A stream (one
            sender's chunks for one receiver) shorter than the group gets none.
            Sent only while loss is being seen (by us or, from their END markers and
            heartbeats, our peers), so a clean network pays nothing; ``parity_always``
            sends it in every round.  ``None`` (the default): ``OPTIMIZER_PARITY_GROUP``
            (4) in the lossy optimizer's rounds and ``net.all_reduce(..., step=opt)``'s,
            where what is lost costs model quality (10% loss, 10 seeds: 1.015x the
            lossless perplexity without, 1.002-1.004x with, ``bench/quality.py
            --seeds 10 --plans 0.1 0.1p0``), and none in a plain ``net.all_reduce``,
            whose caller gets the unbiased estimate
            with its report and pays for parity only by choice (on 2 cores at 25M
            elements it costs a fifth more time while loss lasts,
            ``bench/allreduce.py --parity 4``).
        parity_always: send parity packets even while no loss has been seen.
        compressed_copies: copies of every data packet of a compressed round (``compress=``)
            while loss is being seen, by us or our peers (1 = none; with
            ``parity_always``, in every round).  Parity cannot serve these rounds: it
            XORs payloads of one length, and compressed packets differ.  A compressed
            round moves a tenth of the dense bytes or less, so a second copy costs less
            than parity adds to a dense round, and a chunk (with the ARC-Top-K set
            announcement it carries) is then lost with about p^2 instead of p (the
            optimizer's parameter updates too).  On the demo at 10% loss 2 took ArcTopK(0.1, int8)
            from 10.46 to 9.88 perplexity (docs/benchmarks.md).
            Off by default: at 1% loss (the 20 Mbit/s testbed) they cost 57% more bytes
            and 7% more time to the target for no gain; turn them on where loss is high.
        stale_step: the lossy optimizer (``strategy="allreduce"``) moves a parameter
            chunk whose broadcast was lost by the size of the last step of it that
            arrived, against the sign of this peer's own gradient, instead of
            keeping it one step behind: the gradient taken there next is what lost
            broadcasts cost (``collectives/lossy/stale_step.py``).  False keeps the old
            values.  Dense rounds only: a compressed round's lost update keeps the old
            values (no later broadcast would overwrite an estimate).
    """

    # identity
    run: str = "gossipnet"
    peer_id: str | None = None
    # transport
    chunk_bytes: int | None = None
    send_queue_packets: int = 4096
    recv_queue_packets: int = 8192
    udp_socket_buffer_bytes: int = 8 * 1024 * 1024
    udp_pace_mbps: float | None = None
    udp_gso: bool = True
    use_uvloop: bool = True
    tune_malloc: bool = True
    gc_freeze: bool = True
    gc_threshold: int | None = 10_000
    local_ipc: bool = True
    local_stream: bool = True
    local_shm: bool = True
    # wire
    max_header_bytes: int = 2048
    max_payload_bytes: int = 4 * 1024 * 1024
    replay_window_packets: int = 8192
    mac: str = "aes-gmac"
    reject_log_interval_s: float = 5.0
    max_clock_skew_s: float = 60.0
    # membership
    heartbeat_interval_s: float = 0.5
    failure_timeout_s: float = 3.0
    control_retry_s: float = 0.05
    control_timeout_s: float = 3.0
    join_timeout_s: float = 30.0
    min_peers: int | None = None
    max_peers: int = 512
    admit_per_s: float = 20.0
    # collectives
    collective_timeout_s: float = 10.0
    phase_min_wait_s: float = 0.1
    phase_deadline_factor: float = 3.0
    resync_every_steps: int = 100
    redundancy: int = 1
    parity_group: int | None = None
    parity_always: bool = False
    compressed_copies: int = 1
    stale_step: bool = True

    def __post_init__(self) -> None:
        positive = (
            "send_queue_packets",
            "recv_queue_packets",
            "udp_socket_buffer_bytes",
            "max_header_bytes",
            "max_payload_bytes",
            "replay_window_packets",
            "max_clock_skew_s",
            "heartbeat_interval_s",
            "failure_timeout_s",
            "control_retry_s",
            "control_timeout_s",
            "join_timeout_s",
            "admit_per_s",
            "collective_timeout_s",
            "phase_deadline_factor",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"Config.{name} must be > 0, got {getattr(self, name)!r}")
        if self.chunk_bytes is not None and not 64 <= self.chunk_bytes <= self.max_payload_bytes:
            raise ConfigError(
                f"Config.chunk_bytes must be in [64, max_payload_bytes={self.max_payload_bytes}],"
                f" got {self.chunk_bytes}"
            )
        if self.chunk_bytes is not None and self.chunk_bytes % 8:
            raise ConfigError("Config.chunk_bytes must be a multiple of 8 (element alignment)")
        if self.failure_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "Config.failure_timeout_s must exceed heartbeat_interval_s, or every peer "
                "looks dead between two heartbeats"
            )
        if self.udp_pace_mbps is not None and not self.udp_pace_mbps > 0:
            raise ConfigError(
                f"Config.udp_pace_mbps must be > 0 or None, got {self.udp_pace_mbps!r}"
            )
        if not isinstance(self.udp_gso, bool):
            raise ConfigError(f"Config.udp_gso must be True or False, got {self.udp_gso!r}")
        if not isinstance(self.gc_freeze, bool):
            raise ConfigError(f"Config.gc_freeze must be True or False, got {self.gc_freeze!r}")
        if self.gc_threshold is not None and (
            type(self.gc_threshold) is not int or not 1 <= self.gc_threshold <= 10_000_000
        ):
            raise ConfigError(
                f"Config.gc_threshold must be None or an int in [1, 10000000], got"
                f" {self.gc_threshold!r}"
            )
        if self.mac not in ("aes-gmac", "hmac-sha256", "blake2b"):
            raise ConfigError(
                f"Config.mac must be 'aes-gmac', 'hmac-sha256' or 'blake2b', got {self.mac!r}"
            )
        if not isinstance(self.redundancy, int) or not 1 <= self.redundancy <= 8:
            raise ConfigError(f"Config.redundancy must be an int in [1, 8], got {self.redundancy}")
        if type(self.compressed_copies) is not int or not 1 <= self.compressed_copies <= 8:
            raise ConfigError(
                f"Config.compressed_copies must be an int in [1, 8], got {self.compressed_copies!r}"
            )
        if self.parity_group is not None and (
            not isinstance(self.parity_group, int) or not 0 <= self.parity_group <= 64
        ):
            raise ConfigError(
                f"Config.parity_group must be None or an int in [0, 64] (0 = no parity), got"
                f" {self.parity_group}"
            )
        if self.min_peers is not None and (type(self.min_peers) is not int or self.min_peers < 1):
            raise ConfigError(
                f"Config.min_peers must be None (all expected peers) or an int >= 1 (peers"
                f" to go on with, this one included), got {self.min_peers!r}"
            )
        if type(self.max_peers) is not int or not 2 <= self.max_peers <= 65536:
            raise ConfigError(
                f"Config.max_peers must be an int in [2, 65536], got {self.max_peers!r}"
            )
        if self.phase_min_wait_s < 0 or self.resync_every_steps < 0:
            raise ConfigError("phase_min_wait_s and resync_every_steps must be >= 0")
        if not self.run or len(self.run) > 64:
            raise ConfigError("Config.run must be a non-empty string of at most 64 characters")

    def parity_for(self, *, optimizer: bool) -> int:
        """The parity group of a round: ``parity_group`` where set, else
        ``OPTIMIZER_PARITY_GROUP`` for a training step's rounds (the lossy optimizer's,
        ``all_reduce(..., step=opt)``'s, the torch backend's) and 0 elsewhere."""
        if self.parity_group is not None:
            return self.parity_group
        return OPTIMIZER_PARITY_GROUP if optimizer else 0

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied; unknown names raise ``ConfigError``."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown Config field(s) {unknown}; known: {sorted(names)}")
        return dataclasses.replace(self, **changes)
