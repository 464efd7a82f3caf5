"""weightsync: planned, zero-redundancy, in-place weight sync from training into inference."""

__version__ = "0.1.0"
