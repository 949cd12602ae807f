"""Replica agreement: parameter digests after each resync, compared across peers.

Why: drift between replicas is bounded by design (a lost broadcast keeps a
stale chunk) and every resync is meant to end it, so *after a resync* the
replicas must be bit-identical.  That was assumed, not checked, and a peer
that ran one round off the others stayed wrong for a whole run while every
report looked healthy.  Now the optimizer hashes its parameters after every
resync (BLAKE2b-128 of the flat buckets' bytes, off the event loop: hashlib
releases the GIL) and announces ``[round id, digest]`` (a packet to each peer at once, then in
its heartbeats).
Each peer compares what it hears for the same resync; a peer whose digest is
in the minority downloads the majority's state (``training._realign``), and
``net.replicas_agree()`` tells the user.

Who votes: only the peers heard taking part in that very resync round (its
``in_sync``, passed to :meth:`ReplicaDigests.publish`).  A digest from any other id
(one that never sent a packet of the round: a made-up id, a peer out of step) is
kept but counts for nothing, so ids that a key holder makes up cannot outvote the
participants (:mod:`gossipnet.training._evidence`).

Majority: the digest most voters share; a tie goes to the group that holds the
lowest peer id, so that every peer reaches the same verdict without another
exchange.  A peer repairs only when the majority also holds
:func:`~gossipnet.training._evidence.quorum` of the voters (``ReplicaCheck.needed``).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gossipnet.collectives.chunks import as_bytes
from gossipnet.collectives.lossy.round_id import valid_round
from gossipnet.runtime.node import Node
from gossipnet.training._evidence import quorum
from gossipnet.training.kinds import TrainingKind
from gossipnet.transport.wire import Packet

__all__ = ("DIGEST_KEY", "ReplicaCheck", "ReplicaDigests", "digest")

#: Heartbeat field: ``[round id of the resync, 32 hex digits]``.
DIGEST_KEY = "opt.rd"
_HEX = frozenset("0123456789abcdef")
_DIGEST_BYTES = 16


def digest(buckets: Iterable[torch.Tensor]) -> str:
    """BLAKE2b-128 of the buckets' raw bytes (contiguous CPU tensors), as 32 hex digits.

    Bit-exact: two replicas agree only if every byte does, which is what a
    completed resync leaves (everyone copies the same owner's bytes).  128 bits:
    a state downloaded from a peer is adopted when its parameters hash to what
    others vouched for, so finding other parameters with the same digest must be
    out of reach (a second preimage of 128 bits, not 64).
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for b in buckets:
        t = b.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.contiguous().cpu()
        h.update(as_bytes(t))
    return h.hexdigest()


def _valid(value: object) -> tuple[int, str] | None:
    if not (isinstance(value, list) and len(value) == 2 and valid_round(value[0])):
        return None
    d = value[1]
    if not (isinstance(d, str) and len(d) == 2 * _DIGEST_BYTES and set(d) <= _HEX):
        return None
    return value[0], d


@dataclass(frozen=True, slots=True)
class ReplicaCheck:
    """The verdict on one resync's digests (truthy when every replica agrees).

    Attributes:
        agree: every voter (an alive peer heard in the resync round) reported this
            resync, with the same digest.
        round_id: the resync's round id (None: no resync has run here yet).
        digests: voter -> digest, for the voters that reported this resync.
        majority: the digest the verdict treats as right (see the module doc).
        disagree: voters whose digest is not the majority's.
        missing: voters that have not reported this resync (yet).
        needed: how many voters must hold the majority's digest for a peer outside
            it to repair (:func:`~gossipnet.training._evidence.quorum` of the voters).
    """

    agree: bool
    round_id: int | None
    digests: dict[str, str] = field(default_factory=dict)
    majority: str | None = None
    disagree: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    needed: int = 1

    def __bool__(self) -> bool:
        return self.agree

    @property
    def holders(self) -> tuple[str, ...]:
        """Voters whose digest is the majority's (sorted)."""
        return tuple(sorted(p for p, d in self.digests.items() if d == self.majority))

    def outvoted(self, me: str) -> bool:
        """Whether ``me`` disagrees with a majority that holds a quorum (it should repair)."""
        return me in self.disagree and len(self.holders) >= self.needed


class ReplicaDigests:
    """Our latest resync digest and the ones peers announced; loop thread only."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.ours: tuple[int, str] | None = None
        #: the peers heard taking part in the resync of :attr:`ours` (the voters)
        self.voters: frozenset[str] = frozenset()
        self.peers: dict[str, tuple[int, str]] = {}
        self.rejected = 0
        node.on_heartbeat(self._on_heartbeat)
        node.subscribe(TrainingKind.DIGEST, self._on_heartbeat)
        node.on_membership(self._on_membership)

    def publish(self, round_id: int, value: str, participants: Iterable[str]) -> None:
        """Announce our digest after resync ``round_id``: at once to every alive peer,
        then in every heartbeat (which repairs a lost first copy).

        ``participants``: the peers heard taking part in that resync round (its
        ``Alignment.in_sync``); only their digests vote on it.
        """
        self.ours = (round_id, value)
        self.voters = frozenset(participants) | {self.node.peer_id}
        self.node.beacon[DIGEST_KEY] = [round_id, value]
        fields = {DIGEST_KEY: [round_id, value]}
        for p in self.node.alive_peers():
            if p != self.node.peer_id:
                self.node.send(p, TrainingKind.DIGEST, fields)

    def _on_heartbeat(self, pkt: Packet) -> None:
        raw = pkt.fields.get(DIGEST_KEY)
        if raw is None:
            return
        got = _valid(raw)
        if got is None:
            self.rejected += 1
            return
        self.peers[pkt.src] = got

    def _on_membership(self, event: str, peer: str) -> None:
        if event != "joined":  # a restarted or departed peer's old digest means nothing
            self.peers.pop(peer, None)

    def verdict(self, alive: Sequence[str]) -> ReplicaCheck:
        """Compare the digests of the alive voters for our latest resync (peers that
        did not take part in it are neither counted nor missing)."""
        me = self.node.peer_id
        if self.ours is None:
            return ReplicaCheck(agree=True, round_id=None)
        rid, mine = self.ours
        digests = {me: mine}
        missing = []
        for p in alive:
            if p == me or p not in self.voters:
                continue
            got = self.peers.get(p)
            if got is not None and got[0] == rid:
                digests[p] = got[1]
            else:
                missing.append(p)
        counts = collections.Counter(digests.values())
        top = max(counts.values())
        tied = {d for d, c in counts.items() if c == top}
        majority = digests[min(p for p, d in digests.items() if d in tied)]
        disagree = tuple(sorted(p for p, d in digests.items() if d != majority))
        return ReplicaCheck(
            agree=not disagree and not missing,
            round_id=rid,
            digests=digests,
            majority=majority,
            disagree=disagree,
            missing=tuple(sorted(missing)),
            needed=quorum(len(digests) + len(missing)),
        )
