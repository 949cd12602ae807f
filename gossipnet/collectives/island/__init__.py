"""Islands: one process per GPU on a machine, Blink trees inside an island,
the lossy all-reduce across islands.
"""
