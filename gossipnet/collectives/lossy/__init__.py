"""The loss-tolerant all-reduce (ALGORITHMS.md section 1): reduce-scatter and
all-gather over lossy packets, with cut times, parity, NACK repair and stale steps.
"""
