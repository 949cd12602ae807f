"""Vehicle routes on a synthetic grid city, and contact windows between two routes.

RoADTrain (DESIGN.md section 4) starts from routes that vehicles share: a route
says where a vehicle will be and when, so its neighbours can predict who will be
within radio range, for how long.  The paper was not available; this module is a
reconstruction (ALGORITHMS.md 4.1, step 1) built from standard pieces:

- :class:`CityGrid`: a Manhattan grid of intersections joined by straight blocks.
  Synthetic and seeded, so nothing is downloaded and every run replays.
- :class:`Route`: timed waypoints; the vehicle moves in a straight line at
  constant speed between consecutive waypoints (a repeated point is a stop).
- :class:`Itinerary`: what a vehicle *plans* (waypoints and nominal segment
  durations) and what it *does* (the same waypoints, noisy durations: traffic).
  :meth:`Itinerary.shared_route` is what it tells others at a given time: its
  true position now and the nominal schedule from there on.
- :func:`contact_windows`: the exact intervals when two routes are within range.
  Between merged breakpoints the relative position is linear in time, so the
  squared distance is a quadratic and each window edge is a root; no sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ("CityGrid", "Itinerary", "Route", "TrafficConfig", "contact_windows", "positions")

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class CityGrid:
    """A grid city: ``(blocks_x + 1) x (blocks_y + 1)`` intersections, blocks of ``block_m``.

    Why a grid: it is the simplest road graph with crossings, parallel streets and
    turns, which is what makes contacts short (crossing) or long (same street).
    """

    blocks_x: int = 6
    blocks_y: int = 6
    block_m: float = 100.0

    def __post_init__(self) -> None:
        if self.blocks_x < 1 or self.blocks_y < 1:
            raise ValueError(
                f"a city needs >= 1 block each way, got {self.blocks_x}x{self.blocks_y}"
            )
        if not self.block_m > 0:
            raise ValueError(f"block_m must be > 0 metres, got {self.block_m!r}")

    def point(self, node: tuple[int, int]) -> FloatArray:
        """Coordinates in metres of intersection ``(ix, iy)``."""
        return np.array(node, dtype=np.float64) * self.block_m

    def random_node(self, rng: np.random.Generator) -> tuple[int, int]:
        return int(rng.integers(self.blocks_x + 1)), int(rng.integers(self.blocks_y + 1))

    def random_trip(self, rng: np.random.Generator, start: tuple[int, int]) -> IntArray:
        """Intersections (k + 1, 2) of a shortest path from ``start`` to a random other one.

        The order of east/west and north/south blocks is shuffled, so trips between the
        same two corners take different streets (a random monotone lattice path).
        """
        goal = start
        while goal == start:
            goal = self.random_node(rng)
        dx, dy = goal[0] - start[0], goal[1] - start[1]
        moves = np.zeros((abs(dx) + abs(dy), 2), dtype=np.int64)
        moves[: abs(dx), 0] = np.sign(dx)
        moves[abs(dx) :, 1] = np.sign(dy)
        moves = moves[rng.permutation(len(moves))]
        return np.vstack([np.array(start)[None], np.array(start) + np.cumsum(moves, axis=0)])


@dataclass(frozen=True, kw_only=True, slots=True)
class TrafficConfig:
    """How vehicles drive: speeds, stops at intersections, and how unpredictable they are.

    ``duration_noise`` is the relative spread (log-normal sigma) of each segment's real
    duration around the planned one: traffic the shared route cannot know about.  0
    makes routes exact predictions; the benchmark's hard conditions raise it.
    """

    min_speed_mps: float = 8.0
    max_speed_mps: float = 14.0
    stop_probability: float = 0.3
    max_stop_s: float = 20.0
    duration_noise: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.min_speed_mps <= self.max_speed_mps:
            raise ValueError("need 0 < min_speed_mps <= max_speed_mps")
        if not 0.0 <= self.stop_probability <= 1.0:
            raise ValueError(f"stop_probability must be in [0, 1], got {self.stop_probability}")
        if self.max_stop_s < 0 or self.duration_noise < 0:
            raise ValueError("max_stop_s and duration_noise must be >= 0")


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    """Timed waypoints: the vehicle is at ``points_m[k]`` at ``times_s[k]``.

    Between waypoints it moves in a straight line at constant speed; before the first
    and after the last it stands still (parked), so positions are defined for all t.

    Raises:
        ValueError: shapes disagree, fewer than one waypoint, or times not increasing.
    """

    times_s: FloatArray
    points_m: FloatArray

    def __post_init__(self) -> None:
        times = np.asarray(self.times_s, dtype=np.float64)
        points = np.asarray(self.points_m, dtype=np.float64)
        if times.ndim != 1 or points.shape != (times.size, 2) or times.size == 0:
            raise ValueError(
                f"need times (m,) and points (m, 2), got {times.shape}, {points.shape}"
            )
        if np.any(np.diff(times) <= 0):
            raise ValueError("route times must be strictly increasing")
        object.__setattr__(self, "times_s", times)
        object.__setattr__(self, "points_m", points)

    def position(self, t_s: FloatArray | float) -> FloatArray:
        """Positions (..., 2) in metres at times ``t_s`` (any shape)."""
        t = np.asarray(t_s, dtype=np.float64)
        x = np.interp(t, self.times_s, self.points_m[:, 0])
        y = np.interp(t, self.times_s, self.points_m[:, 1])
        return np.stack([x, y], axis=-1)


def positions(routes: list[Route], t_s: FloatArray) -> FloatArray:
    """Positions of every vehicle at the times ``t_s``: an (n, len(t_s), 2) array."""
    return np.stack([r.position(t_s) for r in routes])


@dataclass(frozen=True, slots=True, eq=False)
class Itinerary:
    """A vehicle's plan (``nominal_s``) and its real motion (``actual``) over the same streets.

    Why both: a shared route is a prediction.  The real segment durations differ by
    traffic noise, so a scheduler that trusts routes can be wrong, as on real roads.
    """

    points_m: FloatArray
    nominal_s: FloatArray
    actual: Route
    _cum_nominal: FloatArray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cum_nominal", np.concatenate([[0.0], np.cumsum(self.nominal_s)]))

    @classmethod
    def random(
        cls,
        city: CityGrid,
        traffic: TrafficConfig,
        rng: np.random.Generator,
        *,
        duration_s: float,
        start_s: float = 0.0,
    ) -> Itinerary:
        """Random trips, one after another, covering at least ``duration_s`` seconds.

        Each trip goes to a random intersection at one speed; at each intersection the
        vehicle stops with ``stop_probability`` for up to ``max_stop_s`` (traffic lights).
        A stop is a zero-length segment, so routes change direction and pace over time.
        """
        first = city.point(city.random_node(rng))[None]
        pts, nominal, actual = _trips(city, traffic, rng, first[0], duration_s)
        times = start_s + np.concatenate([[0.0], np.cumsum(actual)])
        points = np.vstack([first, pts])
        return cls(points_m=points, nominal_s=nominal, actual=Route(times, points))

    def extended(
        self, city: CityGrid, traffic: TrafficConfig, rng: np.random.Generator, duration_s: float
    ) -> Itinerary:
        """This itinerary with at least ``duration_s`` more seconds of trips appended.

        Deterministic given ``rng``'s state, whenever it is called: a simulator can
        extend routes lazily and still replay exactly.
        """
        pts, nominal, actual = _trips(city, traffic, rng, self.points_m[-1], duration_s)
        times = self.actual.times_s[-1] + np.cumsum(actual)
        points = np.vstack([self.points_m, pts])
        return Itinerary(
            points_m=points,
            nominal_s=np.concatenate([self.nominal_s, nominal]),
            actual=Route(np.concatenate([self.actual.times_s, times]), points),
        )

    def shared_route(self, t0_s: float, horizon_s: float = math.inf) -> Route:
        """The route this vehicle announces at ``t0_s``: true position now, plan afterwards.

        Vehicles re-announce every round, so prediction errors do not accumulate over
        the run, only within the look-ahead horizon.  Waypoints beyond ``horizon_s``
        are left out (the last one kept covers the horizon).
        """
        times = self.actual.times_s
        k = int(np.clip(np.searchsorted(times, t0_s, side="right") - 1, 0, times.size - 2))
        frac = float(np.clip((t0_s - times[k]) / (times[k + 1] - times[k]), 0.0, 1.0))
        here = self.actual.position(t0_s)
        first = t0_s + max((1.0 - frac) * self.nominal_s[k], 1e-6)
        later = first + (self._cum_nominal[k + 2 :] - self._cum_nominal[k + 1])
        keep = int(np.searchsorted(later, t0_s + horizon_s, side="left")) + 1
        rest = self.points_m[k + 1 : k + 2 + keep]
        return Route(np.concatenate([[t0_s, first], later[:keep]]), np.vstack([here, rest]))


def _trips(
    city: CityGrid,
    traffic: TrafficConfig,
    rng: np.random.Generator,
    start_m: FloatArray,
    duration_s: float,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Waypoints after ``start_m``, their nominal and actual segment durations."""
    node = (round(float(start_m[0]) / city.block_m), round(float(start_m[1]) / city.block_m))
    points, nominal, total = [], [], 0.0
    while total < duration_s:
        speed = rng.uniform(traffic.min_speed_mps, traffic.max_speed_mps)
        trip = city.random_trip(rng, node)[1:]
        stop = rng.random(len(trip)) < traffic.stop_probability
        wait = rng.uniform(0.5, max(traffic.max_stop_s, 0.5), size=len(trip))
        reps = 1 + stop.astype(np.int64)  # each block, then maybe a zero-length stop
        points.append(np.repeat(trip * city.block_m, reps, axis=0).astype(np.float64))
        seg = np.stack([np.full(len(trip), city.block_m / speed), wait], axis=1)
        seg_s = seg[np.repeat(np.arange(len(trip)), reps), _alternate(reps)]
        nominal.append(seg_s)
        total += float(seg_s.sum())
        node = (int(trip[-1, 0]), int(trip[-1, 1]))
    nominal_s = np.concatenate(nominal)
    noise = np.exp(traffic.duration_noise * rng.standard_normal(nominal_s.size))
    return np.concatenate(points), nominal_s, nominal_s * noise


def _alternate(reps: np.ndarray) -> np.ndarray:
    """0, 1, ... within each run of ``reps``: which column (drive, stop) each segment takes."""
    starts = np.repeat(np.cumsum(reps) - reps, reps)
    return np.arange(int(reps.sum())) - starts


def contact_windows(
    a: Route, b: Route, range_m: float, *, start_s: float | None = None, end_s: float | None = None
) -> FloatArray:
    """Maximal intervals (w, 2) in seconds when routes ``a`` and ``b`` are within ``range_m``.

    Exact for piecewise-linear motion: on each interval between the merged waypoint
    times, relative position p(t) = p0 + v*tau, and |p|^2 <= R^2 is a quadratic
    inequality in tau solved in closed form (vectorised over intervals).  Touching
    pieces are merged into one window.

    Args:
        a, b: the two routes.
        range_m: radio range in metres (> 0).
        start_s, end_s: the time span to look at; by default where either route has
            waypoints (outside that both vehicles stand still).
    """
    if not range_m > 0:
        raise ValueError(f"range_m must be > 0, got {range_m!r}")
    lo = min(a.times_s[0], b.times_s[0]) if start_s is None else start_s
    hi = max(a.times_s[-1], b.times_s[-1]) if end_s is None else end_s
    if not hi > lo:
        return np.empty((0, 2))
    knots = np.unique(np.concatenate([a.times_s, b.times_s, [lo, hi]]))
    knots = knots[(knots >= lo) & (knots <= hi)]
    t0, t1 = knots[:-1], knots[1:]
    p0 = b.position(t0) - a.position(t0)
    vel = (b.position(t1) - a.position(t1) - p0) / (t1 - t0)[:, None]
    qa = np.einsum("ij,ij->i", vel, vel)
    qb = 2.0 * np.einsum("ij,ij->i", p0, vel)
    qc = np.einsum("ij,ij->i", p0, p0) - range_m**2
    span = t1 - t0
    start, stop = np.full(span.shape, np.nan), np.full(span.shape, np.nan)
    still = qa < 1e-12  # no relative motion: inside for the whole piece or not at all
    inside_still = still & (qc <= 0)
    start[inside_still], stop[inside_still] = 0.0, span[inside_still]
    moving = ~still
    disc = qb**2 - 4.0 * qa * qc
    ok = moving & (disc >= 0)
    root = np.sqrt(np.where(ok, disc, 0.0))
    denom = np.where(ok, 2.0 * qa, 1.0)
    r1, r2 = (-qb - root) / denom, (-qb + root) / denom
    s, e = np.maximum(r1, 0.0), np.minimum(r2, span)
    hit = ok & (s <= e)
    start[hit], stop[hit] = s[hit], e[hit]
    keep = ~np.isnan(start)
    return _merge(np.stack([t0[keep] + start[keep], t0[keep] + stop[keep]], axis=1))


def _merge(pieces: FloatArray, tol_s: float = 1e-9) -> FloatArray:
    """Merge time-ordered intervals that touch (within ``tol_s``) into maximal ones."""
    if pieces.size == 0:
        return np.empty((0, 2))
    out = [list(pieces[0])]
    for s, e in pieces[1:]:
        if s <= out[-1][1] + tol_s:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return np.array(out)
