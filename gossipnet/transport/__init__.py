"""Packet transports and the factory that picks one by URL scheme.

Layer 1 of 5 (transport, runtime, collectives, training, facade): it knows no
collective.  Backends are imported lazily by :func:`create_transport`, so
importing ``gossipnet.transport`` costs no ZeroMQ or torch import and the
in-memory test network works where pyzmq is absent.
"""

from __future__ import annotations

from gossipnet.transport.address import (
    BACKENDS,
    SCHEMES,
    WILDCARD_HOSTS,
    check_peer_address,
    join_host_port,
    split_address,
    split_host_port,
)
from gossipnet.transport.base import Buffer, PacketHandler, Transport, TransportStats
from gossipnet.transport.factory import create_transport

__all__ = (
    "BACKENDS",
    "SCHEMES",
    "WILDCARD_HOSTS",
    "Buffer",
    "PacketHandler",
    "Transport",
    "TransportStats",
    "check_peer_address",
    "create_transport",
    "join_host_port",
    "split_address",
    "split_host_port",
)
