"""Liveness on the meta server: one lease per participant, kept alive by heartbeats.

A writer or reader process holds the lease of its ``(role, rank)`` under a random
*incarnation* (one per process). Its session's background thread renews it every quarter of
its ``ttl``; a process that stops renewing (killed, stopped, hung) is *dead* once ``ttl``
seconds pass, and a process that closed its session *released* it. Peers ask the server
which participants are dead (:meth:`Leases.table`) and fail their waits naming them
instead of waiting for their full timeout.

A lease is also how the server tells a restart from two processes claiming one rank: a new
incarnation takes over a lease only once the old one is dead or released. An acquisition
against a live holder is held (at most ``wait`` seconds, until the holder's lease would
expire) and then refused, naming the holder.

Leases live in memory only: a restarted server (with or without its state directory) knows
no lease until the next heartbeat, and counts a participant without one as alive.

Time the server itself stood still (its event loop held up: a loaded machine, a paused
process) does not count against anyone: the heartbeats of that time wait unread in its
sockets, and without this the first request served afterwards would find every lease expired
at once and fail live peers. :meth:`Leases.keep_time` (run by the server) notices such stalls.

    leases = Leases()                  # Leases(ManualClock()) in a test: time moves when it says
    await leases.acquire("job", "writer", 0, incarnation="3fa2", ttl=3.0, pid=41, host="n0", wait=3.0)
    leases.table("job")       # [LeaseRow(role="writer", rank=0, alive=True, age=0.01, ...)]
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from weightsync.clock.clock import SYSTEM, Clock
from weightsync.ports.records import LeaseRow


class LeaseHeldError(Exception):
    """Another live process holds the lease (the server answers 409 with this message)."""


@dataclass(slots=True)
class Lease:
    incarnation: str
    ttl: float
    pid: int
    host: str
    renewed: float  # the clock's monotonic() at the last heartbeat
    released: bool = False

    def age(self, now: float) -> float:
        return now - self.renewed

    def alive(self, now: float) -> bool:
        return not self.released and self.age(now) <= self.ttl

    def describe(self, now: float) -> str:
        """Who holds it and what the server knows of it, worded for a peer's error message."""
        if self.released:
            state = "released its lease: it left the job"
        elif self.alive(now):
            state = f"last heartbeat {self.age(now):.1f} s ago (ttl {self.ttl:g} s)"
        else:
            state = (f"last heartbeat {self.age(now):.1f} s ago: the meta server's lease of it (ttl {self.ttl:g} s) "
                     "expired")
        return f"pid {self.pid} on {self.host or 'an unnamed host'}, {state}"


#: How often :meth:`Leases.keep_time` looks at the clock; a longer gap is a stall of the server.
TICK_S = 0.1


class Leases:
    """Every job's leases (in memory; see module docstring), on ``clock`` (a test's
    :class:`~weightsync.clock.clock.ManualClock` moves only when the test says, so a test
    acquires with ``wait=0``: nothing would end a wait for a live holder)."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self._jobs: dict[str, dict[tuple[str, int], Lease]] = {}
        self._awake: float | None = None  # when the server last looked at the clock (keep_time runs)

    async def keep_time(self) -> None:
        """Look at the clock every ``TICK_S`` until cancelled, so that :meth:`_now` can tell a
        stall of the server from a quiet spell (run as a task for as long as the server serves)."""
        self.watch_time()
        try:
            while True:
                await asyncio.sleep(TICK_S)
                self.tick()
        finally:
            self._awake = None

    def watch_time(self) -> None:
        """From now on, a gap of more than ``TICK_S`` between two :meth:`tick` calls (or other
        reads of the clock) is a stall of the server, which counts against no lease."""
        self._awake = self.clock.monotonic()

    def tick(self) -> None:
        """The server looked at the clock (what :meth:`keep_time` does every ``TICK_S``)."""
        self._now()

    def _now(self) -> float:
        """The clock's ``monotonic()``, after moving every lease's last heartbeat forward by the
        time the server stood still since it last looked (see module docstring)."""
        now = self.clock.monotonic()
        if self._awake is not None:
            stalled = now - self._awake - TICK_S
            if stalled > TICK_S:
                for leases in self._jobs.values():
                    for lease in leases.values():
                        lease.renewed += stalled
            self._awake = now
        return now

    async def acquire(self, job: str, role: str, rank: int, *, incarnation: str, ttl: float, pid: int, host: str,
                      wait: float, release: bool = False) -> bool:
        """Take, renew or (``release``) give up the lease of ``(role, rank)``.

        Returns True if this incarnation took it over from another one (a restart).

        Raises:
            LeaseHeldError: another incarnation still holds it, alive, after ``wait`` seconds.
        """
        leases = self._jobs.setdefault(job, {})
        ends = self.clock.monotonic() + wait
        while True:
            now = self._now()
            held = leases.get((role, rank))
            if held is None or held.incarnation == incarnation or not held.alive(now):
                break
            if now >= ends:
                raise LeaseHeldError(
                    f"{role} rank {rank} of job {job!r} is held by another live process ({held.describe(now)}): two "
                    f"processes claim the same rank (pid {pid} on {host or 'an unnamed host'} asked); check the rank "
                    "each process is given, or stop the other one first")
            # until the holder's lease would expire, unless it renews it meanwhile (then refuse)
            await asyncio.sleep(min(ends - now, held.ttl - held.age(now) + 0.01))
        took_over = held is not None and held.incarnation != incarnation
        if release:
            if held is not None and not took_over:
                held.released = True
            return False
        leases[(role, rank)] = Lease(incarnation, ttl, pid, host, self._now())
        return took_over

    def table(self, job: str) -> list[LeaseRow]:
        """Every lease of ``job``: who holds it, whether it is alive, seconds since its heartbeat."""
        now = self._now()
        return [LeaseRow(role, rank, lease.incarnation, lease.pid, lease.host, lease.ttl, round(lease.age(now), 3),
                         lease.alive(now), lease.released, lease.describe(now))
                for (role, rank), lease in sorted(self._jobs.get(job, {}).items())]

    def drop(self, job: str) -> None:
        self._jobs.pop(job, None)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self._jobs.values())
