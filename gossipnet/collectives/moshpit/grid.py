"""Moshpit's virtual grid, shift-register keys and round plans: pure functions.

Ryabinin et al., *Moshpit SGD* (NeurIPS 2021); ALGORITHMS.md sections 2.1-2.3.
N peers sit on a d-dimensional grid of side M; in round t the peers that
share every coordinate but one form a group and average.  Nobody assigns
coordinates: a peer's *key* is a shift register of the last indices it
received (hivemind's ``key_manager.py``), and a group gives its members
distinct new indices from a permutation seeded by the group id, so peers
that met differ in the newest slot and next round meet along a new axis.

Why pure functions of ``(view, round)``: there is no DHT to publish keys in.
Every peer computes the whole round plan from its own membership view and
the round number, without a message; peers whose views agree derive the
same groups, and :mod:`gossipnet.collectives.moshpit.averager` confirms them with the
group's leader (which also settles views that disagree).  Registers restart
from a fresh cell assignment at every *sweep* (d rounds; the averager starts
one per call), so the plan never depends on history older than the sweep;
cells are placed by consistent hashing, so a peer missing from one view
moves few others.  With N = M^d
and no faults the d rounds of a sweep leave every peer with the exact mean.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = (
    "Grid",
    "GroupKey",
    "RoundPlan",
    "choose_grid",
    "group_id",
    "group_permutation",
    "initial_keys",
    "keys_at",
    "plan_round",
)


def _h(*parts: object) -> bytes:
    """A stable 16-byte hash (``hash()`` is salted per process; this is not)."""
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class Grid:
    """A virtual grid of ``side`` (M) cells along each of ``dims`` (d) axes."""

    side: int
    dims: int

    def __post_init__(self) -> None:
        if self.side < 1 or self.dims < 1:
            raise ValueError(f"a grid needs side >= 1 and dims >= 1, got {self}")

    @property
    def cells(self) -> int:
        return int(self.side**self.dims)

    @property
    def bits_per_index(self) -> int | None:
        """log2 M when M is a power of two (hivemind's key bits), else None."""
        return self.side.bit_length() - 1 if self.side & (self.side - 1) == 0 else None

    def fill(self, n: int) -> float:
        return n / self.cells


def choose_grid(n: int, *, max_group_size: int = 32, min_fill: float = 0.75) -> Grid:
    """Side and dimension for ``n`` peers (ALGORITHMS.md 2.3).

    The fewest dimensions (rounds to the exact mean) whose side fits
    ``max_group_size`` with the grid at least ``min_fill`` full (so groups are
    nearly complete, 2.6), a power-of-two side preferred at equal dimension:
    900 -> 32x32, 100 -> 10x10, 500 -> 23x23.  Why any side, where 2.3 keeps
    powers of two (500 -> 8x8x8): keys here never travel as bit strings, and
    one dimension less is one round less to the exact mean.  When nothing
    reaches ``min_fill`` the fullest grid wins; ``n <= max_group_size`` is one
    group of everyone (d = 1: a plain all-reduce).

    Raises:
        ValueError: ``n`` < 1, ``max_group_size`` < 2 or ``min_fill`` outside (0, 1].
    """
    if n < 1:
        raise ValueError(f"need at least one peer, got {n}")
    if max_group_size < 2:
        raise ValueError(f"max_group_size must be >= 2, got {max_group_size}")
    if not 0 < min_fill <= 1:
        raise ValueError(f"min_fill must be in (0, 1], got {min_fill}")
    if n <= max_group_size:
        return Grid(n, 1)  # one group of everyone: exact in one round
    candidates: list[tuple[Grid, bool]] = []
    for d in range(2, max(2, math.ceil(math.log2(n))) + 1):
        side = max(2, math.ceil(round(n ** (1 / d), 9)))
        while side**d < n:
            side += 1
        pow2 = 1 << (side - 1).bit_length()
        candidates += [(Grid(pow2, d), True), (Grid(side, d), False)]
    fits = [(g, p) for g, p in candidates if g.side <= max_group_size]
    good = [(g, p) for g, p in fits if g.fill(n) >= min_fill]
    if good:
        return min(good, key=lambda gp: (gp[0].dims, not gp[1], -gp[0].fill(n)))[0]
    return max((g for g, _ in fits), key=lambda g: (g.fill(n), -g.dims))


def group_id(seed: str, round_: int, key: Sequence[int]) -> bytes:
    """The id of the group holding ``key`` in round ``round_``: the same on every member."""
    return _h("gid", seed, round_, *key)


def group_permutation(gid: bytes, side: int) -> tuple[int, ...]:
    """A permutation of ``range(side)`` drawn from a generator seeded by ``gid``.

    Every member derives the identical permutation (``random.Random`` seeded by
    bytes is stable across processes and versions), so members that hold
    distinct positions receive distinct new indices without a message.
    """
    return tuple(random.Random(gid).sample(range(side), side))


@dataclass(frozen=True, slots=True)
class GroupKey:
    """A peer's shift register: ``slots[0]`` is its position in this round's group,
    ``slots[1:]`` (the last d - 1 indices it received) is the group key."""

    slots: tuple[int, ...]
    side: int

    @property
    def key(self) -> tuple[int, ...]:
        return self.slots[1:]

    @property
    def position(self) -> int:
        return self.slots[0]

    def bits(self) -> str:
        """hivemind's textual key, ``b`` bits per index (decimal digits if M is no power of 2)."""
        b = Grid(self.side, len(self.slots)).bits_per_index
        if b is None:
            return ".".join(map(str, self.key))
        return "".join(format(i, f"0{b}b") for i in self.key) if b else ""

    def advance(self, gid: bytes) -> GroupKey:
        """Drop the oldest slot, append this member's new index ``perm[position]``.

        Positions are distinct within a group (distinct cells), so the new
        indices are too, and the key keeps its length.
        """
        new = group_permutation(gid, self.side)[self.position]
        return GroupKey((*self.slots[1:], new), self.side)


def initial_keys(view: Sequence[str], grid: Grid, seed: str, sweep: int) -> dict[str, GroupKey]:
    """Distinct random cells for the peers of ``view`` at the start of ``sweep``.

    Consistent hashing (linear probing in hash order) rather than a shuffle of
    the sorted view: a view missing one peer moves only the peers whose probe
    passed that peer's cell, so disagreeing views still mostly agree on groups.

    Raises:
        ValueError: more peers than cells.
    """
    total = grid.cells
    if len(view) > total:
        raise ValueError(f"{len(view)} peers do not fit a {grid.side}^{grid.dims} grid")
    rank = {p: _h("cell", seed, sweep, p) for p in view}
    taken: set[int] = set()
    out: dict[str, GroupKey] = {}
    for p in sorted(view, key=rank.__getitem__):
        cell = int.from_bytes(rank[p][:8], "big") % total
        while cell in taken:
            cell = (cell + 1) % total
        taken.add(cell)
        coords = tuple((cell // grid.side**j) % grid.side for j in range(grid.dims))
        out[p] = GroupKey(coords, grid.side)
    return out


def keys_at(
    view: Sequence[str], grid: Grid, seed: str, round_: int, start: int | None = None
) -> dict[str, GroupKey]:
    """Every peer's register in ``round_``: fresh cells at the sweep's first round
    ``start`` (default: the multiple of d at or before ``round_``), advanced round by round."""
    if start is None:
        start = round_ - round_ % grid.dims
    if not 0 <= start <= round_:
        raise ValueError(f"sweep start {start} must be in [0, {round_}]")
    keys = initial_keys(view, grid, seed, start)
    for r in range(start, round_):
        keys = {p: k.advance(group_id(seed, r, k.key)) for p, k in keys.items()}
    return keys


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """The groups of one round as one view sees them.

    ``groups`` are sorted tuples of peer ids; ``leaders[i]`` leads ``groups[i]``:
    the member ranked first by a per-round hash, so the leading role (and its
    small extra work) rotates instead of falling on the smallest id.
    """

    round: int
    grid: Grid
    groups: tuple[tuple[str, ...], ...]
    leaders: tuple[str, ...]
    keys: dict[str, GroupKey]

    def group_of(self, peer: str) -> tuple[str, ...]:
        for g in self.groups:
            if peer in g:
                return g
        return (peer,)

    def leader_of(self, peer: str) -> str:
        for g, lead in zip(self.groups, self.leaders, strict=True):
            if peer in g:
                return lead
        return peer


def leader_rank(seed: str, round_: int, peer: str) -> bytes:
    """Order of peers for leading in ``round_`` (lower leads; also bounds redirects)."""
    return _h("lead", seed, round_, peer)


@functools.lru_cache(maxsize=256)
def _plan(
    view: tuple[str, ...], round_: int, seed: str, grid: Grid, start: int | None
) -> RoundPlan:
    keys = keys_at(view, grid, seed, round_, start)
    by_key: dict[tuple[int, ...], list[str]] = {}
    for p, k in keys.items():
        by_key.setdefault(k.key, []).append(p)
    groups = tuple(sorted(tuple(sorted(g)) for g in by_key.values()))
    leaders = tuple(min(g, key=lambda p: leader_rank(seed, round_, p)) for g in groups)
    return RoundPlan(round_, grid, groups, leaders, keys)


def plan_round(
    view: Sequence[str], round_: int, *, seed: str, grid: Grid, start: int | None = None
) -> RoundPlan:
    """The groups of ``round_`` for the peers in ``view``; ``start`` is the first
    round of its sweep (default: sweeps of d rounds from round 0).  Cached: peers
    of one process that share a view share the plan."""
    return _plan(tuple(sorted(set(view))), round_, seed, grid, start)
