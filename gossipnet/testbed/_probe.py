"""Traffic helpers that run inside testbed hosts: a paced UDP source and a sink.

Standard library only and no relative imports, on purpose: the runner loads
this file on its own (``standalone``), so a loss probe starts in milliseconds
instead of importing gossipnet and torch.

Why paced: an unpaced burst of thousands of datagrams overflows the sink's
receive buffer, and those drops (counted in ``Udp: RcvbufErrors``) are not the
wire loss being measured.
"""

from __future__ import annotations

import os
import socket
import struct
import time

_SEQ = struct.Struct("!I")
_BUF_BYTES = 4 * 1024 * 1024


def _wait_file(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.005)


def udp_sink(
    bind_ip: str,
    port: int,
    ready_path: str,
    done_path: str,
    expect: int,
    idle_s: float = 0.3,
    deadline_s: float = 30.0,
) -> dict[str, int]:
    """Count distinct sequence numbers received on ``bind_ip:port``.

    Creates ``ready_path`` once bound, so the source never sends into a
    closed port.  Stops when ``expect`` distinct packets arrived, when
    ``done_path`` exists (the source finished) and nothing arrived for
    ``idle_s`` (the rest were lost), or at ``deadline_s``.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUF_BYTES)
    sock.bind((bind_ip, port))
    with open(ready_path, "w"):
        pass
    seen: set[int] = set()
    received = 0
    t_end = time.monotonic() + deadline_s
    sock.settimeout(0.02)
    last = 0.0
    done_at: float | None = None
    while len(seen) < expect:
        now = time.monotonic()
        if now > t_end:
            break
        if done_at is None and os.path.exists(done_path):
            done_at = now
        if done_at is not None and now - max(last, done_at) > idle_s:
            break
        try:
            data = sock.recv(65535)
        except TimeoutError:
            continue
        last = time.monotonic()
        received += 1
        if len(data) >= _SEQ.size:
            seen.add(_SEQ.unpack_from(data)[0])
    sock.close()
    return {"received": received, "distinct": len(seen)}


def udp_source(
    dst_ip: str,
    port: int,
    ready_path: str,
    count: int,
    size: int = 1000,
    rate_pps: float = 20000.0,
    ready_timeout_s: float = 15.0,
) -> dict[str, float]:
    """Send ``count`` datagrams of ``size`` bytes, numbered, at ``rate_pps``."""
    _wait_file(ready_path, ready_timeout_s)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUF_BYTES)
    pad = b"\0" * max(0, size - _SEQ.size)
    t0 = time.monotonic()
    errors = 0
    for i in range(count):
        due = t0 + i / rate_pps
        delay = due - time.monotonic()
        if delay > 0.001:
            time.sleep(delay)
        try:
            sock.sendto(_SEQ.pack(i) + pad, (dst_ip, port))
        except OSError:
            errors += 1
    sock.close()
    return {"sent": count - errors, "errors": errors, "seconds": time.monotonic() - t0}


def tcp_sink(
    bind_ip: str, port: int, ready_path: str, deadline_s: float = 30.0
) -> dict[str, float]:
    """Accept one TCP connection and read it to the end; bytes and seconds."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind_ip, port))
    srv.listen(1)
    srv.settimeout(deadline_s)
    with open(ready_path, "w"):
        pass
    conn, _ = srv.accept()
    conn.settimeout(deadline_s)
    total = 0
    t0 = None
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        if t0 is None:
            t0 = time.monotonic()
        total += len(data)
    seconds = time.monotonic() - (t0 or time.monotonic())
    conn.close()
    srv.close()
    return {"bytes": total, "seconds": seconds}


def tcp_source(
    dst_ip: str, port: int, ready_path: str, nbytes: int, ready_timeout_s: float = 15.0
) -> dict[str, float]:
    """Connect and send ``nbytes`` as fast as TCP allows."""
    _wait_file(ready_path, ready_timeout_s)
    sock = socket.create_connection((dst_ip, port), timeout=30.0)
    block = b"\0" * 65536
    t0 = time.monotonic()
    left = nbytes
    while left > 0:
        sock.sendall(block[: min(left, len(block))])
        left -= min(left, len(block))
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # wait for the sink to close: everything was delivered
    sock.close()
    return {"bytes": nbytes, "seconds": time.monotonic() - t0}
