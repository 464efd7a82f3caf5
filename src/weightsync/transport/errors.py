"""The error every transport raises (in a module of its own, so that what a transport uses can
raise it without importing the contract)."""

from __future__ import annotations


class TransportError(RuntimeError):
    """A transfer failed: a peer died, a timeout expired, or a checksum did not match."""
