"""The asyncio client of the meta server: :class:`AsyncMetaClient`, the twin of
:class:`~weightsync.meta.client.MetaClient` (same methods, awaitable; shared settings and
result checks in :mod:`weightsync.meta.client_base`)::

    async with AsyncMetaClient(address, job="grpo-7b", token=token) as client:
        info = await client.wait_version(after=applied, timeout=600)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

from weightsync.meta import calls
from weightsync.meta.calls import Call
from weightsync.meta.client_base import Answer, ClientBase, Outcome, Sleep, Steps, T, ssl_context
from weightsync.meta.fleet.answers import FleetAnswer, FleetTicked, FleetView
from weightsync.meta.fleet.commands import Command, Join
from weightsync.meta.records import ParticipantTable
from weightsync.ports.records import LeaseRow, Participant, ReaderReport, VersionInfo


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

    async def _send(self, call: Call[Any]) -> Outcome:
        try:
            r = await self._http.request(call.method, call.url, content=call.body,
                                         headers=self._request_headers(call), timeout=self._request_timeout(call))
        except httpx.TransportError as exc:
            return exc
        return Answer(r.status_code, r.content)

    async def _run(self, steps: Steps[T]) -> T:
        """Drive an operation's steps (see :mod:`weightsync.meta.client_base`) with awaits."""
        outcome: Outcome | None = None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)  # backoff, not polling
                outcome = None
            else:
                outcome = await self._send(step)

    async def register(self, participant: Participant) -> bool:
        return await self._run(self._one(calls.register(self.job, participant)))

    async def table(self, *, documents: Sequence[str] = ()) -> ParticipantTable:
        return await self._run(self._one(calls.roster(self.job, documents=documents)))

    async def participants(self, role: str | None = None) -> list[Participant]:
        return (await self.table()).participants(role)

    async def wait_table(self, *, writers: int, readers: int, timeout: float,
                         documents: Sequence[str] = ()) -> ParticipantTable:
        return await self._run(self._wait_table(writers, readers, timeout, documents))

    async def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        return (await self.wait_table(writers=writers, readers=readers, timeout=timeout)).participants()

    async def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
                   documents: Sequence[str] = ()) -> ParticipantTable:
        return await self._run(self._wait_table(writers, readers, timeout, documents, join=participant))

    async def put_document(self, key: str, value: bytes) -> None:
        await self._run(self._one(calls.put_document(self.job, key, value)))

    async def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        return await self._run(self._get_document(key, wait))

    async def counter(self, name: str, *, at_least: int = 0, wait: float = 0.0) -> int:
        return await self._run(self._counter(name, at_least, wait))

    async def compare_and_set(self, name: str, *, expected: int, value: int) -> tuple[bool, int]:
        return await self._run(self._one(calls.compare_and_set(self.job, name, expected=expected, value=value)))

    async def publish_version(self, version: int, fingerprint: str, *, writer_rank: int,
                              num_writers: int, epoch: int = 0) -> VersionInfo | None:
        return await self._run(self._one(calls.publish_version(
            self.job, version, fingerprint, writer_rank=writer_rank, num_writers=num_writers, epoch=epoch)))

    async def latest_version(self) -> VersionInfo | None:
        return await self._run(self._one(calls.latest_version(self.job)))

    async def wait_version(self, after: int, timeout: float, *, after_epoch: int | None = None
                           ) -> VersionInfo | None:
        return await self._run(self._wait_version(after, timeout, after_epoch))

    async def report_applied(self, reader_rank: int, version: int, *, nbytes: int = 0,
                             seconds: float = 0.0) -> None:
        await self._run(self._one(calls.report_applied(self.job, reader_rank, version, nbytes=nbytes,
                                                       seconds=seconds)))

    async def report_failed(self, reader_rank: int, version: int, error: str, *, epoch: int | None = None,
                            invalid: bool = True, holds: int | None = None) -> None:
        await self._run(self._one(calls.report_failed(self.job, reader_rank, version, error, epoch, invalid=invalid,
                                                      holds=holds)))

    async def reader_versions(self) -> dict[int, int | None]:
        return (await self._run(self._one(calls.readers(self.job)))).versions

    async def wait_readers(self, *, min_version: int, readers: int, timeout: float) -> dict[int, int | None]:
        return (await self.wait_reader_report(min_version=min_version, readers=readers, timeout=timeout)).versions

    async def wait_reader_report(self, *, min_version: int, readers: int, timeout: float,
                                 settled: int | None = None, applied: int = 0) -> ReaderReport:
        return await self._run(self._wait_reader_report(min_version, readers, timeout, settled, applied))

    async def pin_instance(self) -> str:
        return await self._run(self._pin_instance())

    async def acquire_lease(self, role: str, rank: int, *, incarnation: str, ttl: float, pid: int = 0,
                            host: str = "", wait: float = 0.0, release: bool = False) -> bool:
        return await self._run(self._one(calls.lease(self.job, role, rank, incarnation=incarnation, ttl=ttl, pid=pid,
                                                     host=host, wait=wait, release=release)))

    async def leases(self) -> list[LeaseRow]:
        return await self._run(self._leases())

    async def fleet_join(self, join: Join, *, ttl: float | None = None) -> FleetAnswer:
        return await self._run(self._one(calls.fleet_command(self.job, join, ttl=ttl)))

    async def fleet_command(self, command: Command) -> FleetAnswer:
        return await self._run(self._one(calls.fleet_command(self.job, command)))

    async def fleet_beat(self, role: str, id_: int, incarnation: str) -> bool:
        return await self._run(self._one(calls.fleet_beat(self.job, role, id_, incarnation)))

    async def fleet_tick(self) -> FleetTicked:
        return await self._run(self._one(calls.fleet_tick(self.job)))

    async def fleet_record(self, *, after: int = -1, wait: float = 0.0) -> FleetView:
        return await self._run(self._one(calls.fleet_record(self.job, after=after, wait=wait)))

    async def status(self) -> dict[str, Any]:
        return await self._run(self._job_status())

    async def delete_job(self) -> bool:
        return await self._run(self._one(calls.delete_job(self.job)))
