"""What the meta server shows of its state: the bulk roster, reader rows and the status view.

Pure functions of :class:`~weightsync.meta.reducer.MetaData` (plus the server facts the status
names), so ``GET /v1/status``, the HTML page and ``/metrics`` all read one thing.

    rows = reader_rows(data.jobs["grpo"])             # rank, state, version, lag, last sync, error
    page = status(data, server={"instance": ...})     # {"server": ..., "jobs": [...]}
"""

from __future__ import annotations

from typing import Any

from weightsync.meta import wire
from weightsync.meta.records import encode_columns
from weightsync.meta.reducer import Job, MetaData, ReaderState
from weightsync.ports.fleet.policy import COMPLETIONS_KEY, Completion
from weightsync.ports.records import ROLES


def encode_roster(name: str, job: Job | None, *, msgpack_: bool) -> bytes:
    """The columnar roster of a job (see :mod:`weightsync.meta.records`), encoded."""
    if job is None:
        return wire.encode({"job": name, "roster_revision": 0, "blobs": {}, "participants": {}}, msgpack_=msgpack_)[0]
    participants = {}
    for role in ROLES:
        rows = sorted(job.rows[role].items())
        participants[role] = encode_columns([(rank, row.group, row.host, row.endpoints, row.layout)
                                             for rank, row in rows])
    used = {row.layout for rows in job.rows.values() for row in rows.values()}
    obj = {"job": name, "roster_revision": job.roster_revision,
           "blobs": {h: job.blobs[h] for h in sorted(used)}, "participants": participants}
    return wire.encode(obj, msgpack_=msgpack_)[0]


def reader_state(r: ReaderState) -> str:
    """``valid`` (serves a version), ``invalid`` (a failed update left its engine a mix of versions)
    or ``none`` (no version reported: a reader that has not synced yet serves what it started with)."""
    return "invalid" if r.invalid_since is not None else "valid" if r.version is not None else "none"


def reader_rows(job: Job | None) -> list[dict[str, Any]]:
    """Every known reader (registered or reported): rank, state, version, lag, last sync, error."""
    if job is None:
        return []
    latest = job.latest.version if job.latest else None
    out = []
    for rank in job.reader_ranks():
        r = job.readers.get(rank, ReaderState())
        lag = latest - r.version if latest is not None and r.version is not None else None
        out.append({"rank": rank, "registered": rank in job.rows["reader"], "state": reader_state(r),
                    "version": r.version, "lag": lag, "invalid_since": r.invalid_since,
                    "last_sync_at": r.applied_at, "seconds": r.seconds, "nbytes": r.nbytes, "error": r.error,
                    "failed_version": r.failed_version if r.error is not None else None})
    return out


def completion_rows(job: Job, readers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest versions under a quorum or fraction policy, newest first, as writer 0 posted
    them (:data:`~weightsync.ports.fleet.policy.COMPLETIONS_KEY`), each with the readers that
    missed it and hold it (or newer) now: ``caught_up``. A malformed document is one row saying so."""
    raw = job.documents.get(COMPLETIONS_KEY)
    if raw is None:
        return []
    try:
        items = wire.unpack(raw)
        if not isinstance(items, list):
            raise ValueError(f"a list of completions, not {type(items).__name__}")
        completions = [Completion.from_wire(item) for item in items]
    except ValueError as exc:
        return [{"error": f"the {COMPLETIONS_KEY!r} document is malformed: {exc}"}]
    held = {r["rank"]: r["version"] for r in readers}
    return [{**c.to_wire(), "caught_up": [r for r in sorted(c.missed) if (held.get(r) or -1) >= c.version]}
            for c in reversed(completions)]


def job_status(job: Job) -> dict[str, Any]:
    """One job as plain data (the status page's source)."""
    readers = reader_rows(job)
    synced = [r["last_sync_at"] for r in readers if r["last_sync_at"] is not None]
    return {
        "job": job.name, "created_at": job.created_at, "updated_at": job.updated_at,
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
        "completions": completion_rows(job, readers),
        "documents": {k: len(v) for k, v in sorted(job.documents.items())},
        "counters": dict(sorted(job.counters.items())),
        "blobs": {h: len(d) for h, d in job.blobs.items()},
    }


def status(data: MetaData, *, server: dict[str, Any], job: str | None = None) -> dict[str, Any]:
    """Every job (or ``job`` alone) and the server's own facts."""
    names = sorted(data.jobs) if job is None else [job] if job in data.jobs else []
    return {"server": server, "jobs": [job_status(data.jobs[n]) for n in names]}
