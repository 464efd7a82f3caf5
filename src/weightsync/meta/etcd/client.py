"""The job's coordinator on an etcd v3 cluster: :class:`EtcdMetaClient`, the job channel's
:class:`~weightsync.ports.coordinator.MetaPort` over etcd.

The same calls, answers and errors as :class:`~weightsync.meta.client.MetaClient` (the embedded
meta server's client), so the job channel runs unchanged on either. What is stored where:
:mod:`weightsync.meta.etcd.schema`; versions and reader reports: :mod:`weightsync.meta.etcd.versions`;
leases: :mod:`weightsync.meta.etcd.leases`; the connection (failover, auth, watches):
:mod:`weightsync.meta.etcd.kv`.

    meta = EtcdMetaClient("etcd://n1:2379,n2:2379,n3:2379", job="grpo")
    meta.register(Participant("writer", 0, "train", "n1", {"tcp": "n1:29500"}, layout))
    everyone = meta.wait_registered(writers=8, readers=2, timeout=300)
    meta.publish_version(step, fingerprint, writer_rank=0, num_writers=8)

The barrier (:meth:`EtcdMetaClient.wait_table`) counts registrations (etcd ``count_only``
ranges) and watches them; the first waiter that finds everyone registered stores the encoded
roster in one key, and every rank then reads that key instead of a range of all the
participants.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.meta import calls, rules, views, wire
from weightsync.meta.client_base import barrier_result, log_missing
from weightsync.meta.etcd import kv as ops
from weightsync.meta.etcd.leases import Leases
from weightsync.meta.etcd.schema import load_job, pack_registration
from weightsync.meta.etcd.versions import Versions
from weightsync.meta.events import Registered
from weightsync.meta.records import ParticipantTable, check_document_key
from weightsync.meta.reducer import Job, MetaData, apply
from weightsync.ports.records import Participant

__all__ = ["EtcdMetaClient"]


@dataclass(slots=True)
class _Roster:
    """What a barrier read sees: the counts, the stored roster if it is current, the documents asked for."""

    writers: int
    readers: int
    table: ParticipantTable | None
    stored_at: int  # mod revision of the roster key (0: none stored)
    documents: dict[str, bytes | None] = field(default_factory=dict)


class EtcdMetaClient(Versions, Leases):
    """A job's coordinator on etcd (see module docstring). Thread-safe; close() or use as a context manager.

    Args:
        address: ``etcd://host1:2379,host2:2379,...`` (see :mod:`weightsync.meta.etcd.address`).
        job: the job's namespace.
        timeout: how long a call keeps failing over between members before it raises.
        password: the etcd user's password (``WEIGHTSYNC_ETCD_PASSWORD``), if the address names a user.
    """

    def __enter__(self) -> EtcdMetaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- participants -------------------------------------------------------------------------------
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
                                    ops.put(keys.blob(blob), bytes(p.layout))],
                                   [ops.read(key), ops.read(keys.blob(blob))], what=f"register {p.role} {p.rank}")
            if ok:
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
        state = self.wait(self.keys.root + "part/", lambda: self._roster(documents),
                          lambda s: s.writers >= writers and s.readers >= readers, timeout, prefix=True,
                          progress=lambda s, left: log_missing(self._build(s, store=False), writers, readers, left))
        table = state.table or self._build(state, store=state.writers >= writers and state.readers >= readers)
        return barrier_result(table, writers, readers, timeout)

    def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        """:meth:`wait_table`, as a list of participants sorted by ``(role, rank)``."""
        return self.wait_table(writers=writers, readers=readers, timeout=timeout).participants()

    def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
             documents: Sequence[str] = ()) -> ParticipantTable:
        """:meth:`register`, then :meth:`wait_table`."""
        self.register(participant)
        return self.wait_table(writers=writers, readers=readers, timeout=timeout, documents=documents)

    def _roster(self, documents: Sequence[str]) -> tuple[_Roster, int]:
        keys = self.keys
        docs = [check_document_key(k) for k in documents]
        answers, revision = self.read(ops.read(keys.part("writer"), prefix=True, count_only=True),
                                      ops.read(keys.part("reader"), prefix=True, count_only=True),
                                      ops.read(keys.roster), *(ops.read(keys.doc(k)) for k in docs))
        found = {k: ops.rows_of(a) for k, a in zip(docs, answers[3:], strict=True)}
        state = _Roster(ops.count_of(answers[0]), ops.count_of(answers[1]), None, 0,
                        {k: rows[0].value if rows else None for k, rows in found.items()})
        stored = ops.rows_of(answers[2])
        if stored:
            state.stored_at = stored[0].mod_revision
            obj = wire.unpack(stored[0].value)
            if (obj["writers"], obj["readers"]) == (state.writers, state.readers):  # registrations never change
                state.table = ParticipantTable.from_wire({**wire.unpack(obj["roster"]), "documents": state.documents})
        return state, revision

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
                     what="store the roster")  # lost to another waiter: theirs is as good
        return ParticipantTable.from_wire({**wire.unpack(encoded), "documents": state.documents})

    # --- documents and counters ---------------------------------------------------------------------
    def put_document(self, key: str, value: bytes) -> None:
        """Store a job-level document under ``key``; overwrites."""
        calls.put_document(self.job, key, value)  # checks the key and the value's type
        self.txn([], [ops.put(self.keys.doc(key), bytes(value))], what=f"store document {key}")

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        """The document ``key``; with ``wait > 0``, watched for until it exists. None if absent."""
        doc = self.keys.doc(check_document_key(key))

        def read() -> tuple[bytes | None, int]:
            rows, revision = self.rows(ops.read(doc))
            return (rows[0].value if rows else None), revision
        return self.wait(doc, read, lambda v: v is not None, wait)

    def counter(self, name: str, *, at_least: int = 0, wait: float = 0.0) -> int:
        """The job's counter ``name`` (0 until set); with ``wait``, watched until it reaches ``at_least``."""
        calls.counter(self.job, name, at_least=at_least)  # checks the name and the bound
        return self.wait(self.keys.counter(name), lambda: self._counter(name)[::2], lambda v: v >= at_least, wait)

    def _counter(self, name: str) -> tuple[int, int, int]:
        """(value, its key's mod revision, the read's revision)."""
        rows, revision = self.rows(ops.read(self.keys.counter(name)))
        return (int(rows[0].value), rows[0].mod_revision, revision) if rows else (0, 0, revision)

    def compare_and_set(self, name: str, *, expected: int, value: int) -> tuple[bool, int]:
        """Set counter ``name`` to ``value`` if it holds ``expected``, atomically (one transaction).
        Returns (whether it was set, the value it holds now)."""
        calls.compare_and_set(self.job, name, expected=expected, value=value)  # checks the arguments
        key = self.keys.counter(name)
        while True:
            held, mod, _ = self._counter(name)
            if held != expected:
                return False, held
            ok, _ = self.txn([ops.unchanged(key, mod)], [ops.put(key, str(value).encode())],
                             what=f"set counter {name}")
            if ok:
                return True, value

    # --- jobs ---------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """This job's status (participants, versions, each reader's lag and last sync), as JSON data."""
        rows, _ = self.rows(*(ops.read(self.keys.root + kind, prefix=True)
                              for kind in ("part/writer/", "part/reader/", "blob/", "doc/", "ctr/", "ver/", "reader/")))
        job = load_job(self.keys, rows)
        job.roster_revision = sum(len(r) for r in job.rows.values())
        return views.job_status(job)

    def delete_job(self) -> bool:
        """Forget this job (participants, documents, versions, leases). True if it existed."""
        _, answers = self.txn([], [ops.delete(self.keys.root, prefix=True)], what=f"delete job {self.job}")
        return int(answers[0].get("response_delete_range", {}).get("deleted", 0)) > 0 if answers else False
