"""The factory that picks a transport backend by URL scheme.

Backends are imported lazily, so importing ``gossipnet.transport`` costs no
ZeroMQ or torch import and the in-memory test network works where pyzmq is absent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gossipnet.clock import Clock
from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.transport.address import SCHEMES, split_address
from gossipnet.transport.base import Transport

if TYPE_CHECKING:
    from gossipnet.transport.memory import MemoryNetwork


def create_transport(
    listen: str,
    config: Config,
    *,
    clock: Clock | None = None,
    faults: Any = None,
    network: MemoryNetwork | None = None,
    advertise_host: str | None = None,
) -> Transport:
    """The backend serving ``listen``'s scheme, wrapped in a fault plan if one is given.

    ``tcp|ipc|inproc`` -> ZeroMQ, ``udp`` -> plain datagrams, ``mem`` -> the
    in-process :class:`~gossipnet.transport.memory.MemoryNetwork`.

    Args:
        listen: own address, e.g. ``"tcp://0.0.0.0:7000"``; port 0 binds a free one.
        config: reads the transport fields (queue sizes, socket buffers, limits).
        clock: time source for fault timers and ``connect`` deadlines.
        faults: a :class:`~gossipnet.transport.faults.FaultPlan`, or None.
        network: the hub ``mem://`` addresses live on (required for ``mem``).
        advertise_host: host peers should use when ``listen`` binds a wildcard
            (``0.0.0.0``); without it a wildcard is advertised as ``127.0.0.1``.

    Raises:
        ConfigError: unknown scheme, or ``mem://`` without a network.
    """
    scheme, _ = split_address(listen)
    inner: Transport
    if scheme in ("tcp", "ipc", "inproc"):
        from gossipnet.transport.zeromq.backend import ZmqTransport

        inner = ZmqTransport(config, listen, clock=clock, advertise_host=advertise_host)
    elif scheme == "udp":
        from gossipnet.transport.udp.backend import UdpTransport

        inner = UdpTransport(config, listen, clock=clock, advertise_host=advertise_host)
    elif scheme == "mem":
        if network is None:
            raise ConfigError(
                "a mem:// address needs network=gossipnet.testing.MemoryNetwork() "
                "shared by the peers that should reach each other"
            )
        from gossipnet.transport.memory import MemoryTransport

        inner = MemoryTransport(network, listen)
    else:
        raise ConfigError(
            f"unknown transport scheme {scheme!r} in {listen!r}; supported: "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    if faults is None:
        return inner
    from gossipnet.clock import MonotonicClock
    from gossipnet.transport.faults import FaultyTransport

    return FaultyTransport(inner, faults, clock or MonotonicClock())
