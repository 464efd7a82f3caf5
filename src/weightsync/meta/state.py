"""The meta server's state: jobs, participants, documents, versions and reader progress.

Everything lives in memory in one event loop, behind one asyncio lock. Every change is a
**record**, a small msgpack-ready dict applied by :meth:`MetaState._apply`. With a state
directory the same records go to the journal (:mod:`weightsync.meta.journal`) before the caller
gets its answer, and a restarted server replays them through the same ``_apply``, so the live
and the recovered state cannot drift apart. Records *set* values rather than add to them, so
replaying records that are already reflected in a snapshot is harmless; compaction relies on it.

Long-polls wait on :class:`Watch` events keyed by exactly what they wait for ("3 writers and 2
readers registered", "a version newer than 7"), and a change fires only the keys it satisfies:
a thousand ranks waiting on a barrier are woken once, by the registration that completes it,
not by every registration before it. Nothing here sleeps or polls.

    state = MetaState(journal)          # journal=None: memory only
    state.load()                        # replay the state directory, if any
    await state.start()
    created = await state.register("job", "writer", 0, group="train", host="h", endpoints={}, layout=b"")
    await state.wait_registered("job", writers=1, readers=0, wait=5.0)
    await state.close()
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from weightsync.meta import wire
from weightsync.meta.journal import Journal
from weightsync.meta.leases import Leases
from weightsync.meta.records import ROLES, VersionInfo, blob_hash, encode_columns

logger = logging.getLogger(__name__)

#: attempts of a version are below this (a reader waiting "after version V" waits past them all)
MAX_ATTEMPT = 1 << 62


class ConflictError(Exception):
    """A request that contradicts the state (the server answers 409 with this message)."""


class RecordError(ValueError):
    """A change whose record cannot be stored (the server answers 422; nothing is applied)."""


def _encode(records: list[dict[str, Any]]) -> bytes:
    try:
        return b"".join(msgpack.packb(r, use_bin_type=True) for r in records)
    except (OverflowError, ValueError, TypeError) as exc:
        raise RecordError(f"the change cannot be stored ({exc})") from None


class Watch:
    """Long-poll events grouped by (kind, job), then by what each waiter waits for."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], dict[Hashable, list[Any]]] = {}
        self.closed = False

    @property
    def waiting(self) -> int:
        return sum(entry[1] for keys in self._events.values() for entry in keys.values())

    async def wait(self, kind: str, job: str, key: Hashable, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` holds or ``timeout`` seconds pass; returns ``ready()``."""
        if ready() or timeout <= 0 or self.closed:
            return ready()
        keys = self._events.setdefault((kind, job), {})
        entry = keys.get(key)
        if entry is None:
            entry = keys[key] = [asyncio.Event(), 0]
        entry[1] += 1
        try:
            await asyncio.wait_for(entry[0].wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            entry[1] -= 1
            if entry[1] == 0 and keys.get(key) is entry:
                del keys[key]
                if not keys:
                    self._events.pop((kind, job), None)
        return ready()

    def fire(self, kind: str, job: str, satisfied: Callable[[Any], bool]) -> None:
        """Wake the waiters of ``(kind, job)`` whose key ``satisfied(key)`` accepts."""
        keys = self._events.get((kind, job))
        if keys:
            for key in [k for k in keys if satisfied(k)]:
                keys.pop(key)[0].set()

    def close(self) -> None:
        """Wake everyone (server shutdown); later waits return at once."""
        self.closed = True
        for keys in self._events.values():
            for entry in keys.values():
                entry[0].set()
        self._events.clear()


@dataclass(slots=True)
class _Row:
    group: str
    host: str
    endpoints: dict[str, str]
    layout: str  # blob hash
    at: float


@dataclass(slots=True)
class _Pending:
    fingerprint: str
    num_writers: int
    ranks: set[int] = field(default_factory=set)
    attempt: int = 0


@dataclass(slots=True)
class _Reader:
    version: int | None = None
    nbytes: int = 0
    seconds: float = 0.0
    at: float | None = None  # last report, applied or failed
    applied_at: float | None = None  # last successful sync
    error: str | None = None
    failed_version: int | None = None  # the version of the last failed report


@dataclass(slots=True)
class Job:
    """One job namespace."""

    name: str
    created_at: float
    rows: dict[str, dict[int, _Row]] = field(default_factory=lambda: {role: {} for role in ROLES})
    blobs: dict[str, bytes] = field(default_factory=dict)
    documents: dict[str, bytes] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    latest: VersionInfo | None = None
    pending: dict[int, _Pending] = field(default_factory=dict)
    readers: dict[int, _Reader] = field(default_factory=dict)
    roster_revision: int = 0  # bumped by every registration (roster caches key on it)
    updated_at: float = 0.0
    roster_cache: dict[bool, bytes] = field(default_factory=dict)

    def reader_ranks(self) -> list[int]:
        return sorted(set(self.rows["reader"]) | set(self.readers))

    def settled_count(self, min_version: int, count: int) -> int:
        """Registered readers of rank below ``count`` done with ``min_version``: applied it or
        newer, or failed it or newer.

        A reader that failed version V never applies V (it waits for V+1), so a writer's
        staleness or slot-reuse wait must not wait for it to. Only registered ranks of the job
        count: a stale process of an older job that reports progress passes no barrier.
        """
        registered = self.rows["reader"]
        return sum(1 for rank, r in self.readers.items()
                   if rank < count and rank in registered
                   and max(-1 if r.version is None else r.version,
                           -1 if r.failed_version is None else r.failed_version) >= min_version)


class MetaState:
    """All jobs of one server. Methods run on the server's event loop only."""

    def __init__(self, journal: Journal | None = None) -> None:
        self.jobs: dict[str, Job] = {}
        self.watch = Watch()
        self.leases = Leases()
        self.started_at = time.time()
        #: Who this state is: new with every empty state, kept in the state directory. Clients
        #: pin it; a server restarted without its state answers with another one (see server.py).
        self.instance = secrets.token_hex(8)
        self._journal = journal
        self._lock = asyncio.Lock()

    @property
    def durable(self) -> bool:
        return self._journal is not None

    @property
    def journal(self) -> Journal | None:
        return self._journal

    # --- lifecycle -------------------------------------------------------------------------
    def load(self) -> int:
        """Replay the state directory (before serving). Returns the number of records replayed."""
        if self._journal is None:
            return 0
        records = self._journal.load()
        self.instance = self._journal.instance = self._journal.instance or self.instance
        for i, record in enumerate(records):
            try:
                self._apply(record)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self._journal.close_files()
                raise ValueError(f"state directory {self._journal.directory}: record {i} ({record.get('op')!r}) "
                                 f"cannot be applied ({exc!r}); move the directory away to start empty") from exc
        self._journal.rewrite(self.records())  # start from a compact snapshot and an empty journal
        logger.info("meta state: replayed %d records: %d jobs", len(records), len(self.jobs))
        return len(records)

    async def start(self) -> None:
        if self._journal is not None:
            await self._journal.start(self.records)

    async def close(self) -> None:
        """Wake every long-poll (they answer with what they have) and flush the journal."""
        self.watch.close()
        if self._journal is not None:
            await self._journal.close()

    # --- applying records ------------------------------------------------------------------
    def _job(self, name: str, at: float) -> Job:
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = Job(name, created_at=at, updated_at=at)
        return job

    def _apply(self, r: Mapping[str, Any]) -> None:
        op, name = r["op"], r["job"]
        if op == "drop":
            self.jobs.pop(name, None)
            return
        at = float(r.get("at", 0.0))
        job = self._job(name, at)
        job.updated_at = max(job.updated_at, at)
        if op == "blob":
            job.blobs[r["hash"]] = r["data"]
        elif op == "register":
            role = r["role"]
            job.rows[role][r["rank"]] = _Row(r["group"], r["host"], dict(r["endpoints"]), r["layout"], at)
            job.roster_revision += 1
            job.roster_cache.clear()
            counts = (len(job.rows["writer"]), len(job.rows["reader"]))
            self.watch.fire("registered", name, lambda k: k[0] <= counts[0] and k[1] <= counts[1])
        elif op == "document":
            job.documents[r["key"]] = r["value"]
            self.watch.fire("document", name, lambda k: k == r["key"])
        elif op == "counter":
            value = job.counters[r["name"]] = int(r["value"])
            self.watch.fire("counter", name, lambda k: k[0] == r["name"] and value >= k[1])
        elif op == "report":
            self._apply_report(job, r["version"], r["fingerprint"], attempt=int(r.get("attempt", 0)),
                               writer_rank=r["writer_rank"],
                               num_writers=r["num_writers"], at=at)
        elif op == "version":
            self._set_latest(job, VersionInfo(r["version"], r["fingerprint"], at, int(r.get("attempt", 0))))
        elif op in ("applied", "failed"):
            state = job.readers.setdefault(r["rank"], _Reader())
            state.at, state.version = at, (r["version"] if op == "applied" else None)
            if op == "applied":
                state.applied_at = at
            if "applied_at" in r:  # from a snapshot: keep the last success across a failure
                state.applied_at = r["applied_at"]
            state.nbytes, state.seconds = int(r.get("nbytes", 0)), float(r.get("seconds", 0.0))
            state.error = r.get("error") if op == "failed" else None
            if op == "failed":
                state.failed_version = r["version"]
            self.watch.fire("readers", name, lambda k: job.settled_count(k[0], k[1]) >= k[1])
        else:
            raise ValueError(f"unknown state record op {op!r}")

    def _apply_report(self, job: Job, version: int, fingerprint: str, *, attempt: int, writer_rank: int,
                      num_writers: int, at: float) -> None:
        if job.latest is not None and (version, attempt) <= (job.latest.version, job.latest.attempt):
            return  # already published (a replayed or late report)
        pending = job.pending.get(version)
        if pending is None or pending.attempt < attempt:  # a new attempt supersedes the pending one
            pending = job.pending[version] = _Pending(fingerprint, num_writers, attempt=attempt)
        elif pending.attempt > attempt:
            return
        pending.ranks.add(writer_rank)
        if len(pending.ranks) >= pending.num_writers:
            self._set_latest(job, VersionInfo(version, fingerprint, at, attempt))

    def _set_latest(self, job: Job, info: VersionInfo) -> None:
        if info.attempt > 0:
            # A new attempt of a version: failures reported for the version were of an older
            # attempt (a reader can fail an attempt only once it is published); the readers
            # take this one, and the writers' barrier must wait for them again.
            for reader in job.readers.values():
                if reader.failed_version == info.version:
                    reader.failed_version = None
        job.latest = info
        for v in [v for v in job.pending if v <= info.version]:
            del job.pending[v]
        self.watch.fire("version", job.name, lambda after: (info.version, info.attempt) > after)

    async def _change(self, plan: Callable[[], list[dict[str, Any]]]) -> bool:
        """Run ``plan`` (validate against the current state, return records) and apply its records.

        Validation and application happen under the lock, so no other change interleaves; the
        caller is answered only once the records (or, for a no-op, everything before them) are
        durable, so an acknowledged change survives a crash. Returns whether anything changed.
        """
        async with self._lock:
            records = plan()
            # Encode before applying: a record the journal cannot store is refused here, whole,
            # instead of failing the journal's writer after the state already changed.
            encoded = _encode(records)
            for record in records:
                self._apply(record)
            done = self._journal.submit(records, encoded) if self._journal is not None else None
        if done is not None:
            await done
        return bool(records)

    def broken(self) -> str | None:
        """Why this server cannot accept changes (its journal failed), or None when healthy."""
        return self._journal.broken() if self._journal is not None else None

    # --- participants ----------------------------------------------------------------------
    async def register(self, job: str, role: str, rank: int, *, group: str, host: str,
                       endpoints: Mapping[str, str], layout: bytes) -> bool:
        """Register a rank; True if new, False if it was already registered identically.

        Raises:
            ConflictError: the rank is registered with different data.
        """
        h = blob_hash(layout)

        def plan() -> list[dict[str, Any]]:
            current = self.jobs.get(job)
            row = current.rows[role].get(rank) if current else None
            if row is not None:
                diffs = [f"{n}: {a!r} != {b!r}" for n, a, b in (
                    ("group", row.group, group), ("host", row.host, host),
                    ("endpoints", row.endpoints, dict(endpoints))) if a != b]
                if row.layout != h:
                    diffs.append(f"layout: blob {row.layout[:12]} != {h[:12]}")
                if not diffs:
                    return []
                raise ConflictError(f"{role} rank {rank} of job {job!r} is already registered with different data "
                               f"({'; '.join(diffs)}); a rank registers once per job: use a new job name "
                               "for a new run, or delete the job first")
            at = time.time()
            records: list[dict[str, Any]] = []
            if current is None or h not in current.blobs:
                records.append({"op": "blob", "job": job, "hash": h, "data": bytes(layout), "at": at})
            records.append({"op": "register", "job": job, "role": role, "rank": rank, "group": group,
                            "host": host, "endpoints": dict(endpoints), "layout": h, "at": at})
            return records

        return await self._change(plan)

    def counts(self, job: str) -> tuple[int, int]:
        state = self.jobs.get(job)
        return (len(state.rows["writer"]), len(state.rows["reader"])) if state else (0, 0)

    async def wait_registered(self, job: str, *, writers: int, readers: int, wait: float) -> bool:
        """Wait until at least ``writers`` writers and ``readers`` readers registered."""
        def ready() -> bool:
            w, r = self.counts(job)
            return w >= writers and r >= readers
        return await self.watch.wait("registered", job, (writers, readers), ready, wait)

    def roster(self, job: str, *, msgpack_: bool) -> bytes:
        """The encoded bulk roster (cached until the next registration)."""
        state = self.jobs.get(job)
        if state is None:
            obj = {"job": job, "roster_revision": 0, "blobs": {}, "participants": {}}
            return wire.encode(obj, msgpack_=msgpack_)[0]
        cached = state.roster_cache.get(msgpack_)
        if cached is None:
            participants = {}
            for role in ROLES:
                rows = sorted(state.rows[role].items())
                participants[role] = encode_columns(
                    [(rank, row.group, row.host, row.endpoints, row.layout) for rank, row in rows])
            used = {row.layout for rows in state.rows.values() for row in rows.values()}
            obj = {"job": job, "roster_revision": state.roster_revision,
                   "blobs": {h: state.blobs[h] for h in sorted(used)}, "participants": participants}
            cached = state.roster_cache[msgpack_] = wire.encode(obj, msgpack_=msgpack_)[0]
        return cached

    # --- documents -------------------------------------------------------------------------
    async def put_document(self, job: str, key: str, value: bytes) -> None:
        def plan() -> list[dict[str, Any]]:
            if self.document(job, key) == value:
                return []
            return [{"op": "document", "job": job, "key": key, "value": bytes(value), "at": time.time()}]

        await self._change(plan)

    def document(self, job: str, key: str) -> bytes | None:
        state = self.jobs.get(job)
        return state.documents.get(key) if state else None

    async def wait_document(self, job: str, key: str, wait: float) -> bytes | None:
        await self.watch.wait("document", job, key, lambda: self.document(job, key) is not None, wait)
        return self.document(job, key)

    # --- counters --------------------------------------------------------------------------
    def counter(self, job: str, name: str) -> int:
        """A job's named counter (0 until first set)."""
        state = self.jobs.get(job)
        return state.counters.get(name, 0) if state else 0

    async def compare_and_set(self, job: str, name: str, *, expected: int, value: int) -> tuple[bool, int]:
        """Set counter ``name`` to ``value`` if it holds ``expected``, atomically (one record under
        the state's lock). Returns (whether it was set, the value it holds now)."""
        def plan() -> list[dict[str, Any]]:
            if self.counter(job, name) != expected:
                return []
            return [{"op": "counter", "job": job, "name": name, "value": value, "at": time.time()}]

        swapped = await self._change(plan) or (expected == value == self.counter(job, name))
        return swapped, self.counter(job, name)

    async def wait_counter(self, job: str, name: str, at_least: int, wait: float) -> int:
        """Wait until counter ``name`` reaches ``at_least``; returns its value (maybe lower)."""
        await self.watch.wait("counter", job, (name, at_least), lambda: self.counter(job, name) >= at_least, wait)
        return self.counter(job, name)

    # --- versions --------------------------------------------------------------------------
    def latest(self, job: str) -> VersionInfo | None:
        state = self.jobs.get(job)
        return state.latest if state else None

    async def report_version(self, job: str, version: int, fingerprint: str, *, writer_rank: int,
                             num_writers: int, attempt: int = 0) -> VersionInfo | None:
        """One writer says ``version`` is ready; returns the VersionInfo once all writers did.

        ``attempt`` numbers the tries of one version: writers that failed a version may publish
        it again with a higher attempt (weightsync uses the transport epoch), which supersedes
        the earlier one, published or pending.

        Raises:
            ConflictError: an older version or attempt, a different fingerprint or writer count.
        """
        def plan() -> list[dict[str, Any]]:
            state = self.jobs.get(job)
            latest = state.latest if state else None
            if latest is not None and (version, attempt) <= (latest.version, latest.attempt):
                if (version, attempt) == (latest.version, latest.attempt) and fingerprint == latest.fingerprint:
                    return []  # a retry or a late writer
                if version == latest.version and attempt < latest.attempt:
                    raise ConflictError(f"writer rank {writer_rank} reports attempt {attempt} of version {version}, "
                                        f"but attempt {latest.attempt} of it is published already")
                if version == latest.version:
                    raise ConflictError(f"writer rank {writer_rank} reports version {version} with fingerprint "
                                   f"{fingerprint!r}, but it was published with fingerprint "
                                   f"{latest.fingerprint!r}: the writers planned different syncs")
                raise ConflictError(f"version {version} is older than the published version {latest.version} of "
                               f"job {job!r}: versions must increase")
            pending = state.pending.get(version) if state else None
            if pending is not None and pending.attempt > attempt:
                raise ConflictError(f"writer rank {writer_rank} reports attempt {attempt} of version {version}, but "
                                    f"writer ranks {sorted(pending.ranks)[:8]} publish attempt {pending.attempt}")
            if pending is not None and pending.attempt == attempt:
                if pending.fingerprint != fingerprint:
                    raise ConflictError(
                        f"writer rank {writer_rank} reports version {version} with fingerprint {fingerprint!r}, "
                        f"but writer ranks {sorted(pending.ranks)[:8]} reported {pending.fingerprint!r}: "
                        "the writers planned different syncs (different layouts or options)")
                if pending.num_writers != num_writers:
                    raise ConflictError(f"writer rank {writer_rank} says version {version} needs {num_writers} "
                                   f"writers, earlier reports said {pending.num_writers}")
                if writer_rank in pending.ranks:
                    return []
            return [{"op": "report", "job": job, "version": version, "fingerprint": fingerprint, "attempt": attempt,
                     "writer_rank": writer_rank, "num_writers": num_writers, "at": time.time()}]

        await self._change(plan)
        latest = self.latest(job)
        return latest if latest is not None and (latest.version, latest.attempt) == (version, attempt) else None

    async def wait_version(self, job: str, after: int, wait: float, after_attempt: int | None = None
                           ) -> VersionInfo | None:
        """Wait for a published version newer than ``after`` (or, with ``after_attempt``, a later
        attempt of ``after`` itself); returns the latest (maybe older)."""
        key = (after, MAX_ATTEMPT if after_attempt is None else after_attempt)

        def ready() -> bool:
            info = self.latest(job)
            return info is not None and (info.version, info.attempt) > key
        await self.watch.wait("version", job, key, ready, wait)
        return self.latest(job)

    # --- readers ---------------------------------------------------------------------------
    async def report_reader(self, job: str, rank: int, version: int, *, nbytes: int = 0, seconds: float = 0.0,
                            error: str | None = None, attempt: int | None = None) -> None:
        """Record that reader ``rank`` applied ``version`` (or failed to: ``error`` set).

        A failure of an ``attempt`` of the version that a newer attempt superseded is ignored
        (a late report: the reader takes the newer attempt, and the writers wait for it).

        Raises:
            ConflictError: ``rank`` is not a registered reader of ``job``.
        """
        record: dict[str, Any] = {"op": "applied" if error is None else "failed", "job": job, "rank": rank,
                                  "version": version, "nbytes": nbytes, "seconds": seconds, "at": time.time()}
        if error is not None:
            record["error"] = error

        def plan() -> list[dict[str, Any]]:
            state = self.jobs.get(job)
            if state is None or rank not in state.rows["reader"]:
                raise ConflictError(f"reader rank {rank} is not registered in job {job!r}: a reader registers "
                                    "(WeightReader does, on its first update) before it reports progress")
            latest = state.latest
            if (error is not None and attempt is not None and latest is not None and latest.version == version
                    and latest.attempt > attempt):
                return []
            return [record]

        await self._change(plan)

    def readers(self, job: str) -> list[dict[str, Any]]:
        """Every known reader (registered or reported): rank, version, lag, last sync, error."""
        state = self.jobs.get(job)
        if state is None:
            return []
        latest = state.latest.version if state.latest else None
        out = []
        for rank in state.reader_ranks():
            r = state.readers.get(rank, _Reader())
            lag = latest - r.version if latest is not None and r.version is not None else None
            out.append({"rank": rank, "registered": rank in state.rows["reader"], "version": r.version, "lag": lag,
                        "last_sync_at": r.applied_at,
                        "seconds": r.seconds, "nbytes": r.nbytes, "error": r.error,
                        "failed_version": r.failed_version if r.error is not None else None})
        return out

    async def wait_readers(self, job: str, *, min_version: int, count: int, wait: float) -> bool:
        """Wait until ``count`` readers are done with ``min_version`` (applied or failed it, or newer)."""
        def ready() -> bool:
            state = self.jobs.get(job)
            return state is not None and state.settled_count(min_version, count) >= count
        return await self.watch.wait("readers", job, (min_version, count), ready, wait)

    # --- jobs ------------------------------------------------------------------------------
    async def delete_job(self, job: str) -> bool:
        self.leases.drop(job)
        return await self._change(lambda: [{"op": "drop", "job": job}] if job in self.jobs else [])

    def records(self) -> list[dict[str, Any]]:
        """The current state as records (a snapshot: replaying it rebuilds this state)."""
        out: list[dict[str, Any]] = []
        for name, job in self.jobs.items():
            out.extend({"op": "blob", "job": name, "hash": h, "data": d, "at": job.created_at}
                       for h, d in job.blobs.items())
            for role, rows in job.rows.items():
                out.extend({"op": "register", "job": name, "role": role, "rank": rank, "group": row.group,
                            "host": row.host, "endpoints": row.endpoints, "layout": row.layout, "at": row.at}
                           for rank, row in rows.items())
            out.extend({"op": "document", "job": name, "key": k, "value": v, "at": job.updated_at}
                       for k, v in job.documents.items())
            out.extend({"op": "counter", "job": name, "name": k, "value": v, "at": job.updated_at}
                       for k, v in job.counters.items())
            if job.latest is not None:
                out.append({"op": "version", "job": name, "version": job.latest.version,
                            "fingerprint": job.latest.fingerprint, "at": job.latest.published_at,
                            "attempt": job.latest.attempt})
            for version, p in job.pending.items():
                out.extend({"op": "report", "job": name, "version": version, "fingerprint": p.fingerprint,
                            "attempt": p.attempt,
                            "writer_rank": w, "num_writers": p.num_writers, "at": job.updated_at}
                           for w in sorted(p.ranks))
            for rank, r in job.readers.items():
                rec = {"op": "applied" if r.error is None else "failed", "job": name, "rank": rank,
                       "version": r.version if r.error is None else r.failed_version,
                       "nbytes": r.nbytes, "seconds": r.seconds, "at": r.at or 0.0,
                       "applied_at": r.applied_at}
                if r.error is not None:
                    rec["error"] = r.error
                out.append(rec)
        return out

    def job_status(self, name: str) -> dict[str, Any]:
        """One job as plain data (the status page's source)."""
        job = self.jobs[name]
        readers = self.readers(name)
        synced = [r["last_sync_at"] for r in readers if r["last_sync_at"] is not None]
        return {
            "job": name, "created_at": job.created_at, "updated_at": job.updated_at,
            "roster_revision": job.roster_revision,
            "writers": len(job.rows["writer"]), "readers": len(job.rows["reader"]),
            "latest_version": job.latest.to_wire() if job.latest else None,
            "pending_versions": [{"version": v, "fingerprint": p.fingerprint, "reported": len(p.ranks),
                                  "num_writers": p.num_writers} for v, p in sorted(job.pending.items())],
            "last_sync_at": max(synced) if synced else None,
            "reader_state": readers,
            "participants": [{"role": role, "rank": rank, "group": row.group, "host": row.host,
                              "endpoints": row.endpoints, "layout": row.layout[:12]}
                             for role in ROLES for rank, row in sorted(job.rows[role].items())],
            "documents": {k: len(v) for k, v in sorted(job.documents.items())},
            "counters": dict(sorted(job.counters.items())),
            "blobs": {h: len(d) for h, d in job.blobs.items()},
        }

    def status(self, job: str | None = None) -> dict[str, Any]:
        names = sorted(self.jobs) if job is None else [job] if job in self.jobs else []
        return {"server": {"instance": self.instance, "started_at": self.started_at,
                           "uptime_seconds": time.time() - self.started_at,
                           "durable": self.durable, "waiting": self.watch.waiting},
                "jobs": [self.job_status(n) for n in names]}
