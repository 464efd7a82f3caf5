"""Every member of a job as one row: role, rank, host, version, state and lag (``weightsync status``).

A pure join of what the meta server already holds (the job's status: participants, readers'
versions and validity, the latest version; and its leases), so the command line, a router or a
trainer read one table::

    rows = job_members(meta)                      # meta: a MetaClient of the job
    rows = members(meta.status(), meta.leases())  # the same, from data already fetched

States, first match wins:

* ``dead``: its lease expired (no heartbeat within its ttl); ``left``: it released its lease;
* ``invalid``: a failed update left the reader's engine serving a mix of versions;
* ``none``: a reader that has applied no version yet (it serves its start-up weights);
* ``behind``: a reader valid at a version older than the latest published (``lag`` > 0);
* ``valid``: a reader at the latest version, or a live writer.

A writer's version is the latest version the writers published (a version is published once
every writer reported it). A member known only by its lease (registered rows are dropped when a
member leaves) is listed too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.ports.records import LeaseRow

if TYPE_CHECKING:
    from weightsync.meta.client import MetaClient

STATES = ("valid", "behind", "none", "invalid", "left", "dead")


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a job as ``weightsync status`` shows it (see module docstring).

    Attributes:
        since: ``time.time()`` of its last applied version (invalid: since when it is invalid).
        lag: the latest version minus its version (None: no version, or none published).
        error: the error of its last failed update, if it has not applied a version since.
    """

    role: str
    rank: int
    host: str
    version: int | None
    state: str
    lag: int | None
    since: float | None = None
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "host": self.host, "version": self.version,
                "state": self.state, "lag": self.lag, "since": self.since, "error": self.error}


def members(status: Mapping[str, Any], leases: Iterable[LeaseRow]) -> list[Member]:
    """Every member of the job whose status (``MetaClient.status()``) and leases are given,
    ordered by role and rank."""
    latest_info = status.get("latest_version")
    latest = int(latest_info["version"]) if latest_info else None
    lease_of = {(lease.role, lease.rank): lease for lease in leases}
    hosts = {(p["role"], int(p["rank"])): str(p.get("host") or "") for p in status.get("participants", ())}
    readers = {int(r["rank"]): r for r in status.get("reader_state", ())}
    keys = set(hosts) | set(lease_of) | {("reader", rank) for rank in readers}
    out = []
    for role, rank in sorted(keys):
        lease = lease_of.get((role, rank))
        host = hosts.get((role, rank)) or (lease.host if lease is not None else "")
        gone = None if lease is None or lease.alive else "left" if lease.released else "dead"
        if role == "writer":
            out.append(Member(role, rank, host, latest, gone or "valid", 0 if latest is not None else None))
            continue
        row = readers.get(rank, {})
        version = row.get("version")
        lag = latest - version if latest is not None and version is not None else None
        invalid = row.get("state") == "invalid"
        state = gone or ("invalid" if invalid else "none" if version is None else
                         "behind" if lag is not None and lag > 0 else "valid")
        since = row.get("invalid_since") if invalid else row.get("last_sync_at")
        out.append(Member(role, rank, host, version, state, lag, since, row.get("error")))
    return out


def job_members(meta: MetaClient) -> list[Member]:
    """Every member of ``meta``'s job, read from its meta server now."""
    return members(meta.status(), meta.leases())
