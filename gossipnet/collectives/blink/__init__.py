"""Blink spanning-tree collectives for GPUs in one machine (ALGORITHMS.md section 5).

Modules are imported explicitly (``from gossipnet.collectives.blink.detect import detect``);
this package imports nothing at import time so that CPU-only installs stay light.
"""
