"""What weightsync stores in etcd: one key per record, under ``<prefix>/jobs/<job>/``, msgpack values.

=======================================  =================================================
key (under ``<prefix>/jobs/<job>/``)     value
=======================================  =================================================
``doc/<key>``                            the document's bytes
``ctr/<name>``                           the counter, as decimal ASCII
``part/<role>/<rank:010d>``              ``[group, host, endpoints, layout hash, at]``
``blob/<hash>``                          a layout blob (content-addressed, stored once)
``part/roster``                          the encoded columnar roster with its writer and
                                         reader counts (a cache: rebuilt when stale; under
                                         ``part/`` so that one watch sees it and registrations)
``barrier/<W>-<R>``                      empty: some rank waits for W writers and R readers
``ver/latest``                           the published :class:`VersionInfo`
``ver/pending/<version:020d>``           a version some writers reported (fingerprint, epoch,
                                         writer count, ranks)
``reader/<rank:010d>``                   the reader's last report (``ReaderState``)
``lease/<role>/<rank:010d>``             who holds the rank (incarnation, pid, host, ttl,
                                         released): kept after the holder dies
``alive/<role>/<rank:010d>``             the holder's incarnation, attached to its etcd lease:
                                         gone once the lease expires
``fleet/record``                         the fleet record and its revision (``{"revision",
                                         "record"}``), put by compare-and-put only
``fleet/alive/<role>/<id:010d>``         a fleet member's incarnation and lease period,
                                         attached to its etcd lease (:mod:`.fleet`)
=======================================  =================================================

``<prefix>/instance`` (a random id) tells this store from a wiped or replaced one
(:meth:`~weightsync.meta.etcd.client.EtcdMetaClient.pin_instance`).

:func:`load_job` rebuilds a :class:`~weightsync.meta.reducer.Job` from any subset of these keys,
so the rules (:mod:`weightsync.meta.rules`) and views (:mod:`weightsync.meta.views`) of the
embedded server read the etcd state unchanged.
"""

from __future__ import annotations

from typing import Any

from weightsync.meta import wire
from weightsync.meta.etcd.ops import Row
from weightsync.meta.reducer import Job, Pending, ReaderState
from weightsync.meta.reducer import Row as Registration
from weightsync.ports.records import VersionInfo

_READER_FIELDS = ("version", "nbytes", "seconds", "at", "applied_at", "error", "failed_version", "invalid_since")


class JobKeys:
    """The keys of one job (see module docstring)."""

    def __init__(self, prefix: str, job: str) -> None:
        self.job = job
        self.instance = f"{prefix}/instance"
        self.root = f"{prefix}/jobs/{job}/"

    def doc(self, key: str) -> str:
        return f"{self.root}doc/{key}"

    def counter(self, name: str) -> str:
        return f"{self.root}ctr/{name}"

    def part(self, role: str, rank: int | None = None) -> str:
        return f"{self.root}part/{role}/" + ("" if rank is None else f"{rank:010d}")

    def blob(self, h: str = "") -> str:
        return f"{self.root}blob/{h}"

    def barrier(self, writers: int | None = None, readers: int | None = None) -> str:
        """A barrier's key (no counts: the prefix of every barrier's)."""
        return f"{self.root}barrier/" + ("" if writers is None else f"{writers}-{readers}")

    @property
    def roster(self) -> str:
        return f"{self.root}part/roster"

    @property
    def latest(self) -> str:
        return f"{self.root}ver/latest"

    def pending(self, version: int | None = None) -> str:
        return f"{self.root}ver/pending/" + ("" if version is None else f"{version:020d}")

    def reader(self, rank: int | None = None) -> str:
        return f"{self.root}reader/" + ("" if rank is None else f"{rank:010d}")

    def lease(self, role: str = "", rank: int | None = None) -> str:
        return f"{self.root}lease/" + (f"{role}/" if role else "") + ("" if rank is None else f"{rank:010d}")

    def alive(self, role: str = "", rank: int | None = None) -> str:
        return f"{self.root}alive/" + (f"{role}/" if role else "") + ("" if rank is None else f"{rank:010d}")

    @property
    def fleet_record(self) -> str:
        return f"{self.root}fleet/record"

    def fleet_alive(self, role: str = "", id_: int | None = None) -> str:
        return f"{self.root}fleet/alive/" + (f"{role}/" if role else "") + ("" if id_ is None else f"{id_:010d}")


# -- values ------------------------------------------------------------------------------------------

def pack_registration(row: Registration) -> bytes:
    return wire.pack([row.group, row.host, dict(row.endpoints), row.layout, row.at])


def pack_pending(p: Pending) -> bytes:
    return wire.pack({"fingerprint": p.fingerprint, "num_writers": p.num_writers, "epoch": p.epoch,
                      "ranks": sorted(p.ranks)})


def pack_reader(r: ReaderState) -> bytes:
    return wire.pack({name: getattr(r, name) for name in _READER_FIELDS})


def pack_latest(info: VersionInfo) -> bytes:
    return wire.pack(info.to_wire())


def load_job(keys: JobKeys, rows: list[Row]) -> Job:
    """The job as far as ``rows`` (keys of this job) tell it; other parts stay empty.

    Raises:
        ValueError: a value is malformed (names the key): something other than weightsync wrote it.
    """
    job = Job(keys.job, created_at=0.0)
    for row in rows:
        kind, _, rest = row.key[len(keys.root):].partition("/")
        try:
            _load_one(job, kind, rest, row.value)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"etcd key {row.key!r} holds a malformed value ({exc!r}); only weightsync may write "
                             f"under {keys.root}") from None
    return job


def _load_one(job: Job, kind: str, rest: str, value: bytes) -> None:
    if kind == "part":
        role, rank = rest.split("/")
        group, host, endpoints, layout, at = wire.unpack(value)
        job.rows[role][int(rank)] = Registration(str(group), str(host), dict(endpoints), str(layout), float(at))
    elif kind == "blob":
        job.blobs[rest] = value
    elif kind == "doc":
        job.documents[rest] = value
    elif kind == "ctr":
        job.counters[rest] = int(value)
    elif kind == "ver" and rest == "latest":
        job.latest = VersionInfo.from_wire(wire.unpack(value))
    elif kind == "ver":
        obj: dict[str, Any] = wire.unpack(value)
        job.pending[int(rest.rsplit("/", 1)[1])] = Pending(str(obj["fingerprint"]), int(obj["num_writers"]),
                                                           {int(r) for r in obj["ranks"]}, int(obj["epoch"]))
    elif kind == "reader":
        obj = wire.unpack(value)
        job.readers[int(rest)] = ReaderState(**{name: obj.get(name) for name in _READER_FIELDS})  # type: ignore[arg-type]
