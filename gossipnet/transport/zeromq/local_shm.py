"""Large payloads to same-host peers through shared memory instead of the socket.

Why: over the loop-served stream (``local_stream.py``) a payload is copied into
the kernel by ``sendmsg`` and out again by the receiver's ``recv_into``; the
receiver then adds it into its accumulator or copies it into its result, a
third pass.  gloo pays the same two socket copies, so at 1M-25M float32 over
four processes on one host these copies decide the all-reduce's time.  Here
the sender copies a large payload once into a slot of a memory segment that
its receivers have mapped, and the stream carries only a 16-byte descriptor;
the receiver reads the payload where it lies.  One copy instead of two, and
no payload bytes through the kernel.

Segments.  One per sending transport, shared by its stream connections (up to
:data:`READERS` of them; later connections get a fresh segment): a ``memfd``
the writer passes over each Unix socket itself (``SCM_RIGHTS``, in a ``SEG``
record before any other, with the connection's reader index), so no file name
is ever visible and only processes the streams' credentials admitted map it.
Layout: a 4 KiB header of :data:`SLOTS` x :data:`READERS` state bytes (one row
per slot, one column per connection), then :data:`SLOTS` slots of
:data:`SLOT_BYTES`.  Pages are allocated by the kernel only where a payload
was written; the allocator hands out the lowest free slot, so what a run
touches is its peak number of payloads in flight, not the segment's size.
Why shared: a packet sent to several same-host peers (an all-gather's
broadcast) is copied into one slot once and named to each of them.

Slot life. The writer copies the payload into a slot whose row is all free (0),
sets the receiving connection's state byte to the slot's generation (1-255,
never 0) and sends the descriptor ``(slot, length, generation)``; the same
frozen frame sent next to another connection takes the same slot (its byte is
set too), not another copy. The receiver checks the descriptor against the
segment (slot in range, length within a slot, its own state byte equal to the
generation, not taken already: anything else is counted in ``dropped_malformed``
and the packet dropped) and delivers a view of the slot. Its byte is cleared
when the last view of that payload is gone: a ``weakref.finalize`` on the array
that owns the view, so a handler that keeps the payload (a buffered early
packet, a parity group's frames) keeps the slot, and nothing the writer does
later can change bytes a receiver still reads. A slot is reused only once every
byte of its row is clear. A writer that finds no free slot sends that payload
inline on the stream as before; a receiver that dies leaves its bytes set, so a
connection's column is never handed to another.

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

from gossipnet.transport.base import Buffer, is_frozen

__all__ = (
    "DESC",
    "DESC_FRAME",
    "READERS",
    "SEG",
    "SEG_VERSION",
    "SHM_MIN_BYTES",
    "SLOTS",
    "SLOT_BYTES",
    "ShmReader",
    "ShmWriter",
    "available",
)

#: Slots per segment: 128 MiB with :data:`SLOT_BYTES`, shared by a sender's
#: connections; a 25M float32 round over four peers has about 12 in flight.
SLOTS = 32
#: Connections one segment serves (state bytes per slot); the next gets a new segment.
READERS = 16
#: Bytes per slot: the largest chunk the ZeroMQ backend makes (``max_chunk_bytes``).
SLOT_BYTES = 4 * 1024 * 1024
#: Payload frames from this size go through a slot; smaller ones stay on the
#: stream, where one ``sendmsg`` costs less than a slot's bookkeeping.
SHM_MIN_BYTES = 64 * 1024
#: ``(slot, length, generation)``: what the stream carries instead of the payload.
DESC = struct.Struct("<IIQ")
#: What a segment's first record carries: the format version and the reader's index.
SEG = struct.Struct("<II")
SEG_VERSION = 2
#: A descriptor on the stream: the packet's frame it stands for, then :data:`DESC`.
DESC_FRAME = struct.Struct("<I" + DESC.format.lstrip("<"))
_HEADER = 4096  # the state bytes, page-aligned so that slots are too
_FREE_ROW = bytes(READERS)


def available() -> bool:
    """Whether this platform has ``memfd_create`` and fd passing (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(mmap, "MAP_SHARED")


def _size() -> int:
    return _HEADER + SLOTS * SLOT_BYTES


class ShmWriter:
    """The sending side of one segment: hands out reader columns, allocates slots,
    copies payloads in.  Closed once its last connection detaches."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("gossipnet-stream", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(self.fd, _size())  # sparse: pages appear where written
            self._mm = mmap.mmap(self.fd, _size(), mmap.MAP_SHARED)
        except OSError:
            os.close(self.fd)
            raise
        self._gens = [0] * SLOTS
        self._gen = 0
        self._last: object = None  # the frozen frame last copied in, and its slot
        self._last_slot = -1
        self._next_reader = 0
        self.attached = 0
        self.closed = False
        self.full = 0  # payloads sent inline because every slot was busy
        self.shared = 0  # payloads named to another reader without a copy

    @property
    def exhausted(self) -> bool:
        """Every reader column was handed out (columns are never reused)."""
        return self._next_reader >= READERS

    def attach(self) -> int | None:
        """A column for one more connection, or None when the segment has none left."""
        if self.exhausted or self.closed:
            return None
        self._next_reader += 1
        self.attached += 1
        return self._next_reader - 1

    def detach(self) -> None:
        """A connection closed (its column stays retired); the last one closes us if
        no new connection can attach."""
        self.attached -= 1
        if self.attached <= 0 and self.exhausted:
            self.close()

    def put(self, payload: Buffer, reader: int) -> bytes | None:
        """Copy ``payload`` into a free slot for ``reader`` (or name the slot the same
        frozen frame went to just before); its descriptor, or None (send it inline)."""
        view = memoryview(payload).cast("B")
        n = view.nbytes
        if n > SLOT_BYTES or self.closed:
            return None
        mm = self._mm
        slot = self._last_slot
        if payload is self._last and mm[slot * READERS + reader] == 0:
            mm[slot * READERS + reader] = self._gens[slot]
            self.shared += 1
            return DESC.pack(slot, n, self._gens[slot])
        slot = _free_slot(mm)
        if slot < 0:
            self.full += 1
            return None
        self._gen = self._gen % 255 + 1
        self._gens[slot] = self._gen
        mm[slot * READERS + reader] = self._gen  # busy before the descriptor can exist
        start = _HEADER + slot * SLOT_BYTES
        mm[start : start + n] = view
        if is_frozen(payload):  # unchanged while queued: may be named to the next reader
            self._last, self._last_slot = payload, slot
        else:
            self._last, self._last_slot = None, -1
        return DESC.pack(slot, n, self._gen)

    def unput(self, desc: bytes, reader: int) -> None:
        """The packet ``desc`` names never left for ``reader`` (dropped by a full queue or
        a failed send): give its slot back, as the receiver would have."""
        slot, _, gen = DESC.unpack(desc)
        state = slot * READERS + reader
        if not self.closed and self._mm[state] == gen:
            self._mm[state] = 0

    def close(self) -> None:
        """Unmap and close our descriptor; receivers' mappings stay valid."""
        if self.closed:
            return
        self.closed = True
        self._last = None
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _free_slot(mm: mmap.mmap) -> int:
    """The lowest slot whose state row is all clear, or -1."""
    pos, end = 0, SLOTS * READERS
    while True:
        pos = mm.find(_FREE_ROW, pos, end)
        if pos < 0:
            return -1
        if pos % READERS == 0:
            return pos // READERS
        pos = (pos // READERS + 1) * READERS  # a match across two rows: not a row


class ShmReader:
    """The receiving side: resolves descriptors to views of the writer's slots.

    Args:
        fd: the segment's descriptor as received over the stream; owned (closed
            here once mapped).
        reader: this connection's column in the segment's state rows.

    Raises:
        OSError: the descriptor is not a segment of the expected size.
        ValueError: ``reader`` is not a column.
    """

    def __init__(self, fd: int, reader: int) -> None:
        try:
            if not 0 <= reader < READERS:
                raise ValueError(f"reader index {reader} out of range")
            if os.fstat(fd).st_size != _size():
                raise OSError("shared segment of the wrong size")
            self._mm = mmap.mmap(fd, _size(), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.reader = reader
        self._held: set[int] = set()  # state bytes of payloads delivered, not yet freed

    def take(self, desc: memoryview) -> memoryview | None:
        """The payload ``desc`` names, as a view freed when its last user drops it;
        None for a descriptor that does not match the segment (count it, drop it)."""
        if desc.nbytes != DESC.size:
            return None
        slot, n, gen = DESC.unpack(desc)
        mm = self._mm
        if slot >= SLOTS or n > SLOT_BYTES or not 1 <= gen <= 255:
            return None
        state = slot * READERS + self.reader
        if mm[state] != gen or state in self._held:  # not ours, or already taken
            return None
        self._held.add(state)
        arr = np.frombuffer(mm, dtype=np.uint8, count=n, offset=_HEADER + slot * SLOT_BYTES)
        weakref.finalize(arr, _release, mm, self._held, state, gen)
        return arr.data


def _release(mm: mmap.mmap, held: set[int], state: int, gen: int) -> None:
    """Clear our state byte of a slot (only if it still marks the payload we took)."""
    held.discard(state)
    with contextlib.suppress(ValueError):  # unmapped: the run is over
        if mm[state] == gen:
            mm[state] = 0
