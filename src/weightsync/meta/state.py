"""The meta server's service layer: requests checked against the state, turned into events, stored.

Three layers, each in its own module:

* the **reducer** (:mod:`weightsync.meta.reducer`): the state, and the pure function that applies
  one event (:mod:`weightsync.meta.events`) to it;
* the **watches** (:mod:`weightsync.meta.watch`): long-polls woken by what the reducer says changed;
* this **service**: each request validates against the current state and yields the events of
  its change, under one asyncio lock; the events are committed to the store (:mod:`weightsync.meta.store`:
  SQLite with a state directory, memory without), and only once they are durable applied and
  answered. A change the store cannot take (a full disk) is refused whole: nothing in memory or
  on disk changes, and the same request succeeds once the store can take it. A restarted server
  replays the stored events through the same reducer, so live and recovered state cannot drift
  apart.

The status view (:mod:`weightsync.meta.views`) reads the state; nothing here sleeps or polls.

    state = MetaState(SqliteStore(dir))  # or MetaState(): memory only
    state.load()                        # replay the store (refuses a damaged one)
    await state.start()
    created = await state.register("job", "writer", 0, group="train", host="h", endpoints={}, layout=b"")
    await state.wait_registered("job", writers=1, readers=0, wait=5.0)
    await state.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from weightsync.clock.clock import SYSTEM, Clock
from weightsync.meta import views
from weightsync.meta.events import (
    CounterSet,
    DocumentPut,
    Event,
    EventError,
    FleetCommanded,
    JobDropped,
    ReaderApplied,
    ReaderFailed,
    encode_events,
)
from weightsync.meta.fleet.commands import Command, Expire, Tick, command_to_wire
from weightsync.meta.fleet.decide import Decision, deadline_due, decide, renewed_member
from weightsync.meta.fleet.leases import FleetLeases
from weightsync.meta.leases import Leases
from weightsync.meta.reducer import MAX_EPOCH, Job, MetaData, apply, snapshot
from weightsync.meta.rules import ConflictError, reader_report, registration, version_report
from weightsync.meta.store import MemoryStore, Store, StoreError
from weightsync.meta.watch import Watch, notify
from weightsync.ports.fleet import FleetRecord
from weightsync.ports.records import VersionInfo

logger = logging.getLogger(__name__)

__all__ = ["MAX_EPOCH", "ConflictError", "MetaState", "RecordError"]


#: A change whose events cannot be stored (the server answers 422; nothing is applied).
RecordError = EventError


class MetaState:
    """All jobs of one server. Methods run on the server's event loop only."""

    def __init__(self, store: Store | None = None, *, clock: Clock = SYSTEM, fleet_tick: float | None = 1.0) -> None:
        self.data = MetaData()
        self.watch = Watch()
        #: the time of leases and of the fleet coordinator's decisions (a test passes a ManualClock)
        self.leases = Leases(clock)
        self.clock = clock
        self.fleet_leases = FleetLeases(clock)
        self._fleet_tick = fleet_tick  # seconds between the fleet timer's ticks (None: no timer)
        self._fleet_timer: asyncio.Task[None] | None = None
        self.started_at = time.time()
        #: Who this state is: new with every empty state, kept in the state directory. Clients
        #: pin it; a server restarted without its state answers with another one (see server.py).
        self.instance = secrets.token_hex(8)
        self.store: Store = store if store is not None else MemoryStore()
        self._lock = asyncio.Lock()
        self._rosters: dict[tuple[str, bool], tuple[Job, int, bytes]] = {}  # encoded rosters, per revision
        self._clock: asyncio.Task[None] | None = None

    @property
    def jobs(self) -> dict[str, Job]:
        return self.data.jobs

    @property
    def durable(self) -> bool:
        return self.store.durable

    # --- lifecycle -------------------------------------------------------------------------
    def load(self) -> int:
        """Open the store and replay it (before serving). Returns the number of events replayed.

        Raises:
            StoreDamagedError: the store fails its integrity check (the message says how to recover).
        """
        opened = self.store.open(self.instance)
        self.instance = opened.instance
        for event in opened.events:
            apply(self.data, event)
        if opened.events:
            self._compact()  # start from a compact snapshot
        logger.info("meta state: replayed %d events: %d jobs", len(opened.events), len(self.jobs))
        return len(opened.events)

    def _compact(self) -> None:
        try:
            self.store.compact(snapshot(self.data))
        except StoreError as exc:  # the log is intact; compaction is tried again later
            logger.warning("meta state: compaction failed: %s", exc)

    async def start(self) -> None:
        """Start what runs beside the requests: the clock that keeps a stalled server from
        expiring live leases (:meth:`Leases.keep_time`)."""
        self._clock = asyncio.create_task(self.leases.keep_time(), name="weightsync-lease-clock")
        if self._fleet_tick is not None:
            self._fleet_timer = asyncio.create_task(self._tick_fleets(self._fleet_tick), name="weightsync-fleet-timer")

    async def _tick_fleets(self, every: float) -> None:
        """The fleet timer: :meth:`fleet_tick` for every job with a fleet, every ``every`` seconds."""
        while True:
            await asyncio.sleep(every)
            for job in [name for name, j in self.jobs.items() if j.fleet is not None]:
                try:
                    await self.fleet_tick(job)
                except StoreError as exc:  # the store is full: the next tick tries again
                    logger.warning("fleet timer: job %s: %s", job, exc)

    async def close(self) -> None:
        """Wake every long-poll (they answer with what they have) and close the store."""
        for task in (self._clock, self._fleet_timer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._clock = self._fleet_timer = None
        self.watch.close()
        async with self._lock:  # a change being committed finishes first
            self.store.close()

    def records(self) -> list[Event]:
        """The current state as events (a snapshot: replaying it rebuilds this state)."""
        return snapshot(self.data)

    async def _change(self, plan: Callable[[], list[Event]]) -> bool:
        """Run ``plan`` (validate against the current state, return the change's events), commit the
        events to the store and only then apply them. Returns whether anything changed.

        Validation, commit and application happen under the lock, so no other change interleaves.
        A commit that fails raises (StoreError: nothing was stored, nothing is applied). The work
        runs as its own task: a request cancelled meanwhile (its client went away) does not leave
        a committed change unapplied.
        """
        task = asyncio.ensure_future(self._commit(plan))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, even if nobody awaits
        return await asyncio.shield(task)

    async def _commit(self, plan: Callable[[], list[Event]]) -> bool:
        async with self._lock:
            events = plan()
            if not events:
                return False
            encoded = encode_events(events)  # an event the store cannot hold is refused here, whole
            if self.store.durable:
                await asyncio.to_thread(self.store.commit, events, encoded)
            for event in events:
                for notice in apply(self.data, event):
                    notify(self.watch, self.data, notice)
            if self.store.needs_compaction:
                snap = snapshot(self.data)
                try:
                    await asyncio.to_thread(self.store.compact, snap)
                except StoreError as exc:  # the log is intact; compaction is tried again later
                    logger.warning("meta state: compaction failed: %s", exc)
        return True

    def broken(self) -> str | None:
        """Why this server cannot store changes right now (the last commit failed), or None."""
        return self.store.broken()

    # --- participants ----------------------------------------------------------------------
    async def register(self, job: str, role: str, rank: int, *, group: str, host: str,
                       endpoints: Mapping[str, str], layout: bytes) -> bool:
        """Register a rank; True if new, False if it was already registered identically.

        Raises:
            ConflictError: the rank is registered with different data.
        """
        def plan() -> list[Event]:
            return registration(self.jobs.get(job), job, role, rank, group=group, host=host, endpoints=endpoints,
                                layout=layout, at=time.time())

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
            return views.encode_roster(job, None, msgpack_=msgpack_)
        cached = self._rosters.get((job, msgpack_))
        if cached is None or cached[0] is not state or cached[1] != state.roster_revision:
            cached = (state, state.roster_revision, views.encode_roster(job, state, msgpack_=msgpack_))
            self._rosters[(job, msgpack_)] = cached
        return cached[2]

    # --- documents -------------------------------------------------------------------------
    async def put_document(self, job: str, key: str, value: bytes) -> None:
        def plan() -> list[Event]:
            if self.document(job, key) == value:
                return []
            return [DocumentPut(job, key, bytes(value), time.time())]

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
        """Set counter ``name`` to ``value`` if it holds ``expected``, atomically (one event under
        the state's lock). Returns (whether it was set, the value it holds now)."""
        def plan() -> list[Event]:
            if self.counter(job, name) != expected:
                return []
            return [CounterSet(job, name, value, time.time())]

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
                             num_writers: int, epoch: int = 0) -> VersionInfo | None:
        """One writer says ``version`` is ready; returns the VersionInfo once all writers did.

        ``epoch`` is the job's transport epoch the writers wrote the version in: writers that
        failed a version write it again in a later epoch, which supersedes the earlier one,
        published or pending.

        Raises:
            ConflictError: an older version or epoch, a different fingerprint or writer count.
        """
        def plan() -> list[Event]:
            return version_report(self.jobs.get(job), job, version, fingerprint, writer_rank=writer_rank,
                                  num_writers=num_writers, epoch=epoch, at=time.time())

        await self._change(plan)
        latest = self.latest(job)
        return latest if latest is not None and (latest.version, latest.epoch) == (version, epoch) else None

    async def wait_version(self, job: str, after: int, wait: float, after_epoch: int | None = None
                           ) -> VersionInfo | None:
        """Wait for a published version newer than ``after`` (or, with ``after_epoch``, version
        ``after`` written again in a later epoch); returns the latest (maybe older)."""
        key = (after, MAX_EPOCH if after_epoch is None else after_epoch)

        def ready() -> bool:
            info = self.latest(job)
            return info is not None and (info.version, info.epoch) > key
        await self.watch.wait("version", job, key, ready, wait)
        return self.latest(job)

    # --- readers ---------------------------------------------------------------------------
    async def report_reader(self, job: str, rank: int, version: int, *, nbytes: int = 0, seconds: float = 0.0,
                            error: str | None = None, epoch: int | None = None, invalid: bool = True,
                            holds: int | None = None) -> None:
        """Record that reader ``rank`` applied ``version`` (or failed to: ``error`` set; its engine
        then is ``invalid``, or still serves ``holds``).

        A failure of the version as published in ``epoch``, when it is published in a later
        epoch since, is ignored (a late report: the reader takes the newer one, and the writers
        wait for it).

        Raises:
            ConflictError: ``rank`` is not a registered reader of ``job``.
        """
        at = time.time()
        event: ReaderApplied | ReaderFailed = (ReaderApplied(job, rank, version, nbytes, seconds, at) if error is None
                        else ReaderFailed(job, rank, version, error, nbytes, seconds, at, invalid, holds))

        def plan() -> list[Event]:
            return reader_report(self.jobs.get(job), event, epoch=epoch)

        await self._change(plan)

    def readers(self, job: str) -> list[dict[str, Any]]:
        """Every known reader (registered or reported): rank, version, lag, last sync, error."""
        return views.reader_rows(self.jobs.get(job))

    async def wait_readers(self, job: str, *, min_version: int, count: int, wait: float,
                           settled: int | None = None, applied: int = 0) -> bool:
        """Wait until readers ``0..count-1`` are done with ``min_version`` (applied or failed it, or
        newer): ``settled`` of them (all by default), or ``applied`` of them (when positive) applied it."""
        key = (min_version, count, count if settled is None else settled, applied)

        def ready() -> bool:
            state = self.jobs.get(job)
            return state is not None and state.readers_done(*key)
        return await self.watch.wait("readers", job, key, ready, wait)

    # --- jobs ------------------------------------------------------------------------------
    # --- the fleet coordinator (docs/fleet.md) -------------------------------------------------
    def fleet(self, job: str) -> FleetRecord:
        """The job's fleet record (empty until a member joins)."""
        state = self.jobs.get(job)
        return state.fleet if state is not None and state.fleet is not None else FleetRecord.empty(job)

    def fleet_revision(self, job: str) -> int:
        state = self.jobs.get(job)
        return state.fleet_revision if state is not None else 0

    async def decide_fleet(self, job: str, command: Command, *, ttl: float | None = None) -> Decision:
        """Apply ``command`` to the job's fleet record through ``decide``, under the lock, at the
        clock's time; a change is stored (as the command: a restart decides it again) before it
        is applied. A member's command renews its lease (``ttl``: its lease period, on a join).

        Raises:
            FleetConflictError: the command contradicts the job (nothing changes).
        """
        now = self.clock.now()
        box: list[Decision] = []

        def plan() -> list[Event]:
            record = self.fleet(job)
            box.append(decide(record, command, now))
            if box[0].record is record:
                return []
            return [FleetCommanded(job, msgpack.packb(command_to_wire(command), use_bin_type=True), now)]

        await self._change(plan)
        decision = box[0]
        member = renewed_member(command, decision)
        if member is not None:
            self.fleet_leases.renew(job, *member, ttl=ttl)
        return decision

    def fleet_beat(self, job: str, role: str, id_: int, incarnation: str) -> bool:
        """A member's heartbeat; False: it is not a live member (its lease expired, or it left)."""
        m = self.fleet(job).member(role, id_)
        if m is None or not m.live or m.incarnation != incarnation:
            return False
        self.fleet_leases.renew(job, role, id_, incarnation)
        return True

    async def fleet_tick(self, job: str) -> list[Expire]:
        """Declare dead the members whose lease ran out, then decide the tries whose deadline came
        (what the server's timer runs for every job). Returns the members declared dead."""
        expired = self.fleet_leases.expired(job, self.fleet(job))
        for command in expired:
            await self.decide_fleet(job, command)
        now = self.clock.now()
        if deadline_due(self.fleet(job), now):
            await self.decide_fleet(job, Tick())
        return expired

    async def wait_fleet(self, job: str, after: int, wait: float) -> tuple[int, FleetRecord]:
        """Wait until the fleet record changed past revision ``after``; returns (revision, record)."""
        await self.watch.wait("fleet", job, after, lambda: self.fleet_revision(job) > after, wait)
        return self.fleet_revision(job), self.fleet(job)

    async def delete_job(self, job: str) -> bool:
        self.leases.drop(job)
        self.fleet_leases.drop(job)
        return await self._change(lambda: [JobDropped(job)] if job in self.jobs else [])

    def job_status(self, name: str) -> dict[str, Any]:
        """One job as plain data (the status page's source)."""
        return views.job_status(self.jobs[name])

    def status(self, job: str | None = None) -> dict[str, Any]:
        server = {"instance": self.instance, "started_at": self.started_at,
                  "uptime_seconds": time.time() - self.started_at, "durable": self.durable,
                  "waiting": self.watch.waiting}
        return views.status(self.data, server=server, job=job)
