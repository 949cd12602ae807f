"""Radio model and link tables: how long a model exchange takes and how likely it succeeds.

A reconstruction (ALGORITHMS.md 4.1, step 2; the RoADTrain paper was not available),
from textbook parts, chosen so that *distance over time* decides a transfer:

- Rate: Shannon capacity of a log-distance path-loss SNR,
  ``rate(d) = peak * log2(1 + snr(d)) / log2(1 + snr(ref))``, zero beyond range.
- Per-packet delivery: a logistic fall-off around ``half_loss_m`` (fading, shadowing).
  The link layer retransmits (802.11 ARQ), so lost packets cost time, not data:
  goodput = rate * delivery.
- Outage: a connection breaks at a rate that grows with packet loss,
  ``hazard(d) = outage_per_s * (1 - delivery(d))``; a broken transfer is lost.
- An exchange of ``nbytes`` starting at t succeeds iff, after the handshake, the
  goodput integrated over time reaches ``nbytes`` before the pair leaves range (a
  contact window must hold for the whole transfer) and no outage occurs, which
  has probability ``exp(-integral of hazard)``.

:func:`link_table` evaluates this for every pair and every start time of a look-ahead
horizon at once, on sampled positions; one sorted search answers all the
"when does the transfer finish" questions (no Python loop over pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gossipnet.mobility.routes import Route, positions

__all__ = ("LinkTable", "RadioModel", "exchange_probability", "link_table", "static_positions")

FloatArray = np.ndarray
IntArray = np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class RadioModel:
    """Delivery probability, bandwidth and outage as functions of distance.

    Defaults are of the order of 802.11p / C-V2X sidelink in a city: about 16 Mbit/s
    close by, a few Mbit/s at 100 m, nothing beyond 150 m.

    Raises:
        ValueError: a non-positive distance, rate or time, or a negative outage rate.
    """

    range_m: float = 150.0
    peak_rate_bytes_per_s: float = 2.0e6
    ref_m: float = 10.0
    snr_at_ref_db: float = 30.0
    path_loss_exponent: float = 2.7
    half_loss_m: float = 110.0
    loss_width_m: float = 15.0
    outage_per_s: float = 0.2
    handshake_s: float = 0.2

    def __post_init__(self) -> None:
        for name in ("range_m", "peak_rate_bytes_per_s", "ref_m", "path_loss_exponent"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RadioModel.{name} must be > 0, got {getattr(self, name)!r}")
        if not (self.loss_width_m > 0 and self.half_loss_m > 0):
            raise ValueError("RadioModel.half_loss_m and loss_width_m must be > 0")
        if self.outage_per_s < 0 or self.handshake_s < 0:
            raise ValueError("RadioModel.outage_per_s and handshake_s must be >= 0")

    def delivery(self, d_m: FloatArray | float) -> FloatArray:
        """Per-packet delivery probability at distance ``d_m`` (0 beyond range)."""
        d = np.asarray(d_m, dtype=np.float64)
        z = np.clip((d - self.half_loss_m) / self.loss_width_m, -60.0, 60.0)
        return np.where(d <= self.range_m, 1.0 / (1.0 + np.exp(z)), 0.0)

    def rate_bytes_per_s(self, d_m: FloatArray | float) -> FloatArray:
        """Link rate in bytes/s at distance ``d_m``: Shannon over path-loss SNR."""
        d = np.maximum(np.asarray(d_m, dtype=np.float64), self.ref_m)
        snr_ref = 10.0 ** (self.snr_at_ref_db / 10.0)
        snr = snr_ref * (self.ref_m / d) ** self.path_loss_exponent
        rate = self.peak_rate_bytes_per_s * np.log2(1.0 + snr) / math.log2(1.0 + snr_ref)
        return np.where(np.asarray(d_m) <= self.range_m, rate, 0.0)

    def goodput_bytes_per_s(self, d_m: FloatArray | float) -> FloatArray:
        """Bytes/s that arrive once the link layer has resent lost packets."""
        return self.rate_bytes_per_s(d_m) * self.delivery(d_m)

    def hazard_per_s(self, d_m: FloatArray | float) -> FloatArray:
        """Rate of connection breaks (per second) at distance ``d_m``."""
        return self.outage_per_s * (1.0 - self.delivery(d_m))


@dataclass(frozen=True, slots=True, eq=False)
class LinkTable:
    """Every pair's exchange time and success probability, for every start step.

    ``pairs[p] = (i, j)`` with i < j; ``duration_s[p, s]`` is how long an exchange that
    starts at ``s * dt_s`` (relative to the table's origin) takes, ``inf`` if it
    cannot finish inside a contact within the horizon; ``probability[p, s]`` is its
    success probability (0 where the duration is infinite).
    """

    n: int
    pairs: IntArray
    dt_s: float
    duration_s: FloatArray
    probability: FloatArray

    @property
    def starts(self) -> int:
        return int(self.duration_s.shape[1])

    def pair_index(self) -> IntArray:
        """An (n, n) array: the row of pair (i, j) in this table, -1 on the diagonal."""
        idx = np.full((self.n, self.n), -1, dtype=np.int64)
        rows = np.arange(self.pairs.shape[0])
        idx[self.pairs[:, 0], self.pairs[:, 1]] = rows
        idx[self.pairs[:, 1], self.pairs[:, 0]] = rows
        return idx


def static_positions(pos: FloatArray, steps: int | None = None) -> FloatArray:
    """Positions frozen at the first sample for ``steps`` samples (default: as many as given).

    What a scheduler that knows where vehicles are, but not where they go, assumes.
    """
    return np.repeat(pos[:, :1], pos.shape[1] if steps is None else steps, axis=1)


def _first_reach(cum: FloatArray, targets: FloatArray) -> IntArray:
    """For each row p and target q: the smallest k with ``cum[p, k] >= q``, or ``K`` if none.

    Rows of ``cum`` (P, K) are non-decreasing.  Offsetting row p by p * big makes the
    flattened array globally sorted, so one ``searchsorted`` answers every query.
    """
    rows, width = cum.shape
    big = float(np.max(cum, initial=0.0) + np.max(targets, initial=0.0) + 1.0)
    offset = np.arange(rows, dtype=np.float64)[:, None] * big
    flat = (cum + offset).ravel()
    idx = np.searchsorted(flat, (targets + offset).ravel(), side="left").reshape(targets.shape)
    return np.minimum(idx - np.arange(rows)[:, None] * width, width)


def link_table(
    pos: FloatArray,
    radio: RadioModel,
    nbytes: float,
    dt_s: float,
    *,
    starts: int | None = None,
    pairs: IntArray | None = None,
) -> LinkTable:
    """Exchange durations and success probabilities for all pairs from sampled positions.

    Args:
        pos: (n, T, 2) positions in metres at times ``k * dt_s`` from the table origin.
        radio: the radio model.
        nbytes: bytes one exchange moves over the link (both directions of a swap,
            as a half-duplex radio sends them one after the other).
        dt_s: sampling step in seconds; positions are held over each step.
        starts: how many start steps to tabulate (default all T).
        pairs: (P, 2) vertex pairs to evaluate; default every pair i < j.

    Returns:
        A :class:`LinkTable` with ``starts`` columns.
    """
    n, steps, _ = pos.shape
    if not (nbytes > 0 and dt_s > 0):
        raise ValueError("nbytes and dt_s must be > 0")
    n_starts = steps if starts is None else min(int(starts), steps)
    if pairs is None:
        iu, ju = np.triu_indices(n, k=1)
    else:
        iu, ju = np.asarray(pairs, dtype=np.int64).reshape(-1, 2).T
    dist = np.linalg.norm(pos[iu] - pos[ju], axis=-1)  # (P, T)
    zeros = np.zeros((dist.shape[0], 1))
    good = radio.goodput_bytes_per_s(dist) * dt_s
    cum = np.concatenate([zeros, np.cumsum(good, axis=1)], axis=1)  # (P, T+1)
    out = np.concatenate([zeros, np.cumsum(dist > radio.range_m, axis=1)], axis=1)
    haz = np.concatenate([zeros, np.cumsum(radio.hazard_per_s(dist) * dt_s, axis=1)], axis=1)
    hand = math.ceil(radio.handshake_s / dt_s - 1e-9)
    s = np.arange(n_starts)
    data0 = np.minimum(s + hand, steps)  # first step that carries data
    end = _first_reach(cum, cum[:, data0] + nbytes)  # (P, S), in 0..T+1
    done = end <= steps
    e = np.minimum(end, steps)
    last = np.maximum(e - 1, 0)
    need = nbytes - (np.take_along_axis(cum, last, axis=1) - cum[:, data0])
    per_step = np.take_along_axis(good, np.minimum(last, steps - 1), axis=1)
    frac = np.where(per_step > 0, need / np.where(per_step > 0, per_step, 1.0), 1.0)
    duration = (last - s[None, :] + np.clip(frac, 0.0, 1.0)) * dt_s
    in_contact = (np.take_along_axis(out, e, axis=1) - out[:, s]) == 0
    ok = done & in_contact
    prob = np.exp(-(np.take_along_axis(haz, e, axis=1) - haz[:, s]))
    return LinkTable(
        n=n,
        pairs=np.stack([iu, ju], axis=1),
        dt_s=float(dt_s),
        duration_s=np.where(ok, duration, np.inf),
        probability=np.where(ok, prob, 0.0),
    )


def exchange_probability(
    a: Route,
    b: Route,
    radio: RadioModel,
    nbytes: float,
    start_s: float,
    *,
    horizon_s: float = 60.0,
    dt_s: float = 0.05,
) -> tuple[float, float]:
    """(duration in s, success probability) of one exchange of ``nbytes`` from ``start_s``.

    ``(inf, 0.0)`` when the pair cannot finish it inside one contact within ``horizon_s``.
    """
    t = start_s + dt_s * np.arange(math.ceil(horizon_s / dt_s) + 1)
    table = link_table(positions([a, b], t), radio, nbytes, dt_s, starts=1)
    return float(table.duration_s[0, 0]), float(table.probability[0, 0])
