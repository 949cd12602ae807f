"""The demo: a small character-level language model trained by N local peers
under a chosen fault plan (``gossipnet demo``, ``make demo``).
"""
