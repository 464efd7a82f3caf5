"""Liveness on the job channel: this rank's lease, renewed by a heartbeat, and its peers' leases.

A rank with a lease (``lease_seconds > 0``) renews it from a daemon thread
(:class:`~weightsync.job.heartbeat.Heartbeat`); a peer whose lease expired or was released,
or whose rank a restarted process holds now, is dead (:meth:`Liveness.dead_peers`).
:class:`~weightsync.job.channel.JobChannel` inherits these methods.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from weightsync.plan.ops import Role
from weightsync.ports.coordinator import Holder, MetaPort

if TYPE_CHECKING:
    from weightsync.job.heartbeat import Heartbeat
    from weightsync.ports.records import LeaseRow


class Liveness:
    """The lease part of :class:`~weightsync.job.channel.JobChannel` (which sets these attributes)."""

    meta: MetaPort
    role: Role
    rank: int
    incarnation: str
    lease_seconds: float
    host: str
    _heartbeat: Heartbeat | None
    _lease_cache: tuple[float, dict[tuple[str, int], LeaseRow]]

    if TYPE_CHECKING:
        @property
        def who(self) -> str: ...

    def start_heartbeat(self) -> None:
        """Keep this rank's lease alive from a background thread (after :meth:`register`)."""
        if self.lease_seconds > 0 and self._heartbeat is None:
            from weightsync.job.heartbeat import Heartbeat

            self._heartbeat = Heartbeat(self)

    def stop_heartbeat(self, *, release: bool = True) -> None:
        """Stop renewing the lease; ``release`` tells peers this rank left (it did not die)."""
        beat, self._heartbeat = self._heartbeat, None
        if beat is not None:
            beat.stop(release=release)

    def renew_lease(self, *, release: bool = False) -> None:
        """Renew this rank's lease (or, with ``release``, give it up: the rank left, it did not die).

        Raises:
            ValueError: another process holds the rank now.
        """
        self.meta.acquire_lease(self.role, self.rank, incarnation=self.incarnation, ttl=self.lease_seconds,
                                pid=os.getpid(), host=self.host, release=release)

    @property
    def lost(self) -> str | None:
        """Why this rank can no longer take part (another process took its rank over), or None."""
        return self._heartbeat.lost if self._heartbeat is not None else None

    def dead_peers(self, role: Role, ranks: Iterable[int], *, max_age: float = 0.25,
                   known: Mapping[tuple[str, int], Holder] | None = None, departed: bool = True) -> dict[int, str]:
        """Peers of ``role`` among ``ranks`` whose lease expired or was released: rank -> what the
        meta server knows of them. Peers without a lease count as alive. Answers are cached for
        ``max_age`` seconds, so transports may ask from their wait loops.

        ``departed=False`` leaves out peers that released their lease (they left on purpose):
        for a rank that exchanges no bytes with them, a clean leave is not a death.

        With ``known`` (:meth:`lease_holders` when this rank's connections were made), a peer
        whose lease a *restarted* process holds now is dead too: the process this rank is
        connected to is gone. A restart takes the lease over the moment it expires, so without
        this a peer that restarts quickly is never seen dead.
        """
        rows = self._leases(max_age)
        dead = {}
        for r in ranks:
            row = rows.get((role, r))
            if row is None:
                continue
            was = known.get((role, r)) if known is not None else None
            if not row.alive:
                if departed or not row.released:
                    dead[r] = row.detail
            elif was is not None and was.incarnation != row.incarnation:
                dead[r] = (f"its process (pid {was.pid} on {was.host or 'an unnamed host'}) is gone: a restarted one "
                           f"holds the rank now ({row.detail})")
        return dead

    def lease_holders(self, *, max_age: float = 0.25) -> dict[tuple[str, int], Holder]:
        """Who holds each live lease now (to tell, later, a peer that restarted: :meth:`dead_peers`),
        cached as :meth:`dead_peers` is."""
        return {key: Holder(row.incarnation, row.pid, row.host) for key, row in self._leases(max_age).items()
                if row.alive}

    def _leases(self, max_age: float) -> dict[tuple[str, int], LeaseRow]:
        """Every lease, by (role, rank), asked of the server at most every ``max_age`` seconds."""
        at, rows = self._lease_cache
        now = time.monotonic()
        if now - at > max_age:
            rows = {(row.role, row.rank): row for row in self.meta.leases()}
            self._lease_cache = (now, rows)
        return rows
