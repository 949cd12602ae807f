"""Exception hierarchy.

Network failure is data (a :class:`~gossipnet.reports.CollectiveReport` that
names who was cut), not an exception: training goes on with what arrived.
Exceptions are for misuse and for states the caller must act on, and every
message says what to do next.
"""

from __future__ import annotations

__all__ = (
    "ClosedError",
    "ConfigError",
    "GossipError",
    "JoinError",
    "LayoutMismatchError",
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


class JoinError(GossipError):
    """``join()`` did not find enough peers alive within ``Config.join_timeout_s``.

    The message names the addresses that never answered and those whose packets
    failed authentication (a different secret, run id or MAC?), and what to do.
    The peer was closed before this was raised.

    Attributes:
        alive: ids of the peers alive at the deadline, this one included.
        missing: bootstrap addresses no alive peer answered from.
        unauthenticated: addresses (or claimed peer ids) whose packets failed
            authentication; what those packets claimed is unverified.
    """

    def __init__(
        self,
        message: str,
        *,
        alive: tuple[str, ...] = (),
        missing: tuple[str, ...] = (),
        unauthenticated: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.alive = alive
        self.missing = missing
        self.unauthenticated = unauthenticated


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
