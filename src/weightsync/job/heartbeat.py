"""A rank's heartbeat: a daemon thread renewing its lease on the meta server.

Each writer and reader holds the lease of its ``(role, rank)`` (:mod:`weightsync.meta.leases`)
while it takes part in a job, so that its peers learn within seconds that it died instead of
waiting for their full timeout. :class:`~weightsync.job.channel.JobChannel` starts one after it
registered (``start_heartbeat``) and stops it when the rank leaves::

    beat = Heartbeat(channel)       # renews every lease_seconds / 4
    beat.lost                       # why this rank no longer belongs to the job, or None
    beat.stop(release=True)         # left on purpose: peers see it released, not dead
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

logger = logging.getLogger(__name__)

#: Seconds leaving waits for a renewal in flight, and then for the release (see :meth:`Heartbeat.stop`)
STOP_PATIENCE = 0.8


class LeaseHolder(Protocol):
    """The rank a heartbeat renews the lease of (:class:`~weightsync.job.channel.JobChannel` is one)."""

    @property
    def role(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def who(self) -> str: ...

    @property
    def lease_seconds(self) -> float: ...

    def renew_lease(self, *, release: bool = False) -> None: ...


class Heartbeat:
    """A daemon thread renewing one rank's lease every quarter of its ttl (see :mod:`weightsync.meta.leases`).

    If the lease was taken over (the rank runs in another process now), the thread stops and
    :attr:`lost` says so; the rank's next ``write``/``update`` fails with that message.
    """

    def __init__(self, channel: LeaseHolder) -> None:
        self.channel = channel
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-heartbeat-{channel.role}{channel.rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.channel.lease_seconds / 4):
            try:
                self.channel.renew_lease()
            except ValueError as exc:  # another process holds the rank now
                self.lost = str(exc)
                logger.error("%s: %s", self.channel.who, exc)
                return
            except Exception as exc:  # the server is away (or lost its state): the next call says so
                logger.debug("%s: heartbeat failed: %s", self.channel.who, exc)

    def stop(self, *, release: bool, patience: float = STOP_PATIENCE) -> None:
        """Stop renewing and (``release``) give the lease up, within about ``2 * patience`` seconds.

        A call to a meta server that is gone retries for the client's whole timeout (30 s):
        a renewal in flight and the release are each waited for ``patience`` seconds at most,
        so that leaving never stalls whatever stopped first (the lease then expires on its own).
        """
        self._stop.set()
        self._thread.join(patience)
        if not release or self.lost is not None:
            return
        releasing = threading.Thread(target=self._release, name=f"{self._thread.name}-release", daemon=True)
        releasing.start()
        releasing.join(patience)
        if releasing.is_alive():
            logger.info("%s: the meta server did not take the release of its lease within %.1f s; it expires on "
                        "its own", self.channel.who, patience)

    def _release(self) -> None:
        try:
            self.channel.renew_lease(release=True)
        except Exception as exc:  # best effort: the lease expires anyway
            logger.debug("%s: could not release its lease: %s", self.channel.who, exc)
