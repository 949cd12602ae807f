"""What a phase of a round needs from the engine that runs it: :class:`PhaseContext`.

Why a Protocol: the phases (:mod:`.scatter`, :mod:`.gather`, :mod:`.parity`,
:mod:`.repair`, :mod:`.layout`) are functions over an engine and a round; naming
the engine's class would make every phase import the engine that imports them
(an import circle), and let them reach into its private state.  This is the
whole surface they use: the node to send on and read the clock and config
from, the engine's packet kinds, its drop counters, its loss policy, the
learned phase spans, how many END copies a round sends, the reorder lesson of
a packet that came after its END, and the layouts peers announced.  It imports
nothing of the phases; :class:`~.engine.LossyAllReduce` satisfies it.
"""

from __future__ import annotations

import collections
from typing import Literal, Protocol

from gossipnet.collectives.lossy.loss_watch import LossWatch
from gossipnet.collectives.lossy.packets import EngineKinds
from gossipnet.collectives.lossy.round import Round
from gossipnet.runtime.node import Node
from gossipnet.transport.wire import Packet

__all__ = ("PhaseContext", "PhaseName")

#: The two phases of a round: reduce-scatter and all-gather.
PhaseName = Literal["rs", "ag"]


class PhaseContext(Protocol):
    """The engine as its phases see it (all on the loop thread)."""

    @property
    def node(self) -> Node:
        """The node: sending, the clock, the config, membership."""
        ...

    @property
    def k(self) -> EngineKinds:
        """The packet kinds this engine owns."""
        ...

    @property
    def dropped(self) -> collections.Counter[str]:
        """Packets dropped, by reason (a phase adds its own reasons)."""
        ...

    @property
    def loss(self) -> LossWatch:
        """Recent loss, ours and our peers': the flag our ENDs carry."""
        ...

    @property
    def peer_layouts(self) -> dict[str, tuple[int, str]]:
        """Each peer's announced layout: (fingerprint, description)."""
        ...

    def spans(self, phase: PhaseName) -> collections.deque[float]:
        """Recent complete senders' spans of ``phase``, seconds per packet (learned cut times)."""
        ...

    def end_copies(self, rnd: Round) -> int:
        """END copies our phases of ``rnd`` send (0 on a quiet network)."""
        ...

    def note_after_end(self, rnd: Round, pkt: Packet) -> None:
        """``pkt``, a data packet of ``rnd``, may follow its sender's END: learn the lag."""
        ...

    def note_stall(self, rnd: Round, pkt: Packet) -> None:
        """``pkt``, a data packet of ``rnd``, came after its phase cut its sender: learn how
        long the sender was quiet (:class:`.cut.StallWindow`)."""
        ...

    def quiet_wait(self, rnd: Round) -> float:
        """The learned silence before a phase of ``rnd`` cuts a sender (0: the default)."""
        ...
