"""Route-aware gossip over the network (ALGORITHMS.md section 4).

``net.average(..., method="route")`` and ``strategy="route"`` run on it.
"""
