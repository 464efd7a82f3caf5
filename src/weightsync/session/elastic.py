"""An elastic set of readers (``SyncConfig(num_readers=None)``): engines join and leave a running job.

A fixed job waits for ``num_readers`` readers before it plans, and its plan is for them. An
elastic job plans each version for the readers that had *joined* when writer 0 started it:

* **Seats.** A reader's rank is its seat, any of ``0..MAX_READER_SEATS-1``. One live process
  holds a seat at a time (its lease); a replacement engine takes the seat of the one it
  replaces, a new engine a new seat. Seats are counted from 0 (``reader_count`` is the highest
  seat joined, plus one), so an operator who adds engines gives them the next seats.
* **Joining** is a layout change of the job (:meth:`~weightsync.job.channel.JobChannel.publish_layout`):
  once registered, a reader publishes its layout as its join, which moves the job's layout
  generation on. Writer 0 plans its next version at that generation, and every writer and
  reader follows it (a new epoch: transports connect anew).
* **The newest version at once.** A reader that joined takes its first version without waiting
  for the next one: it plans its share of the newest version as if it had been there when that
  version was planned (:func:`same_setup`), and reads it from the writers' slots. That works when
  the writers expose every piece it needs, as for a replica of a reader already in the job;
  otherwise the version fails on it (shm and NIXL pull find a missing piece as they bind,
  before a byte lands; file as it reads) and it takes the next, planned for it.
* **Leaving**, cleanly (its lease released) or by dying or stalling (its lease expired), ends
  the join: before it decides each version, writer 0 records a leave for every joined reader
  whose lease ended (:meth:`~weightsync.job.channel.JobChannel.drop_departed_readers`, one
  layout change each), so the version is planned without it. The policy (``all``,
  ``quorum=K``, ``fraction=F``) counts the readers of the version's plan (:func:`absent`
  seats are not counted). A leave names the join it ends, so a process that took the seat and
  joined since stays. A reader that finds itself left out while alive (it stalled past its
  lease) joins again and takes the next version planned for it; it never claims a version
  planned without it.
* Writers wait for the first join before they plan (a plan for no reader exposes nothing).

Only the one-sided transports carry it (shm, file, NIXL in pull mode): the others, whose
writers connect to every reader themselves, are refused for an elastic set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from weightsync.clock.deadline import Deadline
from weightsync.job.channel import JobChannel
from weightsync.job.wire import Member
from weightsync.session.config import MAX_READER_SEATS


def check_seat(rank: int) -> None:
    """Raises ValueError for a reader rank that is no seat of an elastic set."""
    if not 0 <= rank < MAX_READER_SEATS:
        raise ValueError(f"reader rank {rank} is no seat of an elastic set of readers (num_readers=None): seats are "
                         f"0..{MAX_READER_SEATS - 1}; give a new engine the next free seat")


def first_join(channel: JobChannel, deadline: Deadline, *, poll: float = 0.05) -> int:
    """The job's layout generation once at least one reader joined (a writer's first plan waits for it).

    Raises:
        TimeoutError: no reader joined by the deadline.
    """
    step = 0.0
    while (generation := channel.layout_generation()) < 1:
        if deadline.expired:
            raise TimeoutError(f"{channel.who}: no reader joined the job in time (num_readers=None: the writers plan "
                               "for the readers that joined)")
        step = min(max(step * 2, poll), 1.0, deadline.remaining(0.0))
        time.sleep(step)
    return generation


def same_setup(published: str, planned: str) -> bool:
    """Whether two sync fingerprints (``<plan>-<transport and its settings>``) agree on all but the
    plan: a reader that joined after a version was planned adopts it only then."""
    return published.rpartition("-")[2] == planned.rpartition("-")[2]


def reader_count(people: Sequence[Member]) -> int:
    """How many reader seats a roster spans: the highest reader rank in it, plus one (0: none)."""
    return 1 + max((m.rank for m in people if m.role == "reader"), default=-1)


def absent(people: Sequence[Member]) -> frozenset[int]:
    """The seats below :func:`reader_count` that no reader of the roster holds (never joined, or
    left): the waits count the others only."""
    present = {m.rank for m in people if m.role == "reader"}
    return frozenset(set(range(reader_count(people))) - present)


__all__ = ["MAX_READER_SEATS", "absent", "check_seat", "first_join", "reader_count", "same_setup"]
