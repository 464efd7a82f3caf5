"""Versions and reader reports on etcd: each report one compare-and-swap transaction over the keys its rule read.

The rules are the embedded server's (:mod:`weightsync.meta.rules`), applied by the same reducer
(:mod:`weightsync.meta.reducer`) to the part of the job the rule reads (:func:`~weightsync.meta.etcd.schema.load_job`);
what changed is written back in one transaction that compares the revisions of every key read,
so two writers reporting at once never lose a report: the loser reads and decides again.
"""

from __future__ import annotations

import time
from typing import Any

from weightsync.meta import calls, rules
from weightsync.meta.client_base import newer_than, readers_result
from weightsync.meta.etcd import ops
from weightsync.meta.etcd.base import EtcdBase
from weightsync.meta.etcd.schema import load_job, pack_latest, pack_pending, pack_reader
from weightsync.meta.events import ReaderApplied, ReaderFailed, VersionReported
from weightsync.meta.reducer import Job, MetaData, apply
from weightsync.meta.views import reader_rows
from weightsync.ports.records import ReaderReport, VersionInfo


class Versions(EtcdBase):
    """The version and reader calls of :class:`~weightsync.meta.etcd.client.EtcdMetaClient`."""

    def publish_version(self, version: int, fingerprint: str, *, writer_rank: int, num_writers: int,
                        epoch: int = 0) -> VersionInfo | None:
        """One writer's "version ``version`` is ready" (see :meth:`weightsync.meta.client.MetaClient.publish_version`).

        Raises:
            ValueError: another writer reported a different fingerprint, or the version is not newer.
        """
        calls.publish_version(self.job, version, fingerprint, writer_rank=writer_rank, num_writers=num_writers,
                              epoch=epoch)  # checks the arguments as the HTTP client does
        keys = self.keys
        while True:
            wanted = [ops.read(keys.latest), ops.read(keys.pending(version))]
            if epoch > 0:
                wanted.append(ops.read(keys.reader(), prefix=True))
            rows, _ = self.rows(*wanted)
            job = load_job(keys, rows)
            seen = {row.key: row.mod_revision for row in rows}
            try:
                events = rules.version_report(job, self.job, version, fingerprint, writer_rank=writer_rank,
                                              num_writers=num_writers, epoch=epoch, at=time.time())
            except rules.ConflictError as exc:
                raise ValueError(str(exc)) from None
            if not events:
                return _if_published(job, version, epoch)
            assert isinstance(events[0], VersionReported), events
            before = {rank: r.failed_version for rank, r in job.readers.items()}
            apply(MetaData({self.job: job}), events[0])
            compare = [ops.unchanged(keys.latest, seen.get(keys.latest, 0)),
                       ops.unchanged(keys.pending(version), seen.get(keys.pending(version), 0))]
            published = _if_published(job, version, epoch)
            if published is None:
                success = [ops.put(keys.pending(version), pack_pending(job.pending[version]))]
            else:
                success = [ops.put(keys.latest, pack_latest(published)), _delete_pending_through(keys.pending, version)]
                for rank, r in job.readers.items():
                    if r.failed_version != before[rank]:  # failures of an earlier epoch of this version
                        compare.append(ops.unchanged(keys.reader(rank), seen[keys.reader(rank)]))
                        success.append(ops.put(keys.reader(rank), pack_reader(r)))
            ok, _ = self.txn(compare, success, what=f"publish version {version}")
            if ok:
                return published

    def latest_version(self) -> VersionInfo | None:
        return self._latest()[0]

    def _latest(self) -> tuple[VersionInfo | None, int]:
        rows, revision = self.rows(ops.read(self.keys.latest))
        return load_job(self.keys, rows).latest, revision

    def wait_version(self, after: int, timeout: float, *, after_epoch: int | None = None) -> VersionInfo | None:
        """A published version newer than ``after`` (with ``after_epoch``: or version ``after``
        published again in a later epoch), watched for up to ``timeout`` seconds; None on timeout."""
        calls.latest_version(self.job, after=after, after_epoch=after_epoch)  # checks the arguments
        newer = newer_than(after, after_epoch)
        info = self.wait(self.keys.latest, self._latest, newer, timeout)
        return info if newer(info) else None

    # -- readers -------------------------------------------------------------------------------------
    def report_applied(self, reader_rank: int, version: int, *, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Reader ``reader_rank`` now serves ``version``."""
        calls.report_applied(self.job, reader_rank, version, nbytes=nbytes, seconds=seconds)
        self._report(ReaderApplied(self.job, reader_rank, version, nbytes, float(seconds), time.time()), None)

    def report_failed(self, reader_rank: int, version: int, error: str, *, epoch: int | None = None,
                      invalid: bool = True, holds: int | None = None) -> None:
        """Reader ``reader_rank`` failed to apply ``version`` (see
        :meth:`weightsync.meta.client.MetaClient.report_failed`)."""
        calls.report_failed(self.job, reader_rank, version, error, epoch, invalid=invalid, holds=holds)
        self._report(ReaderFailed(self.job, reader_rank, version, str(error)[:4096], 0, 0.0, time.time(),
                                  bool(invalid), None if invalid else holds), epoch)

    def _report(self, event: ReaderApplied | ReaderFailed, epoch: int | None) -> None:
        keys = self.keys
        mine = keys.reader(event.rank)
        while True:
            rows, _ = self.rows(ops.read(keys.part("reader", event.rank)), ops.read(keys.latest), ops.read(mine))
            job = load_job(keys, rows)
            seen = {row.key: row.mod_revision for row in rows}
            try:
                events = rules.reader_report(job, event, epoch=epoch)
            except rules.ConflictError as exc:
                raise ValueError(str(exc)) from None
            if not events:
                return
            apply(MetaData({self.job: job}), events[0])
            compare = [ops.unchanged(k, seen.get(k, 0)) for k in (keys.part("reader", event.rank), keys.latest, mine)]
            ok, _ = self.txn(compare, [ops.put(mine, pack_reader(job.readers[event.rank]))],
                             what=f"report reader {event.rank}'s version {event.version}")
            if ok:
                return

    def _reader_report(self) -> tuple[ReaderReport, int]:
        keys = self.keys
        rows, revision = self.rows(ops.read(keys.part("reader"), prefix=True), ops.read(keys.reader(), prefix=True),
                                   ops.read(keys.latest))
        job = load_job(keys, rows)
        return ReaderReport(job.latest, tuple(reader_rows(job))), revision

    def reader_versions(self) -> dict[int, int | None]:
        """Reader rank -> last applied version (None: never applied, or failed since)."""
        return self._reader_report()[0].versions

    def wait_reader_report(self, *, min_version: int, readers: int, timeout: float, settled: int | None = None,
                           applied: int = 0) -> ReaderReport:
        """Watch until reader ranks ``0..readers-1`` are done with ``min_version`` (see
        :meth:`weightsync.meta.client.MetaClient.wait_readers`).

        Raises:
            TimeoutError: naming the laggards and their versions.
        """
        calls.readers(self.job, min_version=min_version, count=readers, settled=settled,
                      applied=applied)  # checks the arguments
        report = self.wait(self.keys.reader(), self._reader_report,
                           lambda r: r.enough(min_version, readers, settled=settled, applied=applied), timeout,
                           prefix=True)
        readers_result(report, self.job, min_version, readers, timeout, settled=settled, applied=applied)
        return report

    def wait_readers(self, *, min_version: int, readers: int, timeout: float) -> dict[int, int | None]:
        return self.wait_reader_report(min_version=min_version, readers=readers, timeout=timeout).versions


def _if_published(job: Job, version: int, epoch: int) -> VersionInfo | None:
    latest = job.latest
    return latest if latest is not None and (latest.version, latest.epoch) == (version, epoch) else None


def _delete_pending_through(pending: Any, version: int) -> dict[str, Any]:
    """Delete every pending version up to ``version`` (keys sort by their zero-padded version)."""
    return {"request_delete_range": {"key": ops.b64(pending()), "range_end": ops.b64(pending(version + 1))}}
