"""The loss-tolerant all-reduce (ALGORITHMS.md section 1): reduce-scatter + all-gather
over lossy packets, with cut times, parity, NACK repair and stale steps.

Weintraub, Banner & Orda, *Distributed Training under Packet Loss* (2025):
every peer owns a contiguous shard of each flat bucket (``ShardMap``).  In
the reduce-scatter each peer sends every chunk it does not own to the
chunk's owner, once, never retransmitted.  The owner averages, per chunk,
the contributions that arrived, weighting each by the sender's weight and
dividing by the weights that arrived (its own always counts), so under
random loss the estimate is unbiased; dividing by N instead would be
biased low by about (1 - p).  It adds them in a fixed order (its own, then
the others' in the round's order), never in arrival order: the same inputs
give the same bits on every run (:mod:`.reducer`).  In the all-gather each owner sends its
averaged chunks to everyone; a peer that misses one keeps its own value
for it (stale, never zero) and the report counts it.

Why phases end early: after its data every sender sends a tiny END marker
(``END_COPIES`` copies, so all are lost with probability p^5) that says how
many packets it sent.  A phase ends the moment every expected END arrived,
so time per round does not grow with the loss rate.  An END that overtook
data it declares (a reordering network) holds its sender a little longer,
but only while packets have recently been seen to arrive after their END
(``.cut.ReorderWindow``, learned from arrival times): pure loss teaches no
such wait, since lost packets never arrive.  A deadline learned
from the spans of recent complete phases (``phase_deadline_factor`` x the
median span), capped by the call's timeout, bounds a phase when ENDs or a
whole peer are lost.  Where no loss has been seen for ``QUIET_ROUNDS``
rounds, by us or by any peer (a flag on its END markers and heartbeats), no
END goes out (one where an all-gather withheld chunks): a sender whose data all
arrived is complete without its END, and at 1M elements ENDs were half of all
packets sent.

Redundancy (``Config.redundancy`` = k > 1): every data packet goes out k
times, the copies trailing the originals by a few hundred packets, so a chunk
is lost only if all copies are (about p^k under random loss).  It is
proactive, never a retransmission: no one waits, the traffic is k-fold.
Parity (``Config.parity_group`` = k > 0, :mod:`.parity`): one XOR packet per
k data packets recovers any one lost packet of its group, at 1/k the traffic;
the lossy optimizer turns it on by default (``Config.parity_for``).

Rounds: a caller that knows what its round is passes its id (the optimizer:
a function of the training step, :mod:`.round_id`), so peers pair rounds by
what they are, never by how many calls each made.  Plain calls (no id) take
the larger of our own next round and the highest one that more than half of
the peers that recently took part with us claim (data packets, heartbeat
beacons), a claim counting at most ``ROUND_WINDOW`` past our own round
(:mod:`.claims`): a restarted or late peer catches up in one call, and no one
peer's word moves the others, nor can any packet bring ids near the end of
their range.  Every data and END packet carries the round id, its mode and a
layout fingerprint: a packet of another mode or layout is never mixed in
(counted; a layout that differs raises ``LayoutMismatchError`` after the
round).  Packets for a round we have not started yet are buffered (bounded);
older ones are dropped and counted as late.  Round ids and modes from headers
are range-checked before use (``.round_id.valid_round``).

Where to read (each module owns one thing; imports go down this list):

- :mod:`.engine` ``LossyAllReduce``: state across rounds, the round driver, packet intake.
- :mod:`.options` ``RoundOptions``: what one round is asked to do.
- :mod:`.context` ``PhaseContext``: what the phases need of the engine (a Protocol).
- :mod:`.scatter` the reduce-scatter; its arithmetic, :mod:`.reducer`, has no I/O.
- :mod:`.gather` the all-gather; :mod:`.cut` when a phase ends.
- :mod:`.parity` XOR parity, :mod:`.repair` NACK repair for resyncs,
  :mod:`.stale_step` estimated steps for lost broadcasts.
- :mod:`.round` one round's bookkeeping, :mod:`.packets` per-packet pieces and
  ``EngineKinds``, :mod:`.round_id` and :mod:`.layout` what a round is,
  :mod:`.claims` whose word about round ids counts, :mod:`.loss_watch` what
  recent loss makes us spend, :mod:`.kinds` packet kinds.
"""
