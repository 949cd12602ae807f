"""Moshpit averaging (ALGORITHMS.md section 2): group all-reduces on a virtual
grid, matched without a server.
"""
