"""The asyncio client of the meta server: :class:`AsyncMetaClient`, the twin of
:class:`~weightsync.meta.client.MetaClient` (same methods, awaitable; shared settings and
result checks in :mod:`weightsync.meta.client_base`)::

    async with AsyncMetaClient(address, job="grpo-7b", token=token) as client:
        info = await client.wait_version(after=applied, timeout=600)
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from weightsync.meta import calls
from weightsync.meta.calls import Call, ReaderReport
from weightsync.meta.client_base import (
    MAX_POLL_SECONDS,
    ClientBase,
    T,
    barrier_result,
    newer_than,
    readers_result,
    ssl_context,
)
from weightsync.meta.records import Participant, ParticipantTable, VersionInfo


class AsyncMetaClient(ClientBase):
    """The asyncio twin of :class:`MetaClient` (same methods, awaitable). Use ``async with`` or aclose()."""

    def __init__(self, address: str, *, job: str = "default", token: str | None = None,
                 timeout: float = 30.0) -> None:
        super().__init__(address, job=job, token=token, timeout=timeout)
        self._http = httpx.AsyncClient(base_url=self.address, headers=self._headers, verify=ssl_context(),
                                       trust_env=False, timeout=self.timeout,
                                       limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMetaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _execute(self, call: Call[T]) -> T:
        failing_since = 0.0
        for attempt in itertools.count():
            try:
                r = await self._http.request(call.method, call.url, content=call.body,
                                             headers=self._request_headers(call), timeout=self._attempt_timeout(call))
            except httpx.TransportError as exc:
                error: BaseException | str = exc
            else:
                if r.status_code not in calls.RETRY_STATUSES:
                    return calls.finish(call, r.status_code, r.content, self.address)
                error = f"HTTP {r.status_code}"
            failing_since = failing_since or time.monotonic()
            await asyncio.sleep(self._retry_delay(call, error, attempt, failing_since))  # backoff, not polling
        raise AssertionError("unreachable")

    async def _poll(self, make: Callable[[float], Call[T]], done: Callable[[T], bool], timeout: float) -> T:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            remaining = deadline - time.monotonic()
            result = await self._execute(make(max(0.0, min(remaining, MAX_POLL_SECONDS))))
            if done(result) or remaining <= 0 or time.monotonic() >= deadline:
                return result

    async def register(self, participant: Participant) -> bool:
        return await self._execute(calls.register(self.job, participant))

    async def table(self, *, documents: Sequence[str] = ()) -> ParticipantTable:
        return await self._execute(calls.roster(self.job, documents=documents))

    async def participants(self, role: str | None = None) -> list[Participant]:
        return (await self.table()).participants(role)

    async def wait_table(self, *, writers: int, readers: int, timeout: float,
                         documents: Sequence[str] = ()) -> ParticipantTable:
        table = await self._poll(lambda w: calls.roster(self.job, writers=writers, readers=readers, wait=w,
                                                        documents=documents),
                                 lambda t: t.count("writer") >= writers and t.count("reader") >= readers, timeout)
        return barrier_result(table, writers, readers, timeout)

    async def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        return (await self.wait_table(writers=writers, readers=readers, timeout=timeout)).participants()

    async def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
                   documents: Sequence[str] = ()) -> ParticipantTable:
        table = await self._poll(
            lambda w: calls.join(self.job, participant, writers=writers, readers=readers, wait=w,
                                 documents=documents),
            lambda t: t.count("writer") >= writers and t.count("reader") >= readers, timeout)
        return barrier_result(table, writers, readers, timeout)

    async def put_document(self, key: str, value: bytes) -> None:
        await self._execute(calls.put_document(self.job, key, value))

    async def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        return await self._poll(lambda w: calls.get_document(self.job, key, wait=w), lambda v: v is not None, wait)

    async def counter(self, name: str, *, at_least: int = 0, wait: float = 0.0) -> int:
        return await self._poll(lambda w: calls.counter(self.job, name, at_least=at_least, wait=w),
                                lambda v: v >= at_least, wait)

    async def compare_and_set(self, name: str, *, expected: int, value: int) -> tuple[bool, int]:
        return await self._execute(calls.compare_and_set(self.job, name, expected=expected, value=value))

    async def publish_version(self, version: int, fingerprint: str, *, writer_rank: int,
                              num_writers: int, attempt: int = 0) -> VersionInfo | None:
        return await self._execute(calls.publish_version(self.job, version, fingerprint, writer_rank=writer_rank,
                                                         num_writers=num_writers, attempt=attempt))

    async def latest_version(self) -> VersionInfo | None:
        return await self._execute(calls.latest_version(self.job))

    async def wait_version(self, after: int, timeout: float, *, after_attempt: int | None = None
                           ) -> VersionInfo | None:
        newer = newer_than(after, after_attempt)
        info = await self._poll(
            lambda w: calls.latest_version(self.job, after=after, wait=w, after_attempt=after_attempt), newer, timeout)
        return info if newer(info) else None

    async def report_applied(self, reader_rank: int, version: int, *, nbytes: int = 0,
                             seconds: float = 0.0) -> None:
        await self._execute(calls.report_applied(self.job, reader_rank, version, nbytes=nbytes, seconds=seconds))

    async def report_failed(self, reader_rank: int, version: int, error: str, *, attempt: int | None = None) -> None:
        await self._execute(calls.report_failed(self.job, reader_rank, version, error, attempt))

    async def reader_versions(self) -> dict[int, int | None]:
        return (await self._execute(calls.readers(self.job))).versions

    async def wait_readers(self, *, min_version: int, readers: int, timeout: float) -> dict[int, int | None]:
        return (await self.wait_reader_report(min_version=min_version, readers=readers, timeout=timeout)).versions

    async def wait_reader_report(self, *, min_version: int, readers: int, timeout: float) -> ReaderReport:
        report = await self._poll(
            lambda w: calls.readers(self.job, min_version=min_version, count=readers, wait=w),
            lambda r: len(r.settled(min_version, readers)) >= readers, timeout)
        readers_result(report, self.job, min_version, readers, timeout)
        return report

    async def pin_instance(self) -> str:
        self.instance = None
        self.instance = str((await self._execute(calls.server()))["instance"])
        return self.instance

    async def acquire_lease(self, role: str, rank: int, *, incarnation: str, ttl: float, pid: int = 0,
                            host: str = "", wait: float = 0.0, release: bool = False) -> bool:
        return await self._execute(calls.lease(self.job, role, rank, incarnation=incarnation, ttl=ttl, pid=pid,
                                               host=host, wait=wait, release=release))

    async def leases(self) -> list[dict[str, Any]]:
        return await self._execute(calls.leases(self.job))

    async def status(self) -> dict[str, Any]:
        jobs = (await self._execute(calls.status(self.job)))["jobs"]
        return jobs[0] if jobs else {"job": self.job, "writers": 0, "readers": 0, "latest_version": None}

    async def delete_job(self) -> bool:
        return await self._execute(calls.delete_job(self.job))
