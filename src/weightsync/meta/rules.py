"""What a change request means, checked against the state: pure functions from (state, request) to events.

Both coordinators keep the job protocol's rules here, once: the embedded meta server
(:mod:`weightsync.meta.state`, under its lock) and the etcd backend (:mod:`weightsync.meta.etcd`,
inside a compare-and-swap transaction over the keys the rule read). Each function reads only the
:class:`~weightsync.meta.reducer.Job` it is given (None: the job has no state yet) and returns the
events of the change (none: the request changes nothing, e.g. a retry), or raises
:class:`ConflictError` naming what contradicts the state.

    events = version_report(job, "grpo", 7, "fp", writer_rank=0, num_writers=2, epoch=0, at=time.time())
    for event in events:
        apply(data, event)
"""

from __future__ import annotations

from collections.abc import Mapping

from weightsync.meta.events import BlobStored, Event, ReaderApplied, ReaderFailed, Registered, VersionReported
from weightsync.meta.records import blob_hash
from weightsync.meta.reducer import Job

__all__ = ["ConflictError", "published_already", "reader_report", "registration", "version_report"]


class ConflictError(Exception):
    """A request that contradicts the state (the server answers 409 with this message)."""


def registration(state: Job | None, job: str, role: str, rank: int, *, group: str, host: str,
                 endpoints: Mapping[str, str], layout: bytes, at: float) -> list[Event]:
    """Register a rank: its events, none if it is registered identically already.

    Raises:
        ConflictError: the rank is registered with different data.
    """
    h = blob_hash(layout)
    row = state.rows[role].get(rank) if state else None
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
    events: list[Event] = []
    if state is None or h not in state.blobs:
        events.append(BlobStored(job, h, bytes(layout), at))
    events.append(Registered(job, role, rank, group, host, endpoints, h, at))
    return events


def version_report(state: Job | None, job: str, version: int, fingerprint: str, *,
                   writer_rank: int, num_writers: int, epoch: int, at: float) -> list[Event]:
    """One writer says ``version`` is ready in ``epoch``: its event, none for a retry or a late writer.

    Reads ``state.latest`` and ``state.pending[version]`` only.

    Raises:
        ConflictError: an older version or epoch, a different fingerprint or writer count.
    """
    if published_already(state, job, version, fingerprint, writer_rank=writer_rank, epoch=epoch):
        return []  # a retry or a late writer
    pending = state.pending.get(version) if state else None
    if pending is not None and pending.epoch > epoch:
        raise ConflictError(f"writer rank {writer_rank} reports epoch {epoch} of version {version}, but "
                            f"writer ranks {sorted(pending.ranks)[:8]} publish epoch {pending.epoch}")
    if pending is not None and pending.epoch == epoch:
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
    return [VersionReported(job, version, fingerprint, epoch, writer_rank, num_writers, at)]


def published_already(state: Job | None, job: str, version: int, fingerprint: str, *, writer_rank: int,
                      epoch: int) -> bool:
    """Whether (version, epoch) is the published one, reported again; raises when it is not
    newer than the published one otherwise."""
    latest = state.latest if state else None
    if latest is None or (version, epoch) > (latest.version, latest.epoch):
        return False
    if (version, epoch) == (latest.version, latest.epoch) and fingerprint == latest.fingerprint:
        return True
    if version == latest.version and epoch < latest.epoch:
        raise ConflictError(f"writer rank {writer_rank} reports epoch {epoch} of version {version}, "
                            f"but epoch {latest.epoch} of it is published already")
    if version == latest.version:
        raise ConflictError(f"writer rank {writer_rank} reports version {version} with fingerprint "
                            f"{fingerprint!r}, but it was published with fingerprint "
                            f"{latest.fingerprint!r}: the writers planned different syncs")
    raise ConflictError(f"version {version} is older than the published version {latest.version} of "
                        f"job {job!r}: versions must increase")


def reader_report(state: Job | None, event: ReaderApplied | ReaderFailed, *, epoch: int | None) -> list[Event]:
    """A reader's report (applied, or failed the version as published in ``epoch``): its event,
    none for a failure of an epoch that a later one superseded (a late report: the reader takes
    the newer one, and the writers wait for it).

    Reads ``state.rows["reader"]`` and ``state.latest`` only.

    Raises:
        ConflictError: the rank is not a registered reader of the job.
    """
    if state is None or event.rank not in state.rows["reader"]:
        raise ConflictError(f"reader rank {event.rank} is not registered in job {event.job!r}: a reader registers "
                            "(WeightReader does, on its first update) before it reports progress")
    latest = state.latest
    if (isinstance(event, ReaderFailed) and epoch is not None and latest is not None
            and latest.version == event.version and latest.epoch > epoch):
        return []
    return [event]
