"""Which key a peer id belongs to: the binding rule for introductions.

Any member holding the run secret can send an introduction (a HELLO with a public
key, :mod:`gossipnet.transport.identity`) under any name, so an introduction is a
claim, not a fact.  The rule, first come first bound:

- an id nobody holds yet is bound to the key that introduces it, while the peer
  has fewer than ``Config.max_peers`` bound and within ``Config.admit_per_s`` new
  ids a second (a burst of :data:`ADMIT_BURST`): a member making up ids gets a
  bounded number of them, at a bounded rate;
- a second key for a bound id (a restarted peer, or someone claiming its name) is
  bound only when the first is silent: its holder is not alive
  (``failure_timeout_s`` without a packet under its key) and the new
  incarnation is newer.  While the bound holder speaks, the claim is refused and
  reported (``identity_conflict``): a live peer's name cannot be taken over.
  Pinned ids (the torch backend's ranks, whose keys come from its store) never
  change key;
- an incarnation that said goodbye (LEAVE) is never bound again.

Why here and not in the codec: whether a peer is alive is the membership's
knowledge; the codec only holds the keys it is told to.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from gossipnet.clock import Clock
from gossipnet.config import Config
from gossipnet.transport.identity import PUBLIC_KEY_BYTES
from gossipnet.transport.wire import WireCodec

__all__ = ("ADMIT_BURST", "Admission")

#: New ids bound at once before ``Config.admit_per_s`` paces them.
ADMIT_BURST = 64

log = logging.getLogger("gossipnet.runtime.node")


class Admission:
    """The binding rule over one codec's keys; runs on the loop thread.

    Args:
        codec: holds the bound keys.
        config: ``max_peers``, ``admit_per_s``, ``failure_timeout_s``.
        clock: paces admissions and warnings.
        alive: whether a peer id is alive now (the membership's view).
        left_epoch: the incarnation of an id that announced LEAVE, or -1.
    """

    def __init__(
        self,
        codec: WireCodec,
        config: Config,
        clock: Clock,
        alive: Callable[[str], bool],
        left_epoch: Callable[[str], int],
    ) -> None:
        self.codec = codec
        self.config = config
        self.clock = clock
        self._alive = alive
        self._left_epoch = left_epoch
        self._tokens = float(ADMIT_BURST)
        self._filled = clock.now()
        self._warned: dict[str, float] = {}
        #: introductions by outcome: new, same, rebound, and the refusals
        #: (identity_conflict, stale_intro, peers_full, admit_rate, bad_key, epoch_mismatch)
        self.counts: collections.Counter[str] = collections.Counter()

    def introduce(self, peer_id: str, epoch: int, public: object) -> str:
        """Apply the rule to an introduction of ``peer_id`` (incarnation ``epoch``) with
        ``public``; the outcome (counted): ``new``, ``same`` or ``rebound`` where
        ``peer_id`` is now bound to ``public``, else the reason it is not."""
        outcome = self._decide(peer_id, epoch, public)
        self.counts[outcome] += 1
        return outcome

    def _decide(self, peer_id: str, epoch: int, public: object) -> str:
        if type(public) is not bytes or len(public) != PUBLIC_KEY_BYTES:
            return "bad_key"
        if self._left_epoch(peer_id) >= epoch:
            return "stale_intro"
        keys = self.codec.keys
        bound = keys.by_id.get(peer_id)
        if bound is not None:
            if bound.public == public:
                return "same" if bound.epoch == epoch else "epoch_mismatch"
            if bound.pinned:
                self._conflict(peer_id, "its key is pinned by the launcher")
                return "identity_conflict"
            if epoch <= bound.epoch:
                return "stale_intro"
            if self._alive(peer_id):
                self._conflict(peer_id, "the key it is bound to still speaks")
                return "identity_conflict"
            return "rebound" if self._bind(peer_id, epoch, public) else "bad_key"
        if len(keys) + 1 >= self.config.max_peers:
            return "peers_full"
        if not self._take_token():
            return "admit_rate"
        return "new" if self._bind(peer_id, epoch, public) else "bad_key"

    def _bind(self, peer_id: str, epoch: int, public: bytes) -> bool:
        try:
            self.codec.bind(peer_id, epoch, public)
        except ValueError:  # a low-order point, our own key or id
            return False
        return True

    def _take_token(self) -> bool:
        """The admission rate's token bucket: True (and one token taken) if one is left."""
        now = self.clock.now()
        rate = self.config.admit_per_s
        self._tokens = min(float(ADMIT_BURST), self._tokens + (now - self._filled) * rate)
        self._filled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _conflict(self, peer_id: str, why: str) -> None:
        """Warn (once per failure timeout per id) that a second key claims ``peer_id``."""
        now = self.clock.now()
        last = self._warned.get(peer_id)
        if last is not None and now - last < self.config.failure_timeout_s:
            return
        if len(self._warned) > 1024:
            self._warned.clear()
        self._warned[peer_id] = now
        log.warning(
            "peer %s: a second key claims peer id %r and is refused (%s): a peer"
            " restarting under the same id is accepted once its previous life has been"
            " silent for failure_timeout_s=%.1f s; otherwise a member holding the"
            " secret is impersonating it",
            self.codec.src, peer_id, why, self.config.failure_timeout_s,
        )  # fmt: skip
