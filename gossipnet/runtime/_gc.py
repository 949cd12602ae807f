"""Python's cyclic garbage collector, set for a process that moves packets.

Why a higher young-generation threshold: the packet path allocates a few
container objects per packet (frame lists, memoryviews, decoded packets), most
freed by reference counting within the drain that made them.  At CPython's
default (a collection every 700 net container allocations) one starts every
couple of hundred packets, walks every object still in flight and promotes it,
and those promotions bring on full collections over everything allocated since
``join``.  Measured (``bench/packet_path.py``'s rounds: 4 in-process nodes,
4M float32, 21 rounds): 2055 collections took 0.69 s, 8-9% of the CPU; at
10 000, 21 collections took 0.04 s and a packet's CPU fell from 30.5-34.5 to
28.7-29.2 us.  ``bench/testbed.py`` (4 hosts on 2 cores, a 17 MB step at 0%
loss): the step's loop CPU fell from 0.163-0.170 to 0.158 s and its time from
0.395-0.434 to 0.371-0.379 s.

Why ``gc.freeze()`` (``Config.gc_freeze``): with torch loaded a full collection
walked every object made before ``join`` and paused the process 0.15-0.29 s
mid-round on 2 cores; frozen, they are never walked (still freed by reference
counting; only cycles among them that become garbage later stay).

What the threshold costs: reference cycles that become garbage wait for up to
that many container allocations before they are found; nothing reference
counting frees is delayed.  Both settings are process-wide, so they are applied
at ``join``, never lower a threshold already set higher (by the user, or by a
newer Python's default), and ``Config.gc_threshold=None`` /
``Config.gc_freeze=False`` leave the collector alone.
"""

from __future__ import annotations

import gc
import logging

__all__ = ("tune_gc",)

_log = logging.getLogger(__name__)


def tune_gc(threshold: int | None, freeze: bool) -> None:
    """Raise the young generation's threshold to ``threshold`` (None: leave it) and
    freeze what the collector tracks now (when ``freeze``)."""
    if threshold is not None:
        first, *older = gc.get_threshold()
        if 0 < first < threshold:  # 0: the user turned automatic collection off
            gc.set_threshold(threshold, *older)
            _log.debug("gc young-generation threshold %d -> %d", first, threshold)
    if freeze:
        gc.freeze()  # no full-collection pauses mid-round over what exists now
