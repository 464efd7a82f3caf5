"""Delta sync, independent of any one transport: per pair for two-sided transports
(pairs.py), published changes for one-sided ones (published.py)."""
