"""The meta server's state as a pure reducer: events in, state out.

:func:`apply` is the only code that changes a :class:`MetaData`. It reads nothing but the state
and the event (no clock, no I/O, no asyncio), so the live server and a server replaying its
store reach the same state, and tests replay journals to check it. It returns
:class:`Notice` values that say what changed; the watch layer (:mod:`weightsync.meta.watch`)
turns them into woken long-polls. :func:`snapshot` is the inverse direction: the events that
rebuild a state exactly.

    data = MetaData()
    for event in events:            # from the store, or from a live change
        notices = apply(data, event)
    assert replay(snapshot(data)) == data
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

from weightsync.meta.events import (
    BlobStored,
    CounterSet,
    DocumentPut,
    Event,
    FleetCommanded,
    FleetRestored,
    JobDropped,
    JobRestored,
    ReaderApplied,
    ReaderFailed,
    ReaderRestored,
    Registered,
    VersionPublished,
    VersionReported,
)
from weightsync.meta.fleet.commands import command_from_wire
from weightsync.meta.fleet.decide import decide
from weightsync.ports.fleet import FleetRecord
from weightsync.ports.records import ROLES, VersionInfo

#: epochs of a version are below this (a reader waiting "after version V" waits past them all)
MAX_EPOCH = 1 << 62


@dataclass(slots=True)
class Row:
    group: str
    host: str
    endpoints: dict[str, str]
    layout: str  # blob hash
    at: float


@dataclass(slots=True)
class Pending:
    """A version some writers reported, in one epoch; published once ``num_writers`` did."""

    fingerprint: str
    num_writers: int
    ranks: set[int] = field(default_factory=set)
    epoch: int = 0


@dataclass(slots=True)
class ReaderState:
    version: int | None = None
    nbytes: int = 0
    seconds: float = 0.0
    at: float | None = None  # last report, applied or failed
    applied_at: float | None = None  # last successful sync
    error: str | None = None
    failed_version: int | None = None  # the version of the last failed report
    #: when a failed update left the reader's engine invalid (serving a mix of versions); None: valid
    invalid_since: float | None = None


@dataclass(slots=True)
class Job:
    """One job namespace."""

    name: str
    created_at: float
    rows: dict[str, dict[int, Row]] = field(default_factory=lambda: {role: {} for role in ROLES})
    blobs: dict[str, bytes] = field(default_factory=dict)
    documents: dict[str, bytes] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    latest: VersionInfo | None = None
    pending: dict[int, Pending] = field(default_factory=dict)
    readers: dict[int, ReaderState] = field(default_factory=dict)
    roster_revision: int = 0  # bumped by every registration (roster caches key on it)
    updated_at: float = 0.0
    #: the coordinator's fleet record (None until a member joins) and the changes that made it
    fleet: FleetRecord | None = None
    fleet_revision: int = 0

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

    def readers_done(self, min_version: int, count: int, settled: int, applied: int) -> bool:
        """A writer's wait on readers ``0..count-1`` is over: ``settled`` of them are done with
        ``min_version``, or (``applied`` > 0) that many applied it. The key of the long-poll."""
        return (self.settled_count(min_version, count) >= settled
                or 0 < applied <= self.applied_count(min_version, count))

    def applied_count(self, min_version: int, count: int) -> int:
        """Registered readers of rank below ``count`` that applied ``min_version`` or newer."""
        registered = self.rows["reader"]
        return sum(1 for rank, r in self.readers.items()
                   if rank < count and rank in registered and r.version is not None and r.version >= min_version)


@dataclass(slots=True)
class MetaData:
    """Every job of one server."""

    jobs: dict[str, Job] = field(default_factory=dict)


# -- what changed, for the watch layer ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RosterGrew:
    job: str
    writers: int
    readers: int


@dataclass(frozen=True, slots=True)
class DocumentChanged:
    job: str
    key: str


@dataclass(frozen=True, slots=True)
class CounterChanged:
    job: str
    name: str
    value: int


@dataclass(frozen=True, slots=True)
class VersionChanged:
    job: str
    version: int
    epoch: int


@dataclass(frozen=True, slots=True)
class ReadersChanged:
    job: str


@dataclass(frozen=True, slots=True)
class FleetChanged:
    job: str
    revision: int


Notice = RosterGrew | DocumentChanged | CounterChanged | VersionChanged | ReadersChanged | FleetChanged


# -- the reducer --------------------------------------------------------------------------------

def _job(data: MetaData, name: str, at: float) -> Job:
    job = data.jobs.get(name)
    if job is None:
        job = data.jobs[name] = Job(name, created_at=at, updated_at=at)
    job.updated_at = max(job.updated_at, at)
    return job


def apply(data: MetaData, event: Event) -> list[Notice]:
    """Apply one event to ``data`` (see module docstring); returns what changed."""
    if isinstance(event, JobDropped):
        data.jobs.pop(event.job, None)
        return []
    if isinstance(event, JobRestored):
        job = _job(data, event.job, event.created_at)
        job.created_at, job.updated_at, job.roster_revision = event.created_at, event.updated_at, event.roster_revision
        return []
    job = _job(data, event.job, event.at or 0.0)
    if isinstance(event, BlobStored):
        job.blobs[event.hash] = event.data
        return []
    if isinstance(event, Registered):
        job.rows[event.role][event.rank] = Row(event.group, event.host, dict(event.endpoints), event.layout, event.at)
        job.roster_revision += 1
        return [RosterGrew(job.name, len(job.rows["writer"]), len(job.rows["reader"]))]
    if isinstance(event, DocumentPut):
        job.documents[event.key] = event.value
        return [DocumentChanged(job.name, event.key)]
    if isinstance(event, CounterSet):
        job.counters[event.name] = event.value
        return [CounterChanged(job.name, event.name, event.value)]
    if isinstance(event, VersionReported):
        return _report(job, event)
    if isinstance(event, VersionPublished):
        return _publish(job, VersionInfo(event.version, event.fingerprint, event.at, event.epoch))
    if isinstance(event, (FleetCommanded, FleetRestored)):
        return _fleet(job, event)
    return _reader(job, event)


def _fleet(job: Job, event: FleetCommanded | FleetRestored) -> list[Notice]:
    """The fleet record after ``event``: the stored command decided again at its time (decide is
    pure, so live and replayed records are equal), or the snapshot's record."""
    if isinstance(event, FleetRestored):
        job.fleet, job.fleet_revision = FleetRecord.from_bytes(event.record), event.revision
        return []
    command = command_from_wire(msgpack.unpackb(event.command, raw=False))
    job.fleet = decide(job.fleet or FleetRecord.empty(job.name), command, event.at).record
    job.fleet_revision += 1
    return [FleetChanged(job.name, job.fleet_revision)]


def _report(job: Job, event: VersionReported) -> list[Notice]:
    version, epoch = event.version, event.epoch
    if job.latest is not None and (version, epoch) <= (job.latest.version, job.latest.epoch):
        return []  # already published (a replayed or late report)
    pending = job.pending.get(version)
    if pending is None or pending.epoch < epoch:  # a report in a later epoch supersedes the pending one
        pending = job.pending[version] = Pending(event.fingerprint, event.num_writers, epoch=epoch)
    elif pending.epoch > epoch:
        return []
    pending.ranks.add(event.writer_rank)
    if len(pending.ranks) >= pending.num_writers:
        return _publish(job, VersionInfo(version, event.fingerprint, event.at, epoch))
    return []


def _publish(job: Job, info: VersionInfo) -> list[Notice]:
    if info.epoch > 0:
        # The version written again in a later epoch: failures reported for the version were of
        # an earlier epoch (a reader can fail a version only once it is published); the readers
        # take this one, and the writers' barrier must wait for them again.
        for reader in job.readers.values():
            if reader.failed_version == info.version:
                reader.failed_version = None
    job.latest = info
    for v in [v for v in job.pending if v <= info.version]:
        del job.pending[v]
    return [VersionChanged(job.name, info.version, info.epoch)]


def _reader(job: Job, event: ReaderApplied | ReaderFailed | ReaderRestored) -> list[Notice]:
    state = job.readers.setdefault(event.rank, ReaderState())
    state.at, state.nbytes, state.seconds = event.at, event.nbytes, event.seconds
    if isinstance(event, ReaderRestored):
        state.version, state.failed_version, state.error = event.version, event.failed_version, event.error
        state.applied_at, state.invalid_since = event.applied_at, event.invalid_since
        return []
    if isinstance(event, ReaderApplied):
        state.version, state.applied_at, state.error, state.invalid_since = event.version, event.at, None, None
    else:
        state.error, state.failed_version = event.error, event.version
        if event.invalid:  # invalid since the first failure that left it so
            state.version = None
            state.invalid_since = event.at if state.invalid_since is None else state.invalid_since
        else:  # the failure never touched the engine: it serves what it served
            state.version, state.invalid_since = event.holds, None
    return [ReadersChanged(job.name)]


def replay(events: Iterable[Event], data: MetaData | None = None) -> MetaData:
    """``data`` (or an empty state) with ``events`` applied in order."""
    data = MetaData() if data is None else data
    for event in events:
        apply(data, event)
    return data


def snapshot(data: MetaData) -> list[Event]:
    """The events that rebuild ``data`` exactly (``replay(snapshot(d)) == d``)."""
    out: list[Event] = []
    for name, job in data.jobs.items():
        out.extend(BlobStored(name, h, d, job.created_at) for h, d in job.blobs.items())
        for role, rows in job.rows.items():
            out.extend(Registered(name, role, rank, row.group, row.host, row.endpoints, row.layout, row.at)
                       for rank, row in rows.items())
        out.extend(DocumentPut(name, k, v, job.updated_at) for k, v in job.documents.items())
        out.extend(CounterSet(name, k, v, job.updated_at) for k, v in job.counters.items())
        if job.latest is not None:
            latest = job.latest
            out.append(VersionPublished(name, latest.version, latest.fingerprint, latest.epoch, latest.published_at))
        for version, p in job.pending.items():
            out.extend(VersionReported(name, version, p.fingerprint, p.epoch, w, p.num_writers, job.updated_at)
                       for w in sorted(p.ranks))
        out.extend(ReaderRestored(name, rank, r.version, r.failed_version, r.error, r.nbytes, r.seconds, r.at,
                                  r.applied_at, r.invalid_since) for rank, r in job.readers.items())
        if job.fleet is not None:
            out.append(FleetRestored(name, job.fleet.to_bytes(), job.fleet_revision, job.updated_at))
        out.append(JobRestored(name, job.created_at, job.updated_at, job.roster_revision))
    return out
