"""``Deadline``: one absolute point in time that every nested wait of an operation shares.

A ``write`` or ``update`` gets one timeout; each step under it (planning, agreeing on the
epoch, preparing the transport, moving bytes, waiting for readers) gets what is *left* of
it, so the whole operation, not each step, is bounded by the caller's timeout.

    deadline = Deadline.after(timeout)
    transport.send(version, deadline=deadline)
    if deadline.expired: ...
"""

from __future__ import annotations

import time

#: The shortest wait ``remaining()`` hands out: a step that is already late still gets to
#: look once (and fail with its own, more precise, message) instead of being skipped.
MIN_WAIT = 0.001


class Deadline:
    """A monotonic-clock deadline (see module docstring)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self, at_least: float = MIN_WAIT) -> float:
        """Seconds left, at least ``at_least`` (pass 0.0 where a zero wait means "do not wait")."""
        return max(self.at - time.monotonic(), at_least)

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def __repr__(self) -> str:
        return f"Deadline(in {self.at - time.monotonic():.3f}s)"
