"""The readers' side of the job channel: their reports, and a writer's waits on them.

A reader reports each version it applied or failed; a writer waits until its readers are done
with a version: every one of them (``completion="all"``, :meth:`ReaderWaits.wait_readers`), or
as many as the job's completion policy needs (:meth:`ReaderWaits.wait_completion`, decided by
:func:`weightsync.job.completion.judge`). Both ask the meta server to hold the request until
enough readers reported (a long-poll, no timer) and look at the readers' leases once per lease
period, so that a dead reader is named within one lease instead of waited for.
:class:`~weightsync.job.channel.JobChannel` inherits these methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

import msgpack

from weightsync.job.completion import Completion, judge
from weightsync.job.keys import completions_key
from weightsync.job.parts import ChannelPart
from weightsync.meta import client_base

if TYPE_CHECKING:
    from weightsync.clock.deadline import Deadline
    from weightsync.ports.fleet.policy import Policy

logger = logging.getLogger("weightsync.job.channel")


class ReaderWaits(ChannelPart):
    """The reader part of :class:`~weightsync.job.channel.JobChannel` (which sets these attributes)."""

    if TYPE_CHECKING:
        def _wait_published(self, version: int, epoch: int, writers: int, deadline: Deadline) -> None: ...

    def report_applied(self, version: int, *, nbytes: int, seconds: float) -> None:
        """This reader now serves ``version``."""
        self.meta.report_applied(self.rank, version, nbytes=nbytes, seconds=seconds)

    def reader_lag(self, version: int, readers: int) -> int:
        """How many versions the slowest of reader ranks ``0..readers-1`` is behind ``version``
        (a reader at no valid version counts as ``version`` behind)."""
        held = self.meta.reader_versions()
        return max((version - (held.get(r) or 0) for r in range(readers)), default=0)

    def report_failed(self, version: int, error: str, *, epoch: int | None = None, invalid: bool = True,
                      holds: int | None = None) -> None:
        """This reader failed ``version`` (published in ``epoch``): its engine is ``invalid`` (a mix of
        versions) until the next version (or this one, written again in a later epoch), or, when
        the failure never touched it, still serves ``holds`` (None: what it started with)."""
        self.meta.report_failed(self.rank, version, error[:2000], epoch=epoch, invalid=invalid, holds=holds)

    def wait_readers(self, *, min_version: int, readers: int, deadline: Deadline,
                     epoch: int | None = None, writers: int = 0,
                     absent: AbstractSet[int] = frozenset()) -> dict[int, str]:
        """Until reader ranks ``0..readers-1`` but ``absent`` (seats of an elastic set that the plan
        has no reader for) are done with ``min_version`` (applied or failed it, or newer, or died:
        their lease expired). Returns the readers that failed it: rank -> the error each reported,
        or how it died.

        With ``epoch`` (the epoch this writer published ``min_version`` in), first until the
        version is published in that epoch by every writer: until then the readers' failures of
        the version are those of an earlier epoch (the server clears them when the new one
        completes), and a writer that restarted faster than its peers must not take them for its own.

        Raises:
            TimeoutError: naming the laggards (or the epoch in which no one completed the version).
            PeerDiedError: another of the ``writers`` can no longer publish its part in ``epoch``
                (:meth:`_gone_from_try`).
        """
        if epoch is not None:
            self._wait_published(min_version, epoch, writers, deadline)
        said = time.monotonic()
        dead: dict[int, str] = {}  # dead readers behind min_version: waited for no more
        present = readers - len(absent)
        extra = 0  # absent seats the last report counts as settled (the server counts every seat)
        while True:
            # In slices of a lease, so that a reader that died is reported as such, not waited for.
            step = deadline.remaining() if self.lease_seconds <= 0 else min(deadline.remaining(), self.lease_seconds)
            try:
                report = self.meta.wait_reader_report(min_version=min_version, readers=readers, timeout=step,
                                                      settled=(present - len(dead) + extra) if dead or absent else None)
            except TimeoutError as exc:
                if time.monotonic() - said >= client_base.PROGRESS_SECONDS and not deadline.expired:
                    said = time.monotonic()
                    logger.info("%s: still waiting for the readers of version %d; %.0f s left (%s)", self.who,
                                min_version, deadline.remaining(0.0), str(exc).split("; ", 1)[-1])
                dead = self._dead_readers_behind(min_version, readers, absent)
                if deadline.expired:
                    raise
                continue
            settled = set(report.settled(min_version, readers))
            extra = len(settled & absent)
            settled -= absent
            # the dead that are still behind (a restart of one may have applied it since, in place
            # of a live reader still at it: then wait on for that one)
            dead = {r: why for r, why in dead.items() if r not in settled}
            if len(settled) + len(dead) < present:
                continue
            failed = {r: why for r, why in report.failed(min_version, readers).items() if r not in absent}
            failed.update(dead)
            return failed

    def _dead_readers_behind(self, min_version: int, readers: int, absent: AbstractSet[int]) -> dict[int, str]:
        """Reader ranks below ``readers`` but ``absent`` whose lease expired before they were done
        with ``min_version``."""
        dead = self.dead_peers("reader", [r for r in range(readers) if r not in absent], max_age=0.0)
        if not dead:
            return {}
        report = self.meta.wait_reader_report(min_version=min_version, readers=0, timeout=0.0)
        settled = set(report.settled(min_version, readers))
        return {r: f"died before it applied version {min_version}: {why}" for r, why in dead.items()
                if r not in settled}

    def record_completions(self, completions: Sequence[Completion]) -> None:
        """Post the newest versions' completions (writer 0's, oldest first) for the status page
        and /metrics (:data:`~weightsync.ports.fleet.policy.COMPLETIONS_KEY`)."""
        self.meta.put_document(completions_key(), msgpack.packb([c.to_wire() for c in completions],
                                                                use_bin_type=True))

    def wait_completion(self, policy: Policy, *, min_version: int, readers: int, deadline: Deadline,
                        epoch: int | None = None, writers: int = 0, absent: AbstractSet[int] = frozenset()
                        ) -> Completion:
        """Until ``min_version`` is decided under ``policy`` (:mod:`weightsync.job.completion`):
        complete as soon as enough of reader ranks ``0..readers-1`` but ``absent`` applied it, failed
        as soon as too few are left that may still apply it (a dead reader is out of the count
        within one lease), or at the deadline. ``epoch``, ``writers`` and ``absent`` as in
        :meth:`wait_readers`.

        Raises:
            PeerDiedError: as :meth:`wait_readers`.
        """
        if epoch is not None:
            self._wait_published(min_version, epoch, writers, deadline)
        seats = [r for r in range(readers) if r not in absent]
        needed = max(1, policy.needed(len(seats)))
        dead: dict[int, str] = {}
        behind = 0  # dead readers not done with the version: waited for no more
        extra = (0, 0)  # absent seats the last report counts as settled, and as applied
        while True:
            step = deadline.remaining(0.0) if self.lease_seconds <= 0 else min(deadline.remaining(0.0),
                                                                                self.lease_seconds)
            try:
                report = self.meta.wait_reader_report(min_version=min_version, readers=readers, timeout=step,
                                                      settled=len(seats) - behind + extra[0],
                                                      applied=needed + extra[1])
            except TimeoutError:
                report = self.meta.wait_reader_report(min_version=min_version, readers=0, timeout=0.0)
                dead = self.dead_peers("reader", seats, max_age=0.0)
            # from this report, so that the long-poll's condition and the verdict agree (no busy loop)
            settled = set(report.settled(min_version, readers))
            behind = len(set(dead) - settled)
            extra = (len(settled & absent), len(set(report.applied(min_version, readers)) & absent))
            verdict = judge(policy, min_version, readers=readers, report=report, dead=dead,
                            expired=deadline.expired, absent=absent)
            if verdict.state == "complete" and "still applying" in verdict.missed.values() and not dead:
                # say which of those the quorum left behind are dead (one lease read, on a miss only)
                dead = self.dead_peers("reader", seats, max_age=0.0)
                verdict = judge(policy, min_version, readers=readers, report=report, dead=dead, absent=absent)
            if verdict.state != "waiting":
                return verdict


__all__ = ["ReaderWaits"]
