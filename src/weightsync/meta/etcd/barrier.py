"""Registration and the barrier on etcd, as steps (:mod:`weightsync.meta.etcd.steps`): one round
trip to join, one wake-up per waiting rank, and no read of the whole roster by a waiter.

**Join.** A rank joins in one transaction: if its key does not exist yet, it puts its
registration, its layout blob and the barrier it is about to wait at (``barrier/W-R``), and reads
the registration counts (``count_only`` ranges), every known barrier, the stored roster and the
documents asked for. If the counts complete a known barrier whose roster is not stored, this
registration completed it: the rank reads every registration, encodes the columnar roster and
stores it in the one key ``part/roster``.

**Wait.** Every other rank watches ``part/roster`` from the revision of its join. The roster's
write wakes each waiter once, and the watch event carries the roster itself (with the counts it
was built from): a waiter decodes it without another read. A rank that asked for documents reads
them once more after the barrier (one small read), so that it sees the documents as of the
barrier, as the embedded server's answer shows them. A rank that waits without registering reads
the same state (and puts its barrier, when no rank announced it yet) before it watches.

A waiter that finds the barrier complete but no roster stored gives the rank that completed it
:data:`ROSTER_GRACE_SECONDS` to store it, then stores it itself (one build, not one per waiter).

No completion is missed: every transaction that puts a barrier reads the counts, and every
registration reads the barriers, each atomically and linearizably, so of a waiter's
announcement and the last registration the later one sees the other. A waiter also reads again
every :data:`~weightsync.meta.etcd.steps.PROGRESS_SECONDS` (and logs who is missing), as the
embedded server's client does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.clock.deadline import Deadline
from weightsync.meta import calls, rules, views, wire
from weightsync.meta.client_base import barrier_result, log_missing, logger
from weightsync.meta.etcd import ops
from weightsync.meta.etcd.ops import Row
from weightsync.meta.etcd.schema import JobKeys, load_job, pack_registration
from weightsync.meta.etcd.steps import PROGRESS_SECONDS, Request, Steps, Txn, Watch, commit, read, read_documents, watch
from weightsync.meta.events import Registered
from weightsync.meta.records import ParticipantTable, blob_hash, check_document_key
from weightsync.meta.reducer import Job, MetaData, apply
from weightsync.ports.records import Participant

#: a waiting rank names the missing ranks while at most this many registered (see :func:`log_waiting`)
NAME_MISSING_UP_TO = 256
#: a waiter that finds the barrier complete but no roster stored waits this long for the rank that
#: completed it to store it before it reads every registration itself (one build, not one per waiter)
ROSTER_GRACE_SECONDS = 1.0


@dataclass(slots=True)
class Seen:
    """What a barrier read sees: the counts, the stored roster if it is current, the documents
    asked for and the barriers ranks wait at."""

    writers: int
    readers: int
    table: ParticipantTable | None
    stored_at: int  # mod revision of the roster key (0: none stored)
    documents: dict[str, bytes | None] = field(default_factory=dict)
    barriers: list[tuple[int, int]] = field(default_factory=list)

    def reaches(self, writers: int, readers: int) -> bool:
        return self.writers >= writers and self.readers >= readers

    def completes_a_barrier(self) -> bool:
        return any(self.reaches(w, r) for w, r in self.barriers)


def state_reads(keys: JobKeys, documents: Sequence[str]) -> list[Request]:
    """The reads a barrier decides on: both counts, the known barriers, the stored roster, the documents."""
    return [ops.read(keys.part("writer"), prefix=True, count_only=True),
            ops.read(keys.part("reader"), prefix=True, count_only=True),
            ops.read(keys.barrier(), prefix=True), ops.read(keys.roster), *(ops.read(keys.doc(k)) for k in documents)]


def decode(keys: JobKeys, answers: list[dict[str, Any]], documents: Sequence[str]) -> Seen:
    """The answers of :func:`state_reads`, read at one revision."""
    found = {k: ops.rows_of(a) for k, a in zip(documents, answers[4:], strict=True)}
    barriers = [row.key.rsplit("/", 1)[1].split("-") for row in ops.rows_of(answers[2])]
    seen = Seen(ops.count_of(answers[0]), ops.count_of(answers[1]), None, 0,
                {k: rows[0].value if rows else None for k, rows in found.items()},
                [(int(w), int(r)) for w, r in barriers])
    stored: list[Row] = ops.rows_of(answers[3])
    if stored:
        seen.stored_at = stored[0].mod_revision
        writers, readers, roster = stored_roster(keys, stored[0])
        if (writers, readers) == (seen.writers, seen.readers):  # registrations never change: it is current
            seen.table = ParticipantTable.from_wire({**roster, "documents": seen.documents})
    return seen


def stored_roster(keys: JobKeys, row: Row) -> tuple[int, int, dict[str, Any]]:
    """The roster kept in ``part/roster``: (writers, readers it was built from, its wire form).

    Raises:
        ValueError: the key holds something else (names the key).
    """
    try:
        obj = wire.unpack(row.value)
        return int(obj["writers"]), int(obj["readers"]), dict(wire.unpack(obj["roster"]))
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"etcd key {row.key!r} holds a malformed roster ({exc!r}); only weightsync may write "
                         f"under {keys.root}") from None


def registration_puts(keys: JobKeys, p: Participant, job: Job | None) -> list[Request] | None:
    """The puts that register ``p`` (its row and its layout blob), given what is known of the job;
    None when it is registered with this data already.

    Raises:
        ValueError: the rank is registered with different data (names the fields).
    """
    try:
        events = rules.registration(job, keys.job, p.role, p.rank, group=p.group, host=p.host,
                                    endpoints=p.endpoints, layout=p.layout, at=time.time())
    except rules.ConflictError as exc:
        raise ValueError(str(exc)) from None
    if not events:
        return None
    state = Job(keys.job, created_at=0.0)
    for event in events:
        apply(MetaData({keys.job: state}), event)
    blob = next(e for e in events if isinstance(e, Registered)).layout
    return [ops.put(keys.part(p.role, p.rank), pack_registration(state.rows[p.role][p.rank])),
            ops.put(keys.blob(blob), bytes(p.layout))]


def register(keys: JobKeys, p: Participant, *, barrier: tuple[int, int] | None = None,
             documents: Sequence[str] = ()) -> Steps[tuple[bool, Seen, int]]:
    """Register ``p`` (idempotent), announcing ``barrier`` and reading the barrier state with it:
    (whether it was new, that state, its revision). See the module docstring.

    Raises:
        TypeError: ``p`` is not a :class:`~weightsync.ports.records.Participant`.
        ValueError: the rank is registered with different data (names the fields).
    """
    if not isinstance(p, Participant):
        raise TypeError(f"register takes a Participant(role, rank, group, host, endpoints, layout), not "
                        f"{type(p).__name__}")
    key, docs = keys.part(p.role, p.rank), [check_document_key(k) for k in documents]
    announce = [] if barrier is None else [ops.put(keys.barrier(*barrier), b"")]
    job: Job | None = None
    while True:
        puts = registration_puts(keys, p, job)
        if puts is None:
            seen, revision = yield from read_state(keys, docs, barrier)
            return False, seen, revision
        answer = yield from commit(Txn((ops.unchanged(key, 0),), (*puts, *announce, *state_reads(keys, docs)),
                                       (ops.read(key), ops.read(keys.blob(blob_hash(p.layout)))),
                                       what=f"register {p.role} {p.rank}"))
        if answer.ok:
            seen = decode(keys, answer.responses[len(puts) + len(announce):], docs)
            if seen.completes_a_barrier() and seen.table is None:  # this rank completed it: wake its waiters
                seen.table = yield from build(keys, seen, store=True, documents=docs)
            return True, seen, answer.revision
        job = load_job(keys, [row for r in answer.responses for row in ops.rows_of(r)])  # decide again


def read_state(keys: JobKeys, documents: Sequence[str], barrier: tuple[int, int] | None) -> Steps[tuple[Seen, int]]:
    """The barrier state and its revision; with ``barrier``, announced first if no rank did yet."""
    answers, revision = yield from read(*state_reads(keys, documents))
    seen = decode(keys, answers, documents)
    if barrier is None or barrier in seen.barriers:
        return seen, revision
    key = keys.barrier(*barrier)
    answer = yield from commit(Txn((ops.unchanged(key, 0),), (ops.put(key, b""), *state_reads(keys, documents)),
                                   tuple(state_reads(keys, documents)), what="announce a barrier"))
    return decode(keys, answer.responses[1:] if answer.ok else answer.responses, documents), answer.revision


def build(keys: JobKeys, seen: Seen, *, store: bool, documents: Sequence[str]) -> Steps[ParticipantTable]:
    """The roster read from every registration, with the documents (and, with ``store``, kept in
    the roster key unless another rank stored one since ``seen``: theirs is as good)."""
    answers, _ = yield from read(ops.read(keys.part("writer"), prefix=True), ops.read(keys.part("reader"), prefix=True),
                                 ops.read(keys.blob(), prefix=True), *(ops.read(keys.doc(k)) for k in documents))
    job = load_job(keys, [row for answer in answers[:3] for row in ops.rows_of(answer)])
    job.roster_revision = sum(len(r) for r in job.rows.values())
    encoded = views.encode_roster(keys.job, job, msgpack_=True)
    if store:
        value = wire.pack({"writers": len(job.rows["writer"]), "readers": len(job.rows["reader"]), "roster": encoded})
        yield from commit(Txn((ops.unchanged(keys.roster, seen.stored_at),), (ops.put(keys.roster, value),),
                              what="store the roster"))
    found = {k: ops.rows_of(a) for k, a in zip(documents, answers[3:], strict=True)}
    return ParticipantTable.from_wire({**wire.unpack(encoded),
                                       "documents": {k: r[0].value if r else None for k, r in found.items()}})


def table(keys: JobKeys, documents: Sequence[str] = ()) -> Steps[ParticipantTable]:
    """The roster (and the documents named in ``documents``: ``table.documents``)."""
    calls.roster(keys.job, documents=documents)  # checks the arguments
    docs = [check_document_key(k) for k in documents]
    seen, _ = yield from read_state(keys, docs, None)
    return seen.table or (yield from build(keys, seen, store=False, documents=docs))


def wait(keys: JobKeys, *, writers: int, readers: int, timeout: float, documents: Sequence[str] = (),
         joined: tuple[Seen, int] | None = None) -> Steps[ParticipantTable]:
    """Barrier: wait until ``writers`` writers and ``readers`` readers registered; the roster (and
    the documents named). ``joined``: the state the rank's registration read, and its revision.

    Raises:
        TimeoutError: naming the ranks still missing.
    """
    calls.roster(keys.job, writers=writers, readers=readers, documents=documents)  # checks the arguments
    docs, goal = [check_document_key(k) for k in documents], (writers, readers)
    deadline, said = Deadline.after(max(0.0, timeout)), time.monotonic()
    seen, revision = joined or (yield from read_state(keys, docs, goal))
    builds: Deadline | None = None  # when this rank stores the roster itself, if no one else did
    while True:
        complete = seen.reaches(writers, readers)
        if (complete and (seen.table is not None or (builds is not None and builds.expired))) or deadline.expired:
            break
        if complete and builds is None:  # the rank that completed it stores it; wait for that a little
            builds = Deadline.after(ROSTER_GRACE_SECONDS)
        elif not complete and time.monotonic() - said >= PROGRESS_SECONDS:
            said = time.monotonic()
            yield from log_waiting(keys, seen, writers, readers, deadline.remaining(0.0))
        seconds = min(deadline.remaining(0.0), PROGRESS_SECONDS if builds is None else builds.remaining(0.0))
        woken = yield from watch(Watch(keys.roster, revision, seconds))
        roster = _stored_enough(keys, woken or (), writers, readers)
        if roster is not None:  # the roster some rank stored, in the event: no read of it
            found = (yield from read_documents(keys, docs)) if docs else {}
            return barrier_result(ParticipantTable.from_wire({**roster, "documents": found}), writers, readers,
                                  timeout)
        seen, revision = yield from read_state(keys, docs, goal)
    table = seen.table or (yield from build(keys, seen, store=seen.reaches(writers, readers), documents=docs))
    return barrier_result(table, writers, readers, timeout)


def join(keys: JobKeys, p: Participant, *, writers: int, readers: int, timeout: float,
         documents: Sequence[str] = ()) -> Steps[ParticipantTable]:
    """:func:`register` then :func:`wait`, the registration's transaction reading what the wait needs."""
    calls.roster(keys.job, writers=writers, readers=readers, documents=documents)  # before anything is written
    _, seen, revision = yield from register(keys, p, barrier=(writers, readers), documents=documents)
    return (yield from wait(keys, writers=writers, readers=readers, timeout=timeout, documents=documents,
                            joined=(seen, revision)))


def log_waiting(keys: JobKeys, seen: Seen, writers: int, readers: int, left: float) -> Steps[None]:
    """Who is missing, at INFO; naming their ranks costs a read of every registration, so only
    while that read is small (a large job names the counts)."""
    if seen.writers + seen.readers <= NAME_MISSING_UP_TO:
        log_missing((yield from build(keys, seen, store=False, documents=())), writers, readers, left)
    else:
        logger.info("job %r: waiting for %d/%d writers and %d/%d readers to register; %.0f s left", keys.job,
                    seen.writers, writers, seen.readers, readers, left)


def _stored_enough(keys: JobKeys, rows: tuple[Row, ...], writers: int, readers: int) -> dict[str, Any] | None:
    """The wire form of a roster a watch event stored, if it has the ranks waited for (it was
    built at one revision from every registration then: a later one has more ranks, never others)."""
    for row in reversed(rows):
        if row.key == keys.roster:
            have_w, have_r, roster = stored_roster(keys, row)
            return roster if have_w >= writers and have_r >= readers else None
    return None
