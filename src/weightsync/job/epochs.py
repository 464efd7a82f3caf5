"""Epochs: which try of a version every writer takes part in, decided by writer 0, and what a
restarted or failed rank may join. :class:`~weightsync.job.channel.JobChannel` inherits these methods.

An epoch numbers the job's connections: a failure or a restart moves the job to the next one,
and no rank joins an epoch whose connections may include a process that is gone (its floor,
``min_epoch``). docs/faults.md tells the rules; the fleet record (docs/fleet.md) is to replace them.

**Seats.** Each writer has one seat per epoch, a counter on the coordinator: *open*, *taken* by
the process that joined a try there (its :func:`seat_mark`), *closed* by a peer, or *left* by the
writer itself. Taking and closing are each one compare-and-set from open, so of a dead writer's
restart taking its seat and a peer closing it out of the epoch (the writer had no live process
when the peer waited for it) exactly one wins: either the restart is in the epoch and is waited
for, or the epoch fails at once, naming the dead writer, and its restart takes part from a later
epoch. No rank waits for a dead writer's possible restart until its timeout (issue 36). A writer
whose floor rises past epochs (it saw one fail, or it restarted) leaves its seats below the
floor, so a peer waiting for it there stops at once. The seat is the one record of who is in an
epoch: it replaced the per-version "joined" marks and the ``floors/`` documents.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING

from weightsync.job.keys import (
    epoch_key,
    last_joined_key,
    seat_key,
    version_epoch_key,
    version_layouts_key,
    writing_key,
)
from weightsync.job.parts import ChannelPart

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from weightsync.clock.deadline import Deadline
    from weightsync.plan.ops import Role
    from weightsync.ports.coordinator import Holder
    from weightsync.ports.records import LeaseRow

logger = logging.getLogger("weightsync.job.channel")

#: a writer's seat in an epoch (:func:`~weightsync.job.keys.seat_key`) before anyone took or closed it
SEAT_OPEN = 0
#: the seat of a writer closed out of the epoch: it had no live process when a peer waited for it
SEAT_CLOSED = 1
#: the seat of a writer that left the epoch: it saw it fail, or restarted, before it joined a try there
SEAT_LEFT = 2
#: how many epochs below its new floor a writer leaves its seats in (older ones are long decided)
LEAVE_WINDOW = 16


def seat_mark(incarnation: str) -> int:
    """The value of a seat taken by the process ``incarnation``: 56 bits of its hash, above the
    three reserved values (a counter holds an int, not the incarnation's text)."""
    return 3 + int.from_bytes(hashlib.blake2b(incarnation.encode(), digest_size=7).digest(), "big")


class VersionSupersededError(TimeoutError):
    """Writer 0's live process writes a newer version than the one this writer waits for it to
    start: it will not start that one again. A TimeoutError, so that every caller that gives a version up when its
    wait for writer 0 ends gives it up on this too, at once instead of at its deadline."""


class Epochs(ChannelPart):
    """The epoch part of :class:`~weightsync.job.channel.JobChannel` (which sets these attributes)."""

    #: this process's claim on (role, rank): a restarted process has a new one
    incarnation: str
    #: the oldest epoch this rank may take part in (see :meth:`rejoin`, :meth:`advance_epoch`)
    min_epoch: int
    #: this process replaced a dead one (registration found an earlier incarnation)
    restarted: bool
    #: the layout generation writer 0 last decided a version with
    _decided_generation: int
    #: the newest epoch this process joined a try in
    _last_joined: int
    #: the version this writer recorded writing last (:func:`~weightsync.job.keys.writing_key`)
    _writing: int

    if TYPE_CHECKING:
        def layout_generation(self) -> int: ...

        def dead_peers(self, role: Role, ranks: Iterable[int], *, max_age: float = 0.25,
                       known: Mapping[tuple[str, int], Holder] | None = None,
                       departed: bool = True) -> dict[int, str]: ...

        def _leases(self, max_age: float) -> dict[tuple[str, int], LeaseRow]: ...

    def current_epoch(self) -> int:
        epoch: int = self.meta.counter(epoch_key())
        return epoch

    def advance_epoch(self, seen: int) -> int:
        """Move the job past epoch ``seen``: one compare-and-set on the server, so of ranks that
        saw the same epoch fail only one moves it, and a rank that saw an older epoch never
        moves it back. Returns the job's epoch now."""
        epoch = self._advance(seen)
        if epoch > self.min_epoch:
            old, self.min_epoch = self.min_epoch, epoch
            self._leave_epochs(old, epoch)
        return epoch

    def _advance(self, seen: int) -> int:
        _, epoch = self.meta.compare_and_set(epoch_key(), expected=seen, value=seen + 1)
        return int(epoch)

    def rejoin(self) -> None:
        """This process replaced a dead one of its rank: move the job past the epoch it finds
        (the others' connections do not include it), and take part in versions of that epoch
        or later that its predecessor did not join (see :meth:`decide_epoch`): an epoch writer 0
        decided just before this advance is fine, the one the predecessor died in is not.

        A writer may take part from the epoch after the newest its predecessor joined a try in
        (:func:`~weightsync.job.keys.last_joined_key`), if older: no connection of a later epoch
        includes the predecessor, and writer 0 may have decided the next version in one before
        the restarts (a reader's too) moved the job's epoch; it waited there for this writer,
        and this writer for a newer decision, until their timeouts."""
        seen = self.current_epoch()
        self._advance(seen)
        self.restarted, self.min_epoch = True, min(seen, self._after_predecessor(seen))
        self._leave_epochs(0, self.min_epoch)

    def _after_predecessor(self, seen: int) -> int:
        """The epoch after the newest one this rank's dead predecessor joined (writers; else ``seen``)."""
        if self.role != "writer":
            return seen
        record = self.meta.get_document(last_joined_key(self.rank))
        incarnation, _, epoch = (record or b"").decode().partition(" ")
        if not epoch.isdigit() or incarnation == self.incarnation:
            return seen
        return int(epoch) + 1

    def _take_seat(self, epoch: int) -> bool:
        """Take this writer's seat in ``epoch`` (it joins a try there, see module docstring): True
        if this process holds it now; False if its dead predecessor took it or a peer closed it
        out of the epoch, and it must wait for a try in a later one. Records the newest epoch this
        process joined (:meth:`rejoin`)."""
        mine = seat_mark(self.incarnation)
        done, held = self.meta.compare_and_set(seat_key(epoch, self.rank), expected=SEAT_OPEN, value=mine)
        if not done and int(held) != mine:
            return False
        if epoch > self._last_joined:
            self.meta.put_document(last_joined_key(self.rank), f"{self.incarnation} {epoch}".encode())
            self._last_joined = epoch
        return True

    def writers_out_of_epoch(self, epoch: int, ranks: Iterable[int]) -> dict[int, str]:
        """The writers of ``ranks`` that will never take part in ``epoch``: rank -> why (one read of
        the lease table for all of them, however many a transport waits on).

        A writer with no live process that has not taken its seat there is closed out of the epoch
        now (module docstring): a transport or a writer waiting for it then fails the epoch at
        once, naming it, instead of waiting for a restart that, since the seat is closed, joins
        only a later epoch. Writers without a lease (none in the job) are left out: liveness is
        then the transports' business. Writer 0 also counts a writer whose trainer went on to a
        newer version than the one it writes (:meth:`_out_of_epoch`)."""
        rows = self._leases(0.0)
        writing = self._writing if self.role == "writer" and self.rank == 0 and self._writing >= 0 else None
        out = {}
        for rank in ranks:
            row = rows.get(("writer", rank))
            why = None if row is None else self._out_of_epoch(epoch, rank, row, writing)
            if why is not None:
                out[rank] = why
        return out

    def _out_of_epoch(self, epoch: int, rank: int, row: LeaseRow, version: int | None = None) -> str | None:
        """:meth:`writers_out_of_epoch` for the lease ``row`` read of writer ``rank``; with ``version``
        (the version whose try this writer waits on: any writer's wait for the others' parts, writer
        0's in the transports) also a writer whose trainer went on to a newer version: it will never
        write this one, and the waiting writer gives it up (its next write joins)."""
        if version is not None:
            ahead = self._writes(rank, row)
            if ahead is not None and ahead > version:
                return (f"it writes version {ahead} now, so version {version} is superseded (this rank's trainer "
                        f"writes an older step than writer {rank}'s, as when it retries a failed step while the "
                        "others went on); the next write joins it")
        key = seat_key(epoch, rank)
        held = int(self.meta.counter(key))
        if held == SEAT_OPEN and not row.alive:
            closed, held = self.meta.compare_and_set(key, expected=SEAT_OPEN, value=SEAT_CLOSED)
            held = int(held)
            if closed:
                logger.info("%s: writer %d is out of epoch %d: no live process (%s)", self.who, rank, epoch, row.detail)
                return (f"it has no live process ({row.detail}) and never joined epoch {epoch}: it is out of that "
                        "epoch, and its restart takes part from a later one")
        if held == SEAT_CLOSED:
            return (f"it was closed out of epoch {epoch}: it had no live process before it joined a try there "
                    f"(now: {row.detail})")
        if held == SEAT_LEFT:
            return (f"its process ({row.detail}) left epoch {epoch}: it takes part only in later epochs (it saw an "
                    "epoch fail, or restarted, after writer 0 decided this one)")
        if held != SEAT_OPEN:
            if not row.alive:
                return f"the process that joined it died ({row.detail})"
            if held != seat_mark(row.incarnation):
                return f"the process that joined it is gone: a restarted one holds the rank now ({row.detail})"
        return None

    def _wait_writers_live(self, writers: int, version: int, deadline: Deadline) -> None:
        """Writer 0 starts a version only once every writer has a live process (a fixed set of
        writers: a try without one of them could never be published). Waits for a dead writer's
        restart until ``deadline``, naming it in the log at once and in the error at the end."""
        if self.lease_seconds <= 0 or writers <= 1:
            return
        said = False
        while True:
            dead = self.dead_peers("writer", range(1, writers), max_age=0.0)
            if not dead:
                return
            missing = "; ".join(f"writer {r}: {why}" for r, why in sorted(dead.items()))
            if deadline.expired:
                raise TimeoutError(f"{self.who}: version {version} was not started: a writer has no live process "
                                   f"and no restart of it came in time ({missing})")
            if not said:
                logger.warning("%s: version %d waits for a writer's restart (%s)", self.who, version, missing)
                said = True
            time.sleep(min(deadline.remaining(0.0), max(self.lease_seconds / 4, 0.05)))

    def _leave_epochs(self, first: int, last: int) -> None:
        """This writer takes part in no epoch below ``last`` any more: leave its seats in
        ``first..last-1`` (the newest :data:`LEAVE_WINDOW` of them), open or taken by this process,
        so that a peer waiting for it there stops at once (:meth:`writers_out_of_epoch`)."""
        if self.role != "writer":
            return
        mine = seat_mark(self.incarnation)
        for epoch in range(max(first, last - LEAVE_WINDOW), last):
            key = seat_key(epoch, self.rank)
            done, held = self.meta.compare_and_set(key, expected=SEAT_OPEN, value=SEAT_LEFT)
            if not done and int(held) == mine:
                self.meta.compare_and_set(key, expected=mine, value=SEAT_LEFT)

    def decide_epoch(self, version: int, deadline: Deadline, *, writers: int = 0) -> int:
        """Writer 0 fixes the epoch each try of ``version`` is written in; the other writers wait
        for a decision no older than their :attr:`min_epoch`.

        One decision per try means writers never publish different epochs, even when a
        failure report or a restarted rank advances the job's epoch concurrently; and a writer
        that failed a version, or restarted, never joins the epoch it saw fail (whose
        connections include dead processes) but waits for writer 0's next decision.

        Every writer takes its seat in the epoch it joins (module docstring). A restarted writer
        joins a version in an epoch from its floor on (:meth:`rejoin`), unless its dead
        predecessor took its seat there or a peer closed it out: so an epoch writer 0 decided just
        before the restarted rank advanced the job's epoch still completes, and one the peers gave
        up on it is never joined. With ``writers`` (the job's count), writer 0 first waits for every
        writer to have a live process (:meth:`_wait_writers_live`).

        A writer waiting for writer 0 to start ``version`` stops as soon as writer 0 started a
        newer one (a restarted rank's trainer writing its failed step again while writer 0's went
        on): writer 0 never comes back to it, and the next write joins writer 0's version.

        Raises:
            VersionSupersededError: writer 0 writes a newer version.
            TimeoutError: writer 0 did not start ``version`` (in a recent enough epoch) in time.
        """
        key = version_epoch_key(version)  # a counter holding the decided epoch + 1 (0: undecided)
        if self.role == "writer" and self.rank == 0:
            self._wait_writers_live(writers, version, deadline)
            generation = self.layout_generation()
            epoch = max(self.current_epoch(), self.min_epoch)
            if generation != self._decided_generation:  # a rank's layout changed: every rank re-plans,
                epoch = max(self.advance_epoch(epoch), epoch)  # and its transport connects anew
            held = int(self.meta.counter(key))
            if held:  # a retry of a version: did a writer's trainer go on meanwhile?
                self._check_not_behind(version, writers)
            decided = max(epoch, held - 1)
            # seated before the decision is visible, so a peer never sees it without the seat
            while not self._take_seat(decided):  # a dead predecessor's epoch: decide a later one
                epoch = decided = max(self.advance_epoch(decided), decided + 1)
            if held < epoch + 1:  # only writer 0 sets it
                if generation:
                    self.meta.put_document(version_layouts_key(version, epoch), str(generation).encode())
                self.meta.compare_and_set(key, expected=held, value=epoch + 1)
            self._record_writing(version)  # after the decision: a writer that sees it finds the decision
            self._decided_generation = generation
            return decided
        oldest = self.min_epoch
        while True:
            held = self._wait_decision(version, oldest + 1, deadline)
            if held < oldest + 1:
                raise TimeoutError(f"{self.who}: writer 0 did not start version {version} in epoch {oldest} or "
                                   "later in time" + (f" (it decided epoch {held - 1}, before this writer joined "
                                                      "or failed)" if held else ""))
            if not self._take_seat(held - 1):
                oldest = held  # its dead predecessor took its seat there, or it was closed out: wait for the next
                continue
            return held - 1

    def version_started(self, version: int, deadline: Deadline) -> bool:
        """Whether writer 0 has decided an epoch for ``version`` (in any epoch), waiting for it until
        ``deadline`` (``Deadline.after(0.0)``: only look).

        Raises:
            VersionSupersededError: writer 0 writes a newer version (see :meth:`decide_epoch`).
        """
        return self._wait_decision(version, 1, deadline) >= 1

    def _wait_decision(self, version: int, at_least: int, deadline: Deadline) -> int:
        """``version``'s epoch counter once it reaches ``at_least`` (else at the deadline), looking
        between slices of half a lease whether writer 0 went on to a newer version. Records first
        that this writer writes ``version``: a writer 0 retrying an older step gives that one up."""
        self._record_writing(version)
        key = version_epoch_key(version)
        while True:
            left = deadline.remaining(0.0)
            step = left if self.lease_seconds <= 0 else min(left, max(self.lease_seconds / 2, 0.1))
            held = int(self.meta.counter(key, at_least=at_least, wait=step))
            if held >= at_least or deadline.expired:
                return held
            writing = self._writes(0, self._leases(0.0).get(("writer", 0)))
            if writing is not None and writing > version:
                raise VersionSupersededError(
                    f"{self.who}: writer 0 writes version {writing} now, so version {version} is superseded: "
                    "writer 0 will not start it again (this rank's trainer writes an older step than writer 0's, "
                    "as a restarted rank does when it retries its failed step); its next write joins writer 0")

    def _record_writing(self, version: int) -> None:
        """Record the version this writer writes now (once per version), for the others' rules on
        superseded versions (:meth:`_wait_decision`, :meth:`_check_not_behind`)."""
        if self._writing != version:
            self.meta.put_document(writing_key(self.rank), f"{self.incarnation} {version}".encode())
            self._writing = version

    def writer_writes(self, rank: int) -> int | None:
        """The version writer ``rank``'s live process writes now, by a fresh read of its lease
        (see :meth:`_writes`); None without leases."""
        if self.lease_seconds <= 0:
            return None
        return self._writes(rank, self._leases(0.0).get(("writer", rank)))

    def _writes(self, rank: int, row: LeaseRow | None) -> int | None:
        """The version writer ``rank``'s live process writes now; None when it recorded none, or
        is dead or restarted since (a job restarted from a checkpoint writes older versions
        again). ``row``: its lease, freshly read (None: it holds none)."""
        if row is None or not row.alive:
            return None
        incarnation, _, version = (self.meta.get_document(writing_key(rank)) or b"").decode().partition(" ")
        return int(version) if version.isdigit() and row.incarnation == incarnation else None

    def _check_not_behind(self, version: int, writers: int) -> None:
        """Writer 0, about to try ``version`` again: raise if another writer's trainer went on to a
        newer version (it will never write this one; this rank's next write joins it).

        Raises:
            VersionSupersededError: naming the writer and its version.
        """
        rows = self._leases(0.0)
        for rank in range(1, writers):
            ahead = self._writes(rank, rows.get(("writer", rank)))
            if ahead is not None and ahead > version:
                raise VersionSupersededError(
                    f"{self.who}: writer {rank} writes version {ahead} now, so version {version} is superseded: "
                    f"writer {rank} will not write it again (this rank's trainer retries a step the others went "
                    "past); its next write joins them")


__all__ = ["Epochs", "VersionSupersededError"]
