"""Leases of a fleet's members, read on a :class:`~weightsync.clock.clock.Clock`.

A member's lease is renewed by its join, its heartbeats and its commands; a live member of the
record whose lease ran out is dead, and the coordinator sends :class:`Expire` for it (through
``decide``, like every other change). Leases live in memory: a restarted coordinator knows
none, so every live member of its stored record gets one lease period from the first look
(its next heartbeat renews it; a member that died meanwhile is declared dead one lease later).

    leases = FleetLeases(clock)
    leases.renew("job", "reader", 3, "3fa2", ttl=5.0)
    for command in leases.expired("job", record):      # Expire commands, for decide
        ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync.clock.clock import Clock
from weightsync.meta.fleet.commands import Expire
from weightsync.ports.fleet import FleetRecord

#: the lease period of a member that did not give one (and of every member after a restart)
DEFAULT_TTL = 5.0
#: the longest lease period a member may ask for (a dead member is named one period late at most)
MAX_TTL = 3600.0


def check_ttl(ttl: object) -> float | None:
    """A join's lease period, checked: seconds in (0.01, MAX_TTL], or None (the default).

    Raises:
        ValueError: naming the field and the bounds.
    """
    if ttl is None:
        return None
    if (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl)
            or not 0.01 < ttl <= MAX_TTL):
        raise ValueError(f"field 'ttl' must be seconds in (0.01, {MAX_TTL:g}], not {ttl!r}")
    return float(ttl)


@dataclass(slots=True)
class _Lease:
    incarnation: str
    ttl: float
    renewed: float  # Clock.monotonic() of the last renewal


class FleetLeases:
    """Every job's fleet leases (see module docstring)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._jobs: dict[str, dict[tuple[str, int], _Lease]] = {}

    def renew(self, job: str, role: str, id_: int, incarnation: str, ttl: float | None = None) -> None:
        leases = self._jobs.setdefault(job, {})
        old = leases.get((role, id_))
        keep = old.ttl if old is not None and old.incarnation == incarnation else DEFAULT_TTL
        leases[(role, id_)] = _Lease(incarnation, ttl if ttl is not None else keep, self.clock.monotonic())

    def expired(self, job: str, record: FleetRecord) -> list[Expire]:
        """The :class:`Expire` commands of the live members whose lease ran out (a live member
        without a lease of its incarnation gets one from now: see module docstring)."""
        now = self.clock.monotonic()
        leases = self._jobs.setdefault(job, {})
        out = []
        for m in record.members.values():
            if not m.live:
                continue
            lease = leases.get((m.role, m.id))
            if lease is None or lease.incarnation != m.incarnation:
                leases[(m.role, m.id)] = _Lease(m.incarnation, DEFAULT_TTL, now)
            elif now - lease.renewed > lease.ttl:
                out.append(Expire(m.role, m.id, m.incarnation,
                                  f"no heartbeat for {now - lease.renewed:.1f} s (lease {lease.ttl:g} s)"))
        return out

    def drop(self, job: str) -> None:
        self._jobs.pop(job, None)

    def forget(self) -> None:
        """Lose every lease (what a restart of the coordinator does)."""
        self._jobs.clear()


__all__ = ["DEFAULT_TTL", "MAX_TTL", "FleetLeases", "check_ttl"]
