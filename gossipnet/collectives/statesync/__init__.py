"""State transfer for late joiners and restarts: chunked, checksummed,
resumable, cross-checked against a second donor.
"""
