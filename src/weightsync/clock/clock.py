"""The clock port: where every lease, deadline and coordinator decision reads the time.

Production code takes a :class:`Clock` (the :data:`SYSTEM` clock by default); a protocol test
passes a :class:`ManualClock` and moves time itself, so that no test sleeps to let a lease
expire or a deadline pass::

    clock = ManualClock()
    lease_ends = clock.monotonic() + 3.0
    clock.advance(3.5)                       # nothing sleeps
    assert clock.monotonic() > lease_ends

Two readings, for two uses: :meth:`Clock.monotonic` for timers local to one process (a lease's
last heartbeat, a wait's deadline), which never jump; :meth:`Clock.now` (seconds since the
Unix epoch) for times a coordinator *stores* (when a try opened, when it must be decided),
which must mean the same after a restart and on another host of the coordinator.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """What code that waits or decides by time asks of the time (see module docstring)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""
        ...

    def now(self) -> float:
        """Seconds since the Unix epoch: for times that are stored or compared across processes."""
        ...


class SystemClock:
    """The real clocks: ``time.monotonic`` and ``time.time``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when the test says so (both readings move together)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._t = float(start)

    def monotonic(self) -> float:
        return self._t

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (>= 0)."""
        if seconds < 0:
            raise ValueError(f"a clock never goes back: advance({seconds})")
        self._t += seconds


#: The clock production code uses unless it is given another.
SYSTEM: Clock = SystemClock()

__all__ = ["SYSTEM", "Clock", "ManualClock", "SystemClock"]
