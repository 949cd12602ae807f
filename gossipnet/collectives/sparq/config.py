"""``gossipnet.SparQ``: the settings of SPARQ-SGD gossip, a frozen value.

Its own module (below the training layer) so that the strategies' options can
hold one and the wire code can read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossipnet.errors import ConfigError

__all__ = ("SparQ",)


@dataclass(frozen=True, kw_only=True, slots=True)
class SparQ:
    """SPARQ-SGD (Singh et al., arXiv 1910.14280) for ``strategy="moshpit"`` or ``"route"``.

    Pass it as ``net.optimizer(base, strategy="moshpit", compress=gossipnet.SparQ())``.
    Every ``average_every`` local steps (SPARQ's H) a peer checks its event
    trigger ``||x - x_hat||^2 > c_t * lr^2`` with ``c_t = threshold_c0 * (t + 1) **
    (1 - threshold_eps)`` (t: syncs so far, lr: the base optimizer's first group's
    learning rate); if it fires, it sends ``C(x - x_hat)`` (per block: top-k by
    magnitude, int8 with one scale) to its neighbours, and every peer moves
    ``x += gamma * sum_j w_ij (x_hat_j - x_hat_i)``.

    Attributes:
        density: fraction of each block's entries sent (top-k), in (0, 1].
        gamma: consensus step size, in (0, 1].  Keep it within about 5x ``density``:
            with AdamW in ``bench/sparq.py``, 0.5 at density 0.02 and 0.8 at 0.1
            diverged (the estimates lag the models too far for a large step).
        threshold_c0: c_0 of the trigger (0: send whenever the model moved at all).
        threshold_eps: epsilon of the growing threshold ``c_t``, in (0, 1].
        history: past differences kept per block, to replay to a peer that missed
            them (beyond this the block is refreshed exactly), >= 1.
        repair_wait_s: after every neighbour's END arrived, how long a round waits
            for the repairs it asked for (seconds, >= 0).
    """

    density: float = 0.1
    gamma: float = 0.5
    threshold_c0: float = 0.0
    threshold_eps: float = 0.5
    history: int = 16
    repair_wait_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ConfigError(f"SparQ.density must be in (0, 1], got {self.density}")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"SparQ.gamma must be in (0, 1], got {self.gamma}")
        if not self.threshold_c0 >= 0:
            raise ConfigError(f"SparQ.threshold_c0 must be >= 0, got {self.threshold_c0}")
        if not 0 < self.threshold_eps <= 1:
            raise ConfigError(f"SparQ.threshold_eps must be in (0, 1], got {self.threshold_eps}")
        if self.history < 1:
            raise ConfigError(f"SparQ.history must be >= 1, got {self.history}")
        if not self.repair_wait_s >= 0:
            raise ConfigError(f"SparQ.repair_wait_s must be >= 0, got {self.repair_wait_s}")

    def threshold(self, t: int, lr: float) -> float:
        """The trigger's threshold ``c_t * lr^2`` at sync ``t`` (>= 0)."""
        return self.threshold_c0 * (t + 1) ** (1.0 - self.threshold_eps) * lr * lr
