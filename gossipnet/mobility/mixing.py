"""Gossip mixing under loss: Metropolis-Hastings, matchings with symmetric drops, push-sum.

Why three rules (ALGORITHMS.md 4.1 step 5-6, 4.2, and the rules across sections):

- A symmetric, doubly stochastic W keeps the mean of the models, which is what
  decentralised SGD converges to.  Under loss it stays doubly stochastic only if
  *both* ends skip a failed exchange: the failed W_ij goes back onto both
  diagonals (:func:`metropolis_weights` with ``delivered``, :func:`mix_matching`).
- If only the receiver can know (one-way loss, no acknowledgement back), symmetric
  rules lose the mean.  Push-sum (:func:`push_sum_step`) keeps numerator x and
  weight w; the column-stochastic update conserves sum(x) and sum(w), and z = x/w
  still converges to the average, as long as the sender keeps the share it failed
  to deliver instead of discounting it.
- SGP (Assran et al., ICML 2019) is push-sum over a rotating directed exponential
  graph (:func:`sgp_out_peers`), as in the authors' ``graph_manager.py``.

All functions are pure and vectorised over models: ``x`` is (n, d), one row per peer.
"""

from __future__ import annotations

import numpy as np

__all__ = (
    "consensus_error",
    "matching_matrix",
    "metropolis_weights",
    "mix_matching",
    "push_sum_step",
    "sgp_hops",
    "sgp_out_peers",
)

FloatArray = np.ndarray
IntArray = np.ndarray
BoolArray = np.ndarray


def metropolis_weights(n: int, edges: IntArray, delivered: BoolArray | None = None) -> FloatArray:
    """Metropolis-Hastings weights W (n, n) on an undirected edge list.

    ``W_ij = 1 / (1 + max(deg_i, deg_j))`` with degrees of the *planned* graph, which
    both ends know from the shared schedule; ``W_ii = 1 - sum_j W_ij``.  An edge whose
    exchange failed (``delivered[k]`` False) gets weight 0 at both ends and its
    weight returns to both diagonals: W stays symmetric and doubly stochastic.
    Using degrees of the *delivered* graph instead would need the neighbours'
    outcomes, which a peer does not have.
    """
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    deg = np.bincount(edges.ravel(), minlength=n)
    w = 1.0 / (1.0 + np.maximum(deg[edges[:, 0]], deg[edges[:, 1]]))
    if delivered is not None:
        w = np.where(np.asarray(delivered, dtype=bool), w, 0.0)
    mat = np.zeros((n, n))
    np.add.at(mat, (edges[:, 0], edges[:, 1]), w)
    np.add.at(mat, (edges[:, 1], edges[:, 0]), w)
    mat[np.diag_indices(n)] = 1.0 - mat.sum(axis=1)
    return mat


def matching_matrix(n: int, edges: IntArray, delivered: BoolArray | None = None) -> FloatArray:
    """W of one matching phase: pairs that exchanged average (1/2, 1/2); others keep theirs.

    This is Metropolis-Hastings on a matching (every degree is 1).
    """
    return metropolis_weights(n, edges, delivered)


def mix_matching(x: FloatArray, edges: IntArray, delivered: BoolArray | None = None) -> FloatArray:
    """Apply one matching phase to models ``x`` (n, d): pairwise averages, symmetric drops.

    O(k d) for k edges, without forming W.  A failed exchange is skipped by both
    ends, so ``x.sum(axis=0)`` is unchanged whatever fails.

    Raises:
        ValueError: a vertex appears in two edges (not a matching).
    """
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    if delivered is not None:
        edges = edges[np.asarray(delivered, dtype=bool)]
    flat = edges.ravel()
    if len(np.unique(flat)) != len(flat):
        raise ValueError("mix_matching needs a matching: a vertex appears in two edges")
    out = np.array(x, dtype=np.float64, copy=True)
    mean = 0.5 * (out[edges[:, 0]] + out[edges[:, 1]])
    out[edges[:, 0]] = mean
    out[edges[:, 1]] = mean
    return out


def push_sum_step(
    x: FloatArray,
    w: FloatArray,
    links: IntArray,
    delivered: BoolArray | None = None,
) -> tuple[FloatArray, FloatArray]:
    """One push-sum step over directed ``links`` (k, 2) = (sender, receiver).

    Each sender i splits (x_i, w_i) into ``out_degree_i + 1`` equal shares, keeps
    one and sends one to each out-peer.  A share that is not delivered stays with
    its sender (it learns the failure from the missing link-layer acknowledgement),
    so sum(x) and sum(w) are conserved exactly, even under one-sided loss.

    Returns:
        The new ``(x, w)``; the de-biased models are ``x / w[:, None]``.
    """
    links = np.asarray(links, dtype=np.int64).reshape(-1, 2)
    n = x.shape[0]
    share = 1.0 / (1.0 + np.bincount(links[:, 0], minlength=n))
    ok = np.ones(len(links), bool) if delivered is None else np.asarray(delivered, dtype=bool)
    src, dst = links[:, 0], links[:, 1]
    x_new = x * share[:, None]
    w_new = w * share
    # delivered shares go to the receiver, failed ones back to the sender
    to = np.where(ok, dst, src)
    np.add.at(x_new, to, x[src] * share[src][:, None])
    np.add.at(w_new, to, w[src] * share[src])
    return x_new, w_new


def sgp_hops(n: int, peers_per_itr: int = 1) -> list[int]:
    """SGP's out-peer distances: ``j * (k + 1)^i`` for j = 1..k, i = 0.. while < n.

    The phone book of the authors' ``NPeerDynamicDirectedExponentialGraph`` (k =
    ``peers_per_itr``); with k = 1 these are the powers of two below n.  Distances
    that land on the same peer are listed once, as the authors' ``_add_peers`` does.
    """
    if n < 2 or peers_per_itr < 1:
        raise ValueError(f"need n >= 2 and peers_per_itr >= 1, got {n}, {peers_per_itr}")
    base, top = peers_per_itr + 1, 0
    while base ** (top + 1) <= n - 1:  # integer log: no float rounding at exact powers
        top += 1
    hops: list[int] = []
    for i in range(top + 1):
        for j in range(1, peers_per_itr + 1):
            hop = (j * base**i) % n
            if hop and hop not in hops:
                hops.append(hop)
    return hops


def sgp_out_peers(n: int, iteration: int, peers_per_itr: int = 1) -> IntArray:
    """SGP's directed exponential graph at one iteration: links ``i -> (i + hop) mod n``.

    Every peer uses ``peers_per_itr`` consecutive entries of :func:`sgp_hops`,
    advancing by ``peers_per_itr`` each iteration (the authors' group-index rotation).
    """
    if n < 2:
        return np.empty((0, 2), dtype=np.int64)
    hops = sgp_hops(n, peers_per_itr)
    picked = [hops[(iteration * peers_per_itr + g) % len(hops)] for g in range(peers_per_itr)]
    src = np.repeat(np.arange(n), len(picked))
    dst = (src + np.tile(picked, n)) % n
    return np.stack([src, dst], axis=1)


def consensus_error(x: FloatArray) -> float:
    """Mean squared distance of the models from their average: (1/n) sum ||x_i - mean||^2."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=-1)))
