"""Exception hierarchy.

Network failure is data (a :class:`~gossipnet.rounds.CollectiveReport` that
names who was cut), not an exception: training goes on with what arrived.
Exceptions are for misuse and for states the caller must act on, and every
message says what to do next.
"""

from __future__ import annotations

__all__ = (
    "ClosedError",
    "ConfigError",
    "GossipError",
    "LayoutMismatchError",
    "ReplicaDivergedError",
    "PeerUnreachable",
    "ProtocolError",
    "TopologyError",
)


class GossipError(Exception):
    """Base class of every error gossipnet raises on purpose."""


class ConfigError(GossipError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class TopologyError(ConfigError):
    """GPU topology text (``nvidia-smi topo -m``, ``nvlink -s``) could not be parsed.

    A subclass of :class:`ConfigError` (and so of ``ValueError``): a topology is
    configuration the caller handed in or the driver printed, and the fix is the same,
    pass a correct one or let ``detect()`` read it.
    """


class ClosedError(GossipError):
    """The peer (or its transport) was closed; create a new one with ``join()``."""


class PeerUnreachable(GossipError):
    """A control message got no acknowledgement before its deadline."""


class ProtocolError(GossipError):
    """A packet or message violates the wire format; it is dropped and counted."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class LayoutMismatchError(ConfigError):
    """Peers passed tensors of different layouts (dtypes, lengths) to one collective.

    Raised by the first collective that hears such a peer: its chunks would be
    averaged into the wrong elements.  The message names the peers and both layouts;
    make every peer build the same model and pass its tensors in the same order.
    """


class ReplicaDivergedError(GossipError):
    """This peer's replica disagrees with the others' and could not be repaired.

    Raised where a caller asked to fail instead of training on (the demo does);
    the optimizer itself repairs by downloading the others' state and only reports.
    """
