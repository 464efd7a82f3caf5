"""Epochs: which try of a version every writer takes part in, decided by writer 0, and what a
restarted or failed rank may join. :class:`~weightsync.job.channel.JobChannel` inherits these methods.

An epoch numbers the job's connections: a failure or a restart moves the job to the next one,
and no rank joins an epoch whose connections may include a process that is gone (its floor,
``min_epoch``). docs/faults.md tells the rules; the fleet record (docs/fleet.md) is to replace them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync.job.keys import (
    epoch_key,
    joined_key,
    last_joined_key,
    min_epoch_key,
    version_epoch_key,
    version_layouts_key,
    writing_key,
)
from weightsync.job.parts import ChannelPart

if TYPE_CHECKING:
    from weightsync.clock.deadline import Deadline
    from weightsync.ports.coordinator import Holder


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
    #: writer 0: the version it recorded deciding last (:func:`~weightsync.job.keys.writing_key`)
    _writing: int

    if TYPE_CHECKING:
        def layout_generation(self) -> int: ...

        def lease_holders(self, *, max_age: float = 0.25) -> dict[tuple[str, int], Holder]: ...

    def current_epoch(self) -> int:
        epoch: int = self.meta.counter(epoch_key())
        return epoch

    def advance_epoch(self, seen: int) -> int:
        """Move the job past epoch ``seen``: one compare-and-set on the server, so of ranks that
        saw the same epoch fail only one moves it, and a rank that saw an older epoch never
        moves it back. Returns the job's epoch now."""
        epoch = self._advance(seen)
        if epoch > self.min_epoch:
            self.min_epoch = epoch
            self._publish_min_epoch()
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
        self._publish_min_epoch()

    def _after_predecessor(self, seen: int) -> int:
        """The epoch after the newest one this rank's dead predecessor joined (writers; else ``seen``)."""
        if self.role != "writer":
            return seen
        record = self.meta.get_document(last_joined_key(self.rank))
        incarnation, _, epoch = (record or b"").decode().partition(" ")
        if not epoch.isdigit() or incarnation == self.incarnation:
            return seen
        return int(epoch) + 1

    def _mark_joined(self, version: int, epoch: int) -> None:
        """This process's mark on the try (:meth:`decide_epoch`), and its newest epoch (:meth:`rejoin`)."""
        self.meta.put_document(joined_key(version, epoch, self.rank), self.incarnation.encode())
        if epoch > self._last_joined:
            self.meta.put_document(last_joined_key(self.rank), f"{self.incarnation} {epoch}".encode())
            self._last_joined = epoch

    def _publish_min_epoch(self) -> None:
        """Say which epochs this process still takes part in, so that a writer waiting for it to
        publish in an older one stops waiting (:meth:`wait_readers`)."""
        if self.role == "writer":
            self.meta.put_document(min_epoch_key(self.role, self.rank), f"{self.incarnation} {self.min_epoch}".encode())

    def decide_epoch(self, version: int, deadline: Deadline) -> int:
        """Writer 0 fixes the epoch each try of ``version`` is written in; the other writers wait
        for a decision no older than their :attr:`min_epoch`.

        One decision per try means writers never publish different epochs, even when a
        failure report or a restarted rank advances the job's epoch concurrently; and a writer
        that failed a version, or restarted, never joins the epoch it saw fail (whose
        connections include dead processes) but waits for writer 0's next decision.

        A restarted writer (:attr:`restarted`) joins a version in an epoch from its floor on
        (:meth:`rejoin`), unless its dead predecessor joined the version in that very epoch (each
        writer leaves a "joined" mark): so an epoch writer 0 decided just before the restarted
        rank advanced the job's epoch still completes.

        A writer waiting for writer 0 to start ``version`` stops as soon as writer 0 started a
        newer one (a restarted rank's trainer writing its failed step again while writer 0's went
        on): writer 0 never comes back to it, and the next write joins writer 0's version.

        Raises:
            VersionSupersededError: writer 0 writes a newer version.
            TimeoutError: writer 0 did not start ``version`` (in a recent enough epoch) in time.
        """
        key = version_epoch_key(version)  # a counter holding the decided epoch + 1 (0: undecided)
        if self.role == "writer" and self.rank == 0:
            generation = self.layout_generation()
            epoch = max(self.current_epoch(), self.min_epoch)
            if generation != self._decided_generation:  # a rank's layout changed: every rank re-plans,
                epoch = max(self.advance_epoch(epoch), epoch)  # and its transport connects anew
            held = int(self.meta.counter(key))
            decided = max(epoch, held - 1)
            # marked before the decision is visible, so a peer never sees it without the mark
            self._mark_joined(version, decided)
            if held < epoch + 1:  # only writer 0 sets it
                if generation:
                    self.meta.put_document(version_layouts_key(version, epoch), str(generation).encode())
                self.meta.compare_and_set(key, expected=held, value=epoch + 1)
            if self._writing != version:  # after the decision: a writer that sees it finds the decision
                self.meta.put_document(writing_key(), f"{self.incarnation} {version}".encode())
                self._writing = version
            self._decided_generation = generation
            return decided
        oldest = self.min_epoch
        while True:
            held = self._wait_decision(version, oldest + 1, deadline)
            if held < oldest + 1:
                raise TimeoutError(f"{self.who}: writer 0 did not start version {version} in epoch {oldest} or "
                                   "later in time" + (f" (it decided epoch {held - 1}, before this writer joined "
                                                      "or failed)" if held else ""))
            joined = joined_key(version, held - 1, self.rank)
            if self.restarted and self.meta.get_document(joined) is not None:
                oldest = held  # this rank's dead predecessor joined the version in that epoch: wait for the next
                continue
            self._mark_joined(version, held - 1)
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
        between slices of half a lease whether writer 0 went on to a newer version."""
        key = version_epoch_key(version)
        while True:
            left = deadline.remaining(0.0)
            step = left if self.lease_seconds <= 0 else min(left, max(self.lease_seconds / 2, 0.1))
            held = int(self.meta.counter(key, at_least=at_least, wait=step))
            if held >= at_least or deadline.expired:
                return held
            writing = self._writer_0_writes()
            if writing is not None and writing > version:
                raise VersionSupersededError(
                    f"{self.who}: writer 0 writes version {writing} now, so version {version} is superseded: "
                    "writer 0 will not start it again (this rank's trainer writes an older step than writer 0's, "
                    "as a restarted rank does when it retries its failed step); its next write joins writer 0")

    def _writer_0_writes(self) -> int | None:
        """The version writer 0's live process decided an epoch for last; None when writer 0 is
        dead or restarted since (a job restarted from a checkpoint writes older versions again)."""
        incarnation, _, version = (self.meta.get_document(writing_key()) or b"").decode().partition(" ")
        holder = self.lease_holders(max_age=0.0).get(("writer", 0)) if version.isdigit() else None
        return int(version) if holder is not None and holder.incarnation == incarnation else None


__all__ = ["Epochs", "VersionSupersededError"]
