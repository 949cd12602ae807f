"""Moshpit's knobs, a frozen value both the averager and its matchmaking read.

Its own module so that :mod:`.match` (the matchmaking state machine) and
:mod:`.averager` (which builds on it) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("MoshpitConfig",)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoshpitConfig:
    """Moshpit knobs (seconds in ``_s`` names).

    max_group_size: largest group M; the grid is chosen from the live peer count.
    min_fill: smallest acceptable grid fill (ALGORITHMS.md 2.3, 2.6).
    grid: force ``(M, d)`` instead (tests, benches); more peers than M^d raises.
    matchmaking_timeout_s: bound of group assembly in one round; also how much
        compute skew between peers a round absorbs (hivemind: 5-15 s).
    join_min_wait_s / join_wait_factor: a leader waits for missing members
        ``max(min, factor x median join spread)`` after the first one joined.
    ack_timeout_s: a leader whose node does not acknowledge a JOIN within this
        long is presumed gone and the next-ranked member takes over.
    reply_margin_s: time allowed for the member list to reach a member.
    round_timeout_s: bound of a group's all-reduce (None: ``Config.collective_timeout_s``).
    """

    max_group_size: int = 32
    min_fill: float = 0.75
    grid: tuple[int, int] | None = None
    matchmaking_timeout_s: float = 5.0
    join_min_wait_s: float = 0.1
    join_wait_factor: float = 3.0
    reply_margin_s: float = 0.1
    ack_timeout_s: float = 0.5
    round_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_group_size < 2 or not 0 < self.min_fill <= 1:
            raise ValueError("max_group_size must be >= 2 and min_fill in (0, 1]")
        if self.grid is not None and (self.grid[0] < 1 or self.grid[1] < 1):
            raise ValueError(f"grid must be (side >= 1, dims >= 1), got {self.grid}")
        for name in ("matchmaking_timeout_s", "join_wait_factor", "ack_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoshpitConfig.{name} must be > 0")
        if self.join_min_wait_s < 0 or self.reply_margin_s < 0:
            raise ValueError("join_min_wait_s and reply_margin_s must be >= 0")
        if self.round_timeout_s is not None and not self.round_timeout_s > 0:
            raise ValueError("round_timeout_s must be > 0 or None")
