"""Large payloads to same-host peers through shared memory instead of the socket.

Why: over the loop-served stream (``local_stream.py``) a payload is copied into
the kernel by ``sendmsg`` and out again by the receiver's ``recv_into``; the
receiver then adds it into its accumulator or copies it into its result, a
third pass.  gloo pays the same two socket copies, so at 1M-25M float32 over
four processes on one host these copies decide the all-reduce's time.  Here
the sender copies a large payload once into a slot of a memory segment that
its receiver has mapped, and the stream carries only a 16-byte descriptor;
the receiver reads the payload where it lies.  One copy instead of two, and
no payload bytes through the kernel.

Segments.  One per stream connection (sender -> receiver): a ``memfd`` the
writer creates when it connects and passes over the Unix socket itself
(``SCM_RIGHTS``, in a ``SEG`` record before any other), so no file name is
ever visible and only the process the stream's credentials admitted maps it.
Layout: a 4 KiB header of :data:`SLOTS` state bytes, then :data:`SLOTS` slots
of :data:`SLOT_BYTES`.  Pages are allocated by the kernel only where a payload
was written; the allocator hands out the lowest free slot, so what a run
touches is its peak number of payloads in flight, not the segment's size.

Slot life.  The writer marks a slot busy (its state byte: the slot's
generation, 1-255, never 0), copies the payload in and sends the descriptor
``(slot, length, generation)``.  The receiver checks the descriptor against
the segment (slot in range, length within a slot, state byte equal to the
generation: anything else is counted in ``dropped_malformed`` and the packet
dropped) and delivers a view of the slot.  The slot is freed (state 0) when
the last view of it is gone: a ``weakref.finalize`` on the array that owns
the view, so a handler that keeps the payload (a buffered early packet, a
parity group's frames) keeps the slot, and nothing the writer does later can
change bytes a receiver still reads.  A writer that finds no free slot sends
that payload inline on the stream as before; a receiver that dies leaves its
writer's slots busy, and its stream breaks anyway.

Who can write a segment: this user's processes, as for the stream and the
ZeroMQ alias (:class:`~gossipnet.transport.base.LocalFrames`, no payload MAC).
Ordering: the writer's copy happens before the ``sendmsg`` of the descriptor
and the receiver's reads after its ``recv``, each a system call; the
receiver's release is a byte store after its last read of the slot, which
x86's ordering keeps behind those reads.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import weakref

import numpy as np

from gossipnet.transport.base import Buffer

__all__ = (
    "DESC",
    "DESC_FRAME",
    "SHM_MIN_BYTES",
    "SLOTS",
    "SLOT_BYTES",
    "ShmReader",
    "ShmWriter",
    "available",
)

#: Slots per segment: with :data:`SLOT_BYTES`, 64 MiB a stalled receiver can hold,
#: as much as a stream's user-space queue (``local_stream.MAX_QUEUED_BYTES``); a
#: 25M float32 round over four peers has about 4 of them in flight per connection.
SLOTS = 16
#: Bytes per slot: the largest chunk the ZeroMQ backend makes (``max_chunk_bytes``).
SLOT_BYTES = 4 * 1024 * 1024
#: Payload frames from this size go through a slot; smaller ones stay on the
#: stream, where one ``sendmsg`` costs less than a slot's bookkeeping.
SHM_MIN_BYTES = 64 * 1024
#: ``(slot, length, generation)``: what the stream carries instead of the payload.
DESC = struct.Struct("<IIQ")
#: A descriptor on the stream: the packet's frame it stands for, then :data:`DESC`.
DESC_FRAME = struct.Struct("<I" + DESC.format.lstrip("<"))
_HEADER = 4096  # the state bytes, page-aligned so that slots are too


def available() -> bool:
    """Whether this platform has ``memfd_create`` and fd passing (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(mmap, "MAP_SHARED")


def _size() -> int:
    return _HEADER + SLOTS * SLOT_BYTES


class ShmWriter:
    """The sending side of one segment: allocates slots, copies payloads in."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("gossipnet-stream", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(self.fd, _size())  # sparse: pages appear where written
            self._mm = mmap.mmap(self.fd, _size(), mmap.MAP_SHARED)
        except OSError:
            os.close(self.fd)
            raise
        self._gen = 0
        self.full = 0  # payloads sent inline because every slot was busy

    def put(self, payload: Buffer) -> bytes | None:
        """Copy ``payload`` into a free slot; its descriptor, or None (send it inline)."""
        view = memoryview(payload).cast("B")
        n = view.nbytes
        if n > SLOT_BYTES:
            return None
        mm = self._mm
        slot = mm.find(b"\x00", 0, SLOTS)
        if slot < 0:
            self.full += 1
            return None
        self._gen = self._gen % 255 + 1
        mm[slot] = self._gen  # busy before the descriptor can exist
        start = _HEADER + slot * SLOT_BYTES
        mm[start : start + n] = view
        return DESC.pack(slot, n, self._gen)

    def close(self) -> None:
        """Unmap and close our descriptor; a receiver's mapping stays valid."""
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class ShmReader:
    """The receiving side: resolves descriptors to views of the writer's slots.

    Args:
        fd: the segment's descriptor as received over the stream; owned (closed
            here once mapped).

    Raises:
        OSError: the descriptor is not a segment of the expected size.
    """

    def __init__(self, fd: int) -> None:
        try:
            if os.fstat(fd).st_size != _size():
                raise OSError("shared segment of the wrong size")
            self._mm = mmap.mmap(fd, _size(), mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def take(self, desc: memoryview) -> memoryview | None:
        """The payload ``desc`` names, as a view freed when its last user drops it;
        None for a descriptor that does not match the segment (count it, drop it)."""
        if desc.nbytes != DESC.size:
            return None
        slot, n, gen = DESC.unpack(desc)
        mm = self._mm
        if slot >= SLOTS or n > SLOT_BYTES or not 1 <= gen <= 255 or mm[slot] != gen:
            return None
        arr = np.frombuffer(mm, dtype=np.uint8, count=n, offset=_HEADER + slot * SLOT_BYTES)
        weakref.finalize(arr, _release, mm, slot, gen)
        return arr.data


def _release(mm: mmap.mmap, slot: int, gen: int) -> None:
    """Free ``slot`` for its writer (only if it still holds the payload we took)."""
    with contextlib.suppress(ValueError):  # unmapped: the run is over
        if mm[slot] == gen:
            mm[slot] = 0
