"""When a round hears another tensor layout: stop waiting for that peer, then raise.

Split from :mod:`.round_id` (what a layout is) because this half acts on a
round and the engine (drop counters, the layouts peers announced): a packet of
our round with another layout fingerprint is never mixed in, its sender leaves
the round's expectations, and once the round is over
:class:`~gossipnet.errors.LayoutMismatchError` names both layouts.
"""

from __future__ import annotations

from gossipnet.collectives.lossy.context import PhaseContext
from gossipnet.collectives.lossy.round import Round
from gossipnet.collectives.lossy.round_id import layout_error
from gossipnet.errors import LayoutMismatchError
from gossipnet.transport.wire import Packet

__all__ = ("layout_conflict", "layout_failure")


def layout_conflict(ctx: PhaseContext, rnd: Round, pkt: Packet, layout: int) -> None:
    """A member's packet for our round carries another layout: never mix it in;
    stop waiting for that member, and raise once the round is over."""
    ctx.dropped["layout_mismatch"] += 1
    if pkt.src in rnd.layout_conflicts:
        return
    rnd.layout_conflicts[pkt.src] = layout
    for phase in (rnd.rs, rnd.ag):
        phase.expected.discard(pkt.src)
        phase.wake.set()


async def layout_failure(ctx: PhaseContext, rnd: Round) -> LayoutMismatchError:
    """The error naming each conflicting peer's layout, once its heartbeat said it
    (waiting at most two heartbeat intervals; else its fingerprint)."""
    node = ctx.node
    deadline = node.clock.now() + 2 * node.config.heartbeat_interval_s

    def theirs() -> dict[str, str]:
        out = {}
        for p, fp in rnd.layout_conflicts.items():
            known = ctx.peer_layouts.get(p)
            out[p] = known[1] if known and known[0] == fp else ""
        return out

    while not all(theirs().values()) and node.clock.now() < deadline:
        await node.clock.sleep(node.config.heartbeat_interval_s / 4)
    named = {p: d or f"fingerprint {rnd.layout_conflicts[p]:#010x}" for p, d in theirs().items()}
    return layout_error(node.peer_id, rnd.layout_desc, named)
