"""ZeroMQ backend: UDP semantics over tcp/ipc/inproc, with a same-host Unix-socket shortcut."""

from gossipnet.transport.zeromq.backend import ZmqTransport

__all__ = ("ZmqTransport",)
