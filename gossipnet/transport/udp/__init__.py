"""UDP backend: one datagram per packet, paced by a token bucket."""

from gossipnet.transport.udp.backend import UdpTransport

__all__ = ("UdpTransport",)
