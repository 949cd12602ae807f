"""Key exchange for codecs built by hand (tests, benchmarks, attack probes).

A running node binds its peers' keys through introductions
(:mod:`gossipnet.runtime.admission`); two :class:`~gossipnet.transport.wire.WireCodec`
objects made directly know nothing of each other, so every pairwise packet between
them would be dropped as ``unknown_key``.  :func:`introduce` binds each to every other,
as a completed handshake would.
"""

from __future__ import annotations

import itertools

from gossipnet.transport.wire import WireCodec

__all__ = ("introduce",)


def introduce(*codecs: WireCodec) -> None:
    """Bind every codec of ``codecs`` to every other's public key (both directions)."""
    for a, b in itertools.permutations(codecs, 2):
        a.bind(b.src, b.epoch, b.identity.public)
