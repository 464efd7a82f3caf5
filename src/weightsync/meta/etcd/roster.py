"""Registration and the barrier on etcd, with one wake-up per waiting rank.

A rank registers in one transaction, which also reads the registration counts (``count_only``
ranges), the barriers ranks wait at and the stored roster. A rank that waits for ``W`` writers and
``R`` readers first makes sure the barrier ``barrier/W-R`` is known (one key, created by the first
waiter), then reads the counts, and watches the one ``part/roster`` key. Whoever first sees a known
barrier complete (the last registrant, in its registration's transaction, or a waiter in its read)
stores the encoded columnar roster in ``part/roster``: that write wakes every waiter once, and
each reads that key instead of a range of all the participants. A waiter that finds the barrier
complete before the roster is stored gives that rank :data:`ROSTER_GRACE_SECONDS` to store it,
and then stores it itself.

No completion is missed: a waiter writes its barrier before it reads the counts, and a registrant
reads the barriers after its registration, both linearizable, so at least one of the two sees
the other. A waiter also re-reads every :data:`~weightsync.meta.etcd.base.PROGRESS_SECONDS` (and
logs who is missing), as the embedded server's client does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.clock.deadline import Deadline
from weightsync.meta import calls, rules, views, wire
from weightsync.meta.client_base import barrier_result, log_missing, logger
from weightsync.meta.etcd import kv as ops
from weightsync.meta.etcd.base import PROGRESS_SECONDS, EtcdBase
from weightsync.meta.etcd.kv import Row
from weightsync.meta.etcd.schema import load_job, pack_registration
from weightsync.meta.events import Registered
from weightsync.meta.records import ParticipantTable, check_document_key
from weightsync.meta.reducer import Job, MetaData, apply
from weightsync.ports.records import Participant

#: a waiting rank names the missing ranks while at most this many registered (see Roster._log_missing)
NAME_MISSING_UP_TO = 256
#: a waiter that finds the barrier complete but no roster stored waits this long for the rank that
#: completed it to store it before it reads every registration itself (one build, not one per waiter)
ROSTER_GRACE_SECONDS = 1.0


@dataclass(slots=True)
class _Roster:
    """What a barrier read sees: the counts, the stored roster if it is current, the documents asked for."""

    writers: int
    readers: int
    table: ParticipantTable | None
    stored_at: int  # mod revision of the roster key (0: none stored)
    documents: dict[str, bytes | None] = field(default_factory=dict)
    barriers: list[tuple[int, int]] = field(default_factory=list)


class Roster(EtcdBase):
    """The participant calls of :class:`~weightsync.meta.etcd.client.EtcdMetaClient` (see module docstring)."""

    def register(self, participant: Participant) -> bool:
        """Register a rank (idempotent). Returns True if it was new.

        Raises:
            ValueError: the rank is already registered with different data (names the fields).
        """
        p, keys = participant, self.keys
        key = keys.part(p.role, p.rank)
        job: Job | None = None
        while True:
            try:
                events = rules.registration(job, self.job, p.role, p.rank, group=p.group, host=p.host,
                                            endpoints=p.endpoints, layout=p.layout, at=time.time())
            except rules.ConflictError as exc:
                raise ValueError(str(exc)) from None
            if not events:
                return False
            state = Job(self.job, created_at=0.0)
            for event in events:
                apply(MetaData({self.job: state}), event)
            blob = next(e for e in events if isinstance(e, Registered)).layout
            ok, answers = self.txn([ops.unchanged(key, 0)],
                                   [ops.put(key, pack_registration(state.rows[p.role][p.rank])),
                                    ops.put(keys.blob(blob), bytes(p.layout)), *self._counts()],
                                   [ops.read(key), ops.read(keys.blob(blob))], what=f"register {p.role} {p.rank}")
            if ok:
                roster = self._decode(answers[2:], ())
                if any(roster.writers >= w and roster.readers >= r for w, r in roster.barriers) and not roster.table:
                    self._build(roster, store=True)  # this registration completed a barrier: wake its waiters
                return True
            job = load_job(keys, [row for answer in answers for row in ops.rows_of(answer)])  # decide again

    def table(self, *, documents: Sequence[str] = ()) -> ParticipantTable:
        """The roster (and the documents named in ``documents``: ``table.documents``)."""
        state, _ = self._roster(documents)
        return state.table or self._build(state, store=False)

    def participants(self, role: str | None = None) -> list[Participant]:
        """All registered participants (or those of ``role``), sorted by ``(role, rank)``."""
        return self.table().participants(role)

    def wait_table(self, *, writers: int, readers: int, timeout: float,
                   documents: Sequence[str] = ()) -> ParticipantTable:
        """Barrier: wait until ``writers`` writers and ``readers`` readers registered; returns the
        roster (and the documents named in ``documents``).

        Raises:
            TimeoutError: naming the ranks still missing.
        """
        calls.roster(self.job, writers=writers, readers=readers, documents=documents)  # checks the arguments
        barrier = self.keys.root + f"barrier/{writers}-{readers}"

        def read() -> tuple[_Roster, int]:
            state, revision = self._roster(documents)
            if (writers, readers) not in state.barriers:  # made known before the counts are read again
                self.txn([ops.unchanged(barrier, 0)], [ops.put(barrier, b"")], what="announce a barrier")
                state, revision = self._roster(documents)
            return state, revision

        def done(s: _Roster) -> bool:
            return s.writers >= writers and s.readers >= readers

        deadline, said = Deadline.after(max(0.0, timeout)), time.monotonic()
        builds: Deadline | None = None  # when this rank stores the roster itself, if no one else did
        while True:
            state, revision = read()
            if done(state) and (state.table is not None or (builds is not None and builds.expired)):
                break
            if deadline.expired:
                break
            if done(state) and builds is None:  # the rank that completed it stores it; wait for that a little
                builds = Deadline.after(ROSTER_GRACE_SECONDS)
            elif not done(state) and time.monotonic() - said >= PROGRESS_SECONDS:
                said = time.monotonic()
                self._log_missing(state, writers, readers, deadline.remaining(0.0))
            step = min(deadline.remaining(0.0), PROGRESS_SECONDS if builds is None else builds.remaining(0.0))
            self.kv.watch(self.keys.roster, prefix=False, after=revision, deadline=Deadline.after(step))
        table = state.table or self._build(state, store=done(state))
        return barrier_result(table, writers, readers, timeout)

    def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        """:meth:`wait_table`, as a list of participants sorted by ``(role, rank)``."""
        return self.wait_table(writers=writers, readers=readers, timeout=timeout).participants()

    def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
             documents: Sequence[str] = ()) -> ParticipantTable:
        """:meth:`register`, then :meth:`wait_table`."""
        self.register(participant)
        return self.wait_table(writers=writers, readers=readers, timeout=timeout, documents=documents)

    def _log_missing(self, state: _Roster, writers: int, readers: int, left: float) -> None:
        """Who is missing, at INFO; naming their ranks costs a read of every registration, so
        only while that read is small (a large job names the counts)."""
        if state.writers + state.readers <= NAME_MISSING_UP_TO:
            log_missing(self._build(state, store=False), writers, readers, left)
        else:
            logger.info("job %r: waiting for %d/%d writers and %d/%d readers to register; %.0f s left", self.job,
                        state.writers, writers, state.readers, readers, left)

    # -- the roster ----------------------------------------------------------------------------------
    def _counts(self) -> list[dict[str, Any]]:
        """The reads a barrier decides on: both counts, the known barriers, the stored roster."""
        keys = self.keys
        return [ops.read(keys.part("writer"), prefix=True, count_only=True),
                ops.read(keys.part("reader"), prefix=True, count_only=True),
                ops.read(keys.root + "barrier/", prefix=True), ops.read(keys.roster)]

    def _roster(self, documents: Sequence[str]) -> tuple[_Roster, int]:
        docs = [check_document_key(k) for k in documents]
        answers, revision = self.read(*self._counts(), *(ops.read(self.keys.doc(k)) for k in docs))
        return self._decode(answers, docs), revision

    def _decode(self, answers: list[dict[str, Any]], docs: Sequence[str]) -> _Roster:
        found = {k: ops.rows_of(a) for k, a in zip(docs, answers[4:], strict=True)}
        barriers = [row.key.rsplit("/", 1)[1].split("-") for row in ops.rows_of(answers[2])]
        state = _Roster(ops.count_of(answers[0]), ops.count_of(answers[1]), None, 0,
                        {k: rows[0].value if rows else None for k, rows in found.items()},
                        [(int(w), int(r)) for w, r in barriers])
        stored: list[Row] = ops.rows_of(answers[3])
        if stored:
            state.stored_at = stored[0].mod_revision
            obj = wire.unpack(stored[0].value)
            if (obj["writers"], obj["readers"]) == (state.writers, state.readers):  # registrations never change
                state.table = ParticipantTable.from_wire({**wire.unpack(obj["roster"]), "documents": state.documents})
        return state

    def _build(self, state: _Roster, *, store: bool) -> ParticipantTable:
        """The roster read from every registration (and, with ``store``, kept in the roster key)."""
        rows, _ = self.rows(ops.read(self.keys.part("writer"), prefix=True),
                            ops.read(self.keys.part("reader"), prefix=True), ops.read(self.keys.blob(), prefix=True))
        job = load_job(self.keys, rows)
        job.roster_revision = sum(len(r) for r in job.rows.values())
        encoded = views.encode_roster(self.job, job, msgpack_=True)
        if store:
            value = wire.pack({"writers": len(job.rows["writer"]), "readers": len(job.rows["reader"]),
                               "roster": encoded})
            self.txn([ops.unchanged(self.keys.roster, state.stored_at)], [ops.put(self.keys.roster, value)],
                     what="store the roster")  # lost to another rank: theirs is as good
        return ParticipantTable.from_wire({**wire.unpack(encoded), "documents": state.documents})
