"""Registration and the barrier on etcd, as steps (:mod:`weightsync.meta.etcd.steps`): two
requests per joining rank (one transaction, one watch), one roster build per barrier.

**Join.** A rank joins in one transaction: if its key does not exist yet, it puts its
registration, its layout blob and the barrier it is about to wait at (``barrier/W-R``), and reads
the registration counts (``count_only`` ranges), every known barrier and the stored roster. If the
counts complete a known barrier whose roster is not stored, this registration completed it: the
rank reads every registration and the documents it asked for, and stores the roster with those
documents (:class:`StoredRoster`) in the one key ``part/roster``.

**Wait.** Every other rank watches ``part/roster`` from the revision of its join. The roster's
write wakes each waiter once, and the watch event carries the roster itself: a waiter decodes it
without another request. The documents stored with it were read after the barrier completed,
hence during every waiter's call (as the embedded server's answer is); a waiter that asked for
other documents reads them. A rank that waits without registering reads the same state (and
puts its barrier, if no rank announced it yet) before it watches. A rank that finds the barrier
passed already (the stored roster current) reads the documents it asked for and is done.

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
import zlib
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


@dataclass(frozen=True, slots=True)
class StoredRoster:
    """The value of ``part/roster``: the columnar roster's wire form, the registration counts it
    was built from, and the documents the rank that built it asked for, read with it.

    Stored as zlib-compressed msgpack: every waiter receives it through the gateway, which sends
    bytes as base64 in JSON; a roster of 1280 ranks shrinks from 60 KB to 15 KB (level 1: 0.6 ms
    to compress, once; 0.2 ms to decompress, per rank), and the members' JSON work with it."""

    writers: int
    readers: int
    roster: dict[str, Any]
    documents: dict[str, bytes | None]

    def pack(self) -> bytes:
        return zlib.compress(wire.pack({"writers": self.writers, "readers": self.readers, "roster": self.roster,
                                        "documents": self.documents}), 1)

    @classmethod
    def unpack(cls, keys: JobKeys, row: Row) -> StoredRoster:
        """Raises ValueError naming the key if it holds something else."""
        try:
            obj = wire.unpack(zlib.decompress(row.value))
            documents = {str(k): (None if v is None else bytes(v)) for k, v in dict(obj["documents"]).items()}
            return cls(int(obj["writers"]), int(obj["readers"]), dict(obj["roster"]), documents)
        except (ValueError, TypeError, KeyError, zlib.error) as exc:
            raise ValueError(f"etcd key {row.key!r} holds a malformed roster ({exc!r}); only weightsync may write "
                             f"under {keys.root}") from None

    def reaches(self, writers: int, readers: int) -> bool:
        return self.writers >= writers and self.readers >= readers

    def table(self, documents: dict[str, bytes | None]) -> ParticipantTable:
        return ParticipantTable.from_wire({**self.roster, "documents": documents})


@dataclass(slots=True)
class Seen:
    """What a barrier read sees: the counts, the stored roster if it is current (built from these
    counts), the barriers ranks wait at; ``table``: the roster with its documents, once final."""

    writers: int
    readers: int
    stored: StoredRoster | None
    stored_at: int  # mod revision of the roster key (0: none stored)
    barriers: list[tuple[int, int]] = field(default_factory=list)
    table: ParticipantTable | None = None

    def reaches(self, writers: int, readers: int) -> bool:
        return self.writers >= writers and self.readers >= readers

    def completes_a_barrier(self) -> bool:
        return any(self.reaches(w, r) for w, r in self.barriers)


def state_reads(keys: JobKeys) -> list[Request]:
    """The reads a barrier decides on: both counts, the known barriers, the stored roster."""
    return [ops.read(keys.part("writer"), prefix=True, count_only=True),
            ops.read(keys.part("reader"), prefix=True, count_only=True),
            ops.read(keys.barrier(), prefix=True), ops.read(keys.roster)]


def decode(keys: JobKeys, answers: list[dict[str, Any]]) -> Seen:
    """The answers of :func:`state_reads`, read at one revision."""
    barriers = [row.key.rsplit("/", 1)[1].split("-") for row in ops.rows_of(answers[2])]
    seen = Seen(ops.count_of(answers[0]), ops.count_of(answers[1]), None, 0, [(int(w), int(r)) for w, r in barriers])
    stored: list[Row] = ops.rows_of(answers[3])
    if stored:
        seen.stored_at = stored[0].mod_revision
        kept = StoredRoster.unpack(keys, stored[0])
        if (kept.writers, kept.readers) == (seen.writers, seen.readers):  # registrations never change: current
            seen.stored = kept
    return seen


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
    (whether it was new, that state, its revision). A registration that completes a barrier
    stores its roster with ``documents`` (the state's ``table``). See the module docstring.

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
            seen, revision = yield from read_state(keys, barrier)
            return False, seen, revision
        answer = yield from commit(Txn((ops.unchanged(key, 0),), (*puts, *announce, *state_reads(keys)),
                                       (ops.read(key), ops.read(keys.blob(blob_hash(p.layout)))),
                                       what=f"register {p.role} {p.rank}"))
        if answer.ok:
            seen = decode(keys, answer.responses[len(puts) + len(announce):])
            if seen.completes_a_barrier() and seen.stored is None:  # this rank completed it: wake its waiters
                seen.table = yield from build(keys, seen, store=True, documents=docs)
            return True, seen, answer.revision
        job = load_job(keys, [row for r in answer.responses for row in ops.rows_of(r)])  # decide again


def read_state(keys: JobKeys, barrier: tuple[int, int] | None) -> Steps[tuple[Seen, int]]:
    """The barrier state and its revision; with ``barrier``, announced first if no rank did yet."""
    answers, revision = yield from read(*state_reads(keys))
    seen = decode(keys, answers)
    if barrier is None or barrier in seen.barriers:
        return seen, revision
    key = keys.barrier(*barrier)
    answer = yield from commit(Txn((ops.unchanged(key, 0),), (ops.put(key, b""), *state_reads(keys)),
                                   tuple(state_reads(keys)), what="announce a barrier"))
    return decode(keys, answer.responses[1:] if answer.ok else answer.responses), answer.revision


def build(keys: JobKeys, seen: Seen, *, store: bool, documents: Sequence[str]) -> Steps[ParticipantTable]:
    """The roster read from every registration, with the documents (and, with ``store``, kept in
    the roster key unless another rank stored one since ``seen``: theirs is as good)."""
    answers, _ = yield from read(ops.read(keys.part("writer"), prefix=True), ops.read(keys.part("reader"), prefix=True),
                                 ops.read(keys.blob(), prefix=True), *(ops.read(keys.doc(k)) for k in documents))
    job = load_job(keys, [row for answer in answers[:3] for row in ops.rows_of(answer)])
    job.roster_revision = sum(len(r) for r in job.rows.values())
    found = {k: ops.rows_of(a) for k, a in zip(documents, answers[3:], strict=True)}
    built = StoredRoster(len(job.rows["writer"]), len(job.rows["reader"]),
                         wire.unpack(views.encode_roster(keys.job, job, msgpack_=True)),
                         {k: r[0].value if r else None for k, r in found.items()})
    if store:
        yield from commit(Txn((ops.unchanged(keys.roster, seen.stored_at),), (ops.put(keys.roster, built.pack()),),
                              what="store the roster"))
    return built.table(built.documents)


def finish(keys: JobKeys, seen: Seen, *, store: bool, documents: Sequence[str]) -> Steps[ParticipantTable]:
    """The roster with its documents from what ``seen`` holds: its final table, the current
    stored roster (the documents read now), or else a build from every registration."""
    if seen.table is not None:
        return seen.table
    if seen.stored is not None:
        return seen.stored.table((yield from read_documents(keys, list(documents))) if documents else {})
    return (yield from build(keys, seen, store=store, documents=documents))


def table(keys: JobKeys, documents: Sequence[str] = ()) -> Steps[ParticipantTable]:
    """The roster (and the documents named in ``documents``: ``table.documents``)."""
    calls.roster(keys.job, documents=documents)  # checks the arguments
    seen, _ = yield from read_state(keys, None)
    return (yield from finish(keys, seen, store=False, documents=[check_document_key(k) for k in documents]))


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
    seen, revision = joined or (yield from read_state(keys, goal))
    builds: Deadline | None = None  # when this rank stores the roster itself, if no one else did
    while True:
        complete = seen.reaches(writers, readers)
        final = seen.table is not None or seen.stored is not None or (builds is not None and builds.expired)
        if (complete and final) or deadline.expired:
            break
        if complete and builds is None:  # the rank that completed it stores it; wait for that a little
            builds = Deadline.after(ROSTER_GRACE_SECONDS)
        elif not complete and time.monotonic() - said >= PROGRESS_SECONDS:
            said = time.monotonic()
            yield from log_waiting(keys, seen, writers, readers, deadline.remaining(0.0))
        seconds = min(deadline.remaining(0.0), PROGRESS_SECONDS if builds is None else builds.remaining(0.0))
        woken = yield from watch(Watch(keys.roster, revision, seconds))
        kept = _stored_enough(keys, woken or (), writers, readers)
        if kept is not None:  # the roster some rank stored after this rank's read, in the event: no read of it
            found = kept.documents if set(docs) <= kept.documents.keys() else (yield from read_documents(keys, docs))
            return barrier_result(kept.table({k: found[k] for k in docs}), writers, readers, timeout)
        seen, revision = yield from read_state(keys, goal)
    table = yield from finish(keys, seen, store=seen.reaches(writers, readers), documents=docs)
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


def _stored_enough(keys: JobKeys, rows: tuple[Row, ...], writers: int, readers: int) -> StoredRoster | None:
    """The roster a watch event stored, if it has the ranks waited for (it was built at one
    revision from every registration then: a later one has more ranks, never others)."""
    for row in reversed(rows):
        if row.key == keys.roster:
            kept = StoredRoster.unpack(keys, row)
            return kept if kept.reaches(writers, readers) else None
    return None
