"""``net.microbatches``: gradient accumulation with the DropCompute cut-off.

The training loop stays plain PyTorch::

    for mb in net.microbatches(batches, max_microbatches=8, tau="auto"):
        loss = loss_fn(model(mb.x), mb.y)      # the mean loss of this micro-batch
        loss.backward()                        # gradients add up over micro-batches
    opt.step()                                 # divides by the count, weights the all-reduce

Before every micro-batch but the first, the loop reads the clock; once the
step's elapsed compute time is past tau it stops (Giladi et al. 2023).  The
micro-batch in progress when tau passes still finishes and counts: a
forward/backward cannot be interrupted from outside.  Micro-batches that
were cut are not taken from the iterator, so a persistent iterator hands
them to the next step instead of losing them.

Time comes from the injected clock (the peer's, or one given), so tests
drive the cut with a ``FakeClock``.  The loop never touches the network,
except that ``tau="auto"`` gathers every peer's timings every few steps
(:func:`gather_rows`) so that all peers choose the same tau.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from gossipnet.collectives.lossy.options import RoundOptions
from gossipnet.training.autotau import AutoTau, FixedTau, TauPolicy
from gossipnet.training.dropcompute import MicrobatchReport, Normalise, contribution, should_cut
from gossipnet.training.host import TrainingHost

__all__ = ("MicrobatchLoop", "MicrobatchReport", "MicrobatchState", "TauSpec", "gather_rows")

log = logging.getLogger(__name__)
T = TypeVar("T")

#: ``None`` (no cut-off), seconds, ``"auto"``, or any :class:`TauPolicy`.
TauSpec = float | str | TauPolicy | None

#: Engine mode of timing-gather rounds: packets of gradient (0) or resync (1) rounds
#: are never mixed with them, even when peers disagree on which round is which.
MODE_TIMINGS = 0x44


class MicrobatchLoop(Generic[T]):
    """Iterator over at most K micro-batches of one step, cut at tau.

    Use it as a ``for`` loop; :meth:`finish` ends it early (the optimizer calls
    it, so a ``break`` is fine: the micro-batch in hand counts as completed).
    """

    def __init__(
        self,
        iterable: Iterable[T],
        *,
        max_microbatches: int,
        policy: TauPolicy,
        normalise: Normalise,
        now: Callable[[], float],
        step: int = 0,
        on_finish: Callable[[MicrobatchReport], None] | None = None,
    ) -> None:
        if max_microbatches < 1:
            raise ValueError(f"max_microbatches must be >= 1, got {max_microbatches}")
        contribution(0, max_microbatches, normalise)  # validates normalise
        self._it = iter(iterable)
        self.max_microbatches = max_microbatches
        self.policy = policy
        self.normalise: Normalise = normalise
        self._now = now
        self.step = step
        self._on_finish = on_finish
        self._t0: float | None = None
        self._mark = 0.0
        self._tau: float | None = None
        self._times: list[float] = []
        self._in_hand = False
        self._cut = self._exhausted = False
        self.report: MicrobatchReport | None = None

    def __iter__(self) -> MicrobatchLoop[T]:
        return self

    def __next__(self) -> T:
        if self.report is not None:
            raise StopIteration
        now = self._now()
        if self._t0 is None:
            self._t0 = now
            self._tau = self.policy.begin(now)
        elif self._in_hand:
            self._times.append(now - self._mark)
            self._in_hand = False
        if len(self._times) >= self.max_microbatches:
            self.finish()
            raise StopIteration
        if self._times and should_cut(now - self._t0, self._tau):
            self._cut = True
            self.finish()
            raise StopIteration
        self._mark = now
        try:
            item = next(self._it)
        except StopIteration:
            self._exhausted = True
            self.finish()
            raise
        self._in_hand = True
        return item

    def finish(self) -> MicrobatchReport:
        """End the step now (idempotent); a micro-batch in hand counts as completed."""
        if self.report is not None:
            return self.report
        now = self._now()
        if self._t0 is None:  # never iterated: an empty step
            self._t0 = now
            self._tau = self.policy.begin(now)
        if self._in_hand:
            self._times.append(now - self._mark)
            self._in_hand = False
        times = tuple(self._times)
        self.report = MicrobatchReport(
            step=self.step,
            completed=len(times),
            max_microbatches=self.max_microbatches,
            tau_s=self._tau,
            compute_s=(self._mark + times[-1] - self._t0) if times else 0.0,
            times_s=times,
            cut=self._cut,
            exhausted=self._exhausted,
            normalise=self.normalise,
        )
        self.policy.observe(times, self.max_microbatches)
        if self._on_finish is not None:
            self._on_finish(self.report)
        return self.report


class MicrobatchState:
    """A peer's DropCompute state: its auto-tau, step counter and last report."""

    def __init__(self) -> None:
        self.step = 0
        self.auto: AutoTau | None = None
        self.active: MicrobatchLoop[Any] | None = None
        self.last: MicrobatchReport | None = None
        self._taken = True

    def loop(
        self,
        host: TrainingHost,
        iterable: Iterable[T],
        max_microbatches: int,
        tau: TauSpec,
        normalise: Normalise,
        now: Callable[[], float],
    ) -> MicrobatchLoop[T]:
        """A new step's loop; a previous loop still open is finished first."""
        if self.active is not None:
            self.active.finish()
        loop: MicrobatchLoop[T] = MicrobatchLoop(
            iterable,
            max_microbatches=max_microbatches,
            policy=self._policy(host, tau),
            normalise=normalise,
            now=_synced(now),
            step=self.step,
            on_finish=self._finished,
        )
        self.step += 1
        self.active = loop
        self._taken = False
        return loop

    def take(self) -> MicrobatchReport | None:
        """The report of the loop since the last ``take`` (finishing it), else None."""
        if self.active is not None:
            self.active.finish()
        if self._taken:
            return None
        self._taken = True
        return self.last

    def _finished(self, report: MicrobatchReport) -> None:
        self.last = report
        self.active = None

    def _policy(self, host: TrainingHost, tau: TauSpec) -> TauPolicy:
        if tau is None or isinstance(tau, (int, float)):
            return FixedTau(None if tau is None else float(tau))
        if tau == "auto":
            if self.auto is None:
                self.auto = AutoTau()
            tau = self.auto
        if isinstance(tau, AutoTau):
            if tau.owner is None:
                tau.owner = host
                if tau.gather is None and tau.world_size == 1:
                    cap = tau.config.history_steps
                    tau.gather = lambda rows: gather_rows(host, rows, capacity=cap)
            elif tau.owner is not host:
                raise ValueError("this AutoTau already serves another peer; make one per peer")
        if not isinstance(tau, TauPolicy):
            raise ValueError(f"tau must be None, seconds, 'auto' or a TauPolicy, got {tau!r}")
        return tau


def _synced(now: Callable[[], float]) -> Callable[[], float]:
    """``now`` after waiting for queued CUDA work, so the clock sees finished compute
    (the authors sync the device before every check)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return now

    def synced() -> float:
        torch.cuda.synchronize()
        return now()

    return synced


# --------------------------------------------------------------------------- timing gather
def gather_rows(
    host: TrainingHost,
    rows: np.ndarray,
    *,
    capacity: int | None = None,
    timeout_s: float | None = None,
) -> list[np.ndarray]:
    """Every alive peer's ``[S, M]`` timing rows (own included), over the lossy all-reduce.

    Why an all-reduce can gather: each peer writes its rows into its own slot
    of a zero buffer; the all-reduce's per-chunk weighted mean then holds
    ``rows / c`` there, ``c`` being the contributions that reached the chunk's
    owner.  The first N elements of every chunk are markers, one per peer, each
    set to 1 by its peer only, so marker j arrives as ``1 / c`` (or 0 if peer j's
    packet was lost) and dividing a slot's piece by the marker of its own chunk
    recovers it exactly.  Slots are packed, so the buffer is about N x S x M
    floats whatever the chunk size.  A checksum of the participant list rejects
    a slot of a peer whose membership view differed.  All peers must call it at
    the same step, with the same ``capacity``.

    Args:
        rows: this peer's rows, seconds, NaN where a micro-batch did not run.
        capacity: rows per slot (default ``S``); shorter histories are padded, so
            a peer that joined late still lays out the same buffer.
        timeout_s: bound of the round (default ``Config.collective_timeout_s``).

    Returns:
        Rows of the peers whose slot arrived whole, in the sorted order of peer ids
        (the same on every peer, so seeded imputations agree), ours always among
        them.  Network faults never raise.
    """
    parts = tuple(host.alive_peers())
    n, me = len(parts), parts.index(host.peer_id) if host.peer_id in parts else -1
    elems = (host.config.chunk_bytes or host.node.transport.default_chunk_bytes) // 4  # type: ignore[union-attr]
    if n < 2 or me < 0 or elems <= n + 1:
        return [rows]
    s, m = rows.shape
    cap = max(s, capacity or s)
    header = [zlib.crc32(",".join(parts).encode()) % (1 << 16), s, m]
    mine = np.full((cap, m), -1.0)
    mine[cap - s :] = np.nan_to_num(rows, nan=-1.0)
    data_idx, mark_idx, length = _slots(n, 3 + cap * m, elems)
    buf = torch.zeros(length, dtype=torch.float32)
    buf[torch.arange(0, length, elems) + me] = 1.0
    buf[torch.from_numpy(data_idx[me])] = torch.from_numpy(
        np.concatenate([header, mine.ravel()])
    ).float()
    t = host.config.collective_timeout_s if timeout_s is None else timeout_s
    engine = host.allreduce_engine
    host.call(
        engine.run([buf], RoundOptions(timeout_s=t, participants=parts, mode=MODE_TIMINGS)), t + 30
    )
    flat = buf.double().numpy()
    out = _unpack_rows(flat[data_idx], flat[mark_idx], me, rows, header, cap)
    if len(out) < n:
        log.info("peer %s: timings of %d of %d peers arrived", host.peer_id, len(out), n)
    return out


def _unpack_rows(
    data: np.ndarray, marks: np.ndarray, me: int, rows: np.ndarray, header: list[int], cap: int
) -> list[np.ndarray]:
    """Each peer's rows out of its gathered slot: ``data`` and ``marks`` are the slots'
    values and the markers of their chunks (``[n, per_peer]``); a slot with a lost
    piece, another checksum or a bad row count is dropped; ours is ``rows`` itself."""
    values = data / np.maximum(marks, 1e-30)
    m = rows.shape[1]
    out = []
    for j in range(len(values)):
        if j == me:  # our own rows exactly (they also made the trip, in float32)
            out.append(rows)
            continue
        v = values[j]
        crc, s_j, m_j = (round(x) for x in v[:3])
        if not (marks[j] > 0).all() or (crc, m_j) != (header[0], m) or not 0 < s_j <= cap:
            continue
        got = v[3:].reshape(cap, m)[cap - s_j :].copy()
        got[got < 0] = np.nan
        out.append(got)
    return out


def _slots(n: int, per_peer: int, elems: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Packed layout: (data index ``[n, per_peer]``, its marker's index, buffer length).

    Chunk q holds markers at ``q * elems + j`` and data after them; a slot may span
    chunks, each piece pointing at the marker of the chunk it lies in.
    """
    room = elems - n
    d = np.arange(n * per_peer)
    chunk = d // room
    data_idx = chunk * elems + n + d % room
    mark_idx = chunk * elems + d // per_peer
    return data_idx.reshape(n, per_peer), mark_idx.reshape(n, per_peer), int(data_idx[-1]) + 1
