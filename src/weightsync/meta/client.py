"""Typed clients of the meta server: :class:`MetaClient` (sync, thread-safe) and :class:`AsyncMetaClient`.

A writer's and a reader's loop, in a few lines::

    client, server = connect(job="grpo-7b")      # WEIGHTSYNC_META_ADDR, or an embedded server
    client.register(Participant("writer", rank, "train", host, {"nixl": addr}, layout_blob))
    everyone = client.wait_registered(writers=8, readers=2, timeout=300)
    client.publish_version(step, plan.fingerprint, writer_rank=rank, num_writers=8)   # writer
    info = client.wait_version(after=applied, timeout=600)                           # reader
    client.report_applied(rank, info.version, nbytes=n, seconds=t)                   # reader

Every call is idempotent, so transient failures (connection refused or reset, 502/503/504) are
retried with jittered exponential backoff until the server has been unreachable for ``timeout``
seconds: clients ride out a server restart. Waiting is long-polling (the server holds the request until the event or its
``max_wait``), never sleep-polling. Errors a user must fix raise ValueError (409 conflicts,
rejected requests) or PermissionError (wrong token); a server that stays unreachable raises
ConnectionError naming the address.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import random
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

import weightsync
from weightsync.meta import calls, wire
from weightsync.meta.calls import Call, ReaderReport
from weightsync.meta.config import MetaEnv, check_token, normalize_address
from weightsync.meta.records import Participant, ParticipantTable, VersionInfo, check_job

if TYPE_CHECKING:
    from weightsync.meta.embedded import EmbeddedMetaServer

__all__ = ["AsyncMetaClient", "EmbeddedMetaServer", "MetaClient", "Participant", "ParticipantTable",
           "VersionInfo", "connect"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: longest single long-poll a client asks for; longer waits are a loop of these
MAX_POLL_SECONDS = 25.0
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 1.0


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    # httpx builds (and loads CA files into) a new context per client unless given one: ~20 ms each.
    return ssl.create_default_context()


def _backoff(attempt: int) -> float:
    return min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** attempt) * random.uniform(0.5, 1.0)


def _shorten(ranks: Sequence[int], limit: int = 20) -> str:
    text = ", ".join(map(str, ranks[:limit]))
    return f"[{text}{', ...' if len(ranks) > limit else ''}] ({len(ranks)})"


def _barrier_result(table: ParticipantTable, writers: int, readers: int, timeout: float) -> ParticipantTable:
    have_w, have_r = table.count("writer"), table.count("reader")
    if have_w >= writers and have_r >= readers:
        return table
    missing = []
    if have_w < writers:
        missing.append(f"writer ranks {_shorten(table.missing('writer', writers))}")
    if have_r < readers:
        missing.append(f"reader ranks {_shorten(table.missing('reader', readers))}")
    raise TimeoutError(f"timed out after {timeout:.1f} s waiting for job {table.job!r}: {have_w}/{writers} writers "
                       f"and {have_r}/{readers} readers registered; missing {' and '.join(missing)}")


def _readers_result(report: ReaderReport, job: str, min_version: int, readers: int,
                    timeout: float) -> dict[int, int | None]:
    versions = report.versions
    done = report.settled(min_version, readers)
    if len(done) >= readers:
        return versions
    expected = [row for row in report.rows if int(row["rank"]) < readers and row.get("registered", True)]
    laggards = [f"rank {row['rank']} at {'no valid version' if row['version'] is None else row['version']}"
                + (f" ({row['error']})" if row.get("error") else "")
                for row in expected if int(row["rank"]) not in done]
    missing = sorted(set(range(readers)) - {int(row["rank"]) for row in expected})
    if missing:
        laggards.append(f"ranks {_shorten(missing)} not registered")
    raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {readers} readers of job {job!r} to apply "
                       f"(or fail) version >= {min_version}: {len(done)} did; "
                       f"laggards: {'; '.join(laggards[:20]) or 'none'}"
                       + (f" (+{len(laggards) - 20} more)" if len(laggards) > 20 else ""))


def _newer(after: int, after_attempt: int | None) -> Callable[[VersionInfo | None], bool]:
    key = (after, (1 << 62) if after_attempt is None else after_attempt)
    return lambda v: v is not None and (v.version, v.attempt) > key


class _Base:
    """Settings shared by both clients."""

    def __init__(self, address: str, *, job: str = "default", token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.address = normalize_address(address)
        self.job = check_job(job)
        if token is None:
            token = MetaEnv.from_env().token
            if token is None:
                raise ValueError("no meta server token: pass token=, or set WEIGHTSYNC_META_TOKEN or "
                                 "WEIGHTSYNC_META_TOKEN_FILE (the server's --token-file)")
        self._token = check_token(token, "token=")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self._headers = {"Authorization": f"Bearer {self._token}", "Accept": wire.MSGPACK,
                         "User-Agent": f"weightsync/{weightsync.__version__}"}
        #: the server instance this client pinned (None: any); see :meth:`MetaClient.pin_instance`
        self.instance: str | None = None

    def _request_headers(self, call: Call[Any]) -> dict[str, str] | None:
        headers = call.headers
        if self.instance is not None:
            headers = {**(headers or {}), calls.EXPECT_INSTANCE: self.instance}
        return headers

    @classmethod
    def from_env(cls: type[T], *, job: str = "default", address: str | None = None, token: str | None = None,
                 timeout: float = 30.0) -> T:
        """A client for ``address`` or ``WEIGHTSYNC_META_ADDR``, authenticated by ``token`` or
        ``WEIGHTSYNC_META_TOKEN`` / ``WEIGHTSYNC_META_TOKEN_FILE``."""
        env = MetaEnv.from_env()
        address = address or env.address
        if address is None:
            raise ValueError("no meta server address: pass address= or set WEIGHTSYNC_META_ADDR "
                             "(or use weightsync.meta.connect(), which starts an embedded server)")
        return cls(address, job=job, token=token or env.token, timeout=timeout)  # type: ignore[call-arg]

    def _attempt_timeout(self, call: Call[Any]) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0), read=call.wait + self.timeout)

    def _retry_delay(self, call: Call[Any], error: BaseException | str, attempt: int, failing_since: float) -> float:
        """Seconds to back off before the next attempt; ConnectionError once the server has been
        unreachable for longer than ``timeout``."""
        delay = _backoff(attempt)
        if time.monotonic() + delay - failing_since > self.timeout:
            raise ConnectionError(
                f"meta server {self.address} unreachable for {time.monotonic() - failing_since:.1f} s on "
                f"{call.method} {call.path} ({error}); is `weightsync meta-server` running there and "
                "WEIGHTSYNC_META_ADDR right?") from (error if isinstance(error, BaseException) else None)
        (logger.warning if attempt == 0 else logger.debug)(
            "meta server %s: %s on %s %s; retrying", self.address, error, call.method, call.path)
        return delay

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, job={self.job!r})"


class MetaClient(_Base):
    """Synchronous, thread-safe client of one job namespace. Use as a context manager or close()."""

    def __init__(self, address: str, *, job: str = "default", token: str | None = None,
                 timeout: float = 30.0) -> None:
        super().__init__(address, job=job, token=token, timeout=timeout)
        self._http = httpx.Client(base_url=self.address, headers=self._headers, verify=_ssl_context(),
                                  trust_env=False, timeout=self.timeout,
                                  limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MetaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _execute(self, call: Call[T]) -> T:
        failing_since = 0.0
        for attempt in itertools.count():
            try:
                r = self._http.request(call.method, call.url, content=call.body, headers=self._request_headers(call),
                                       timeout=self._attempt_timeout(call))
            except httpx.TransportError as exc:
                error: BaseException | str = exc
            else:
                if r.status_code not in calls.RETRY_STATUSES:
                    return calls.finish(call, r.status_code, r.content, self.address)
                error = f"HTTP {r.status_code}"
            failing_since = failing_since or time.monotonic()
            time.sleep(self._retry_delay(call, error, attempt, failing_since))  # backoff, not polling
        raise AssertionError("unreachable")

    def _poll(self, make: Callable[[float], Call[T]], done: Callable[[T], bool], timeout: float) -> T:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            remaining = deadline - time.monotonic()
            result = self._execute(make(max(0.0, min(remaining, MAX_POLL_SECONDS))))
            if done(result) or remaining <= 0 or time.monotonic() >= deadline:
                return result

    # --- participants ----------------------------------------------------------------------
    def register(self, participant: Participant) -> bool:
        """Register a rank (idempotent). Returns True if it was new.

        Raises:
            ValueError: the rank is already registered with different data (names the fields).
        """
        return self._execute(calls.register(self.job, participant))

    def table(self, *, documents: Sequence[str] = ()) -> ParticipantTable:
        """The roster in one bulk call, decoded lazily (the fast path for thousands of ranks),
        with the job documents named in ``documents`` (``table.documents``)."""
        return self._execute(calls.roster(self.job, documents=documents))

    def participants(self, role: str | None = None) -> list[Participant]:
        """All registered participants (or those of ``role``), sorted by ``(role, rank)``."""
        return self.table().participants(role)

    def wait_table(self, *, writers: int, readers: int, timeout: float,
                   documents: Sequence[str] = ()) -> ParticipantTable:
        """Barrier: wait until ``writers`` writers and ``readers`` readers registered; returns
        the roster (and the job documents named in ``documents``).

        Raises:
            TimeoutError: naming the ranks still missing.
        """
        table = self._poll(lambda w: calls.roster(self.job, writers=writers, readers=readers, wait=w,
                                                  documents=documents),
                           lambda t: t.count("writer") >= writers and t.count("reader") >= readers, timeout)
        return _barrier_result(table, writers, readers, timeout)

    def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        """:meth:`wait_table`, as a list of participants sorted by ``(role, rank)``."""
        return self.wait_table(writers=writers, readers=readers, timeout=timeout).participants()

    def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
             documents: Sequence[str] = ()) -> ParticipantTable:
        """:meth:`register` and :meth:`wait_table` in one round trip per long-poll.

        Raises:
            ValueError: the rank is already registered with different data.
            TimeoutError: naming the ranks still missing.
        """
        table = self._poll(lambda w: calls.join(self.job, participant, writers=writers, readers=readers, wait=w,
                                                documents=documents),
                           lambda t: t.count("writer") >= writers and t.count("reader") >= readers, timeout)
        return _barrier_result(table, writers, readers, timeout)

    # --- documents -------------------------------------------------------------------------
    def put_document(self, key: str, value: bytes) -> None:
        """Store a job-level document (e.g. the model config) under ``key``; overwrites."""
        self._execute(calls.put_document(self.job, key, value))

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        """The document ``key``; with ``wait > 0``, long-poll until it exists. None if absent."""
        return self._poll(lambda w: calls.get_document(self.job, key, wait=w), lambda v: v is not None, wait)

    # --- counters --------------------------------------------------------------------------
    def counter(self, name: str, *, at_least: int = 0, wait: float = 0.0) -> int:
        """The job's counter ``name`` (0 until set); with ``wait``, long-poll until it reaches ``at_least``."""
        return self._poll(lambda w: calls.counter(self.job, name, at_least=at_least, wait=w),
                          lambda v: v >= at_least, wait)

    def compare_and_set(self, name: str, *, expected: int, value: int) -> tuple[bool, int]:
        """Set counter ``name`` to ``value`` if it holds ``expected``, atomically on the server.
        Returns (whether it was set, the value it holds now)."""
        return self._execute(calls.compare_and_set(self.job, name, expected=expected, value=value))

    # --- versions --------------------------------------------------------------------------
    def publish_version(self, version: int, fingerprint: str, *, writer_rank: int,
                        num_writers: int, attempt: int = 0) -> VersionInfo | None:
        """One writer's "version ``version`` is ready". Returns the VersionInfo once all
        ``num_writers`` writers reported it with the same fingerprint, else None.

        Raises:
            ValueError: another writer reported a different fingerprint (both named), or the
                version is not newer than the published one.
        """
        return self._execute(calls.publish_version(self.job, version, fingerprint, writer_rank=writer_rank,
                                                   num_writers=num_writers, attempt=attempt))

    def latest_version(self) -> VersionInfo | None:
        return self._execute(calls.latest_version(self.job))

    def wait_version(self, after: int, timeout: float, *, after_attempt: int | None = None) -> VersionInfo | None:
        """Long-poll for a published version newer than ``after`` (with ``after_attempt``: or a
        later attempt of version ``after``); None on timeout."""
        newer = _newer(after, after_attempt)
        info = self._poll(lambda w: calls.latest_version(self.job, after=after, wait=w, after_attempt=after_attempt),
                          newer, timeout)
        return info if newer(info) else None

    # --- readers ---------------------------------------------------------------------------
    def report_applied(self, reader_rank: int, version: int, *, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Reader ``reader_rank`` now serves ``version`` (``nbytes`` received in ``seconds``)."""
        self._execute(calls.report_applied(self.job, reader_rank, version, nbytes=nbytes, seconds=seconds))

    def report_failed(self, reader_rank: int, version: int, error: str, *, attempt: int | None = None) -> None:
        """Reader ``reader_rank`` failed to apply ``version`` (its ``attempt``): its weights are not
        at a valid version. A failure of an attempt that a newer one superseded is ignored."""
        self._execute(calls.report_failed(self.job, reader_rank, version, error, attempt))

    def reader_versions(self) -> dict[int, int | None]:
        """Reader rank -> last applied version (None: never applied, or failed since)."""
        return self._execute(calls.readers(self.job)).versions

    def wait_readers(self, *, min_version: int, readers: int, timeout: float) -> dict[int, int | None]:
        """Long-poll until reader ranks ``0..readers-1`` (registered) are done with ``min_version``:
        applied it or newer, or reported failing it or newer (such a reader waits for a newer
        version, never this one). Returns reader rank -> applied version.

        Raises:
            TimeoutError: naming the laggards and their versions.
        """
        return self.wait_reader_report(min_version=min_version, readers=readers, timeout=timeout).versions

    def wait_reader_report(self, *, min_version: int, readers: int, timeout: float) -> ReaderReport:
        """:meth:`wait_readers`, answering the whole report (``report.failed(v)``: who failed and why)."""
        report = self._poll(lambda w: calls.readers(self.job, min_version=min_version, count=readers, wait=w),
                            lambda r: len(r.settled(min_version, readers)) >= readers, timeout)
        _readers_result(report, self.job, min_version, readers, timeout)
        return report

    # --- identity and liveness ---------------------------------------------------------------
    def pin_instance(self) -> str:
        """Pin the server's current instance: from now on every call fails at once with
        :class:`~weightsync.meta.calls.ServerStateLostError` if the server restarted without its
        state (its registrations gone). Returns the instance."""
        self.instance = None
        self.instance = str(self._execute(calls.server())["instance"])
        return self.instance

    def acquire_lease(self, role: str, rank: int, *, incarnation: str, ttl: float, pid: int = 0, host: str = "",
                      wait: float = 0.0, release: bool = False) -> bool:
        """Take, renew or release the lease of ``(role, rank)`` (see :mod:`weightsync.meta.leases`).
        Returns True if this incarnation took it over from a dead one.

        Raises:
            ValueError: another live process holds it (after ``wait`` seconds), naming it.
        """
        return self._execute(calls.lease(self.job, role, rank, incarnation=incarnation, ttl=ttl, pid=pid, host=host,
                                         wait=wait, release=release))

    def leases(self) -> list[dict[str, Any]]:
        """Every lease of this job: role, rank, holder (pid, host), alive, seconds since its heartbeat."""
        return self._execute(calls.leases(self.job))

    # --- jobs ------------------------------------------------------------------------------
    def server_status(self) -> dict[str, Any]:
        """The server's own status: ``instance``, ``started_at``, ``uptime_seconds``, ``durable``,
        and ``waiting`` (long-polls it holds now, which tests and operators can watch)."""
        return dict(self._execute(calls.status(self.job))["server"])

    def status(self) -> dict[str, Any]:
        """This job's status (participants, versions, each reader's lag and last sync), as JSON data."""
        jobs = self._execute(calls.status(self.job))["jobs"]
        return jobs[0] if jobs else {"job": self.job, "writers": 0, "readers": 0, "latest_version": None}

    def delete_job(self) -> bool:
        """Forget this job on the server (participants, documents, versions). True if it existed."""
        return self._execute(calls.delete_job(self.job))


class AsyncMetaClient(_Base):
    """The asyncio twin of :class:`MetaClient` (same methods, awaitable). Use ``async with`` or aclose()."""

    def __init__(self, address: str, *, job: str = "default", token: str | None = None,
                 timeout: float = 30.0) -> None:
        super().__init__(address, job=job, token=token, timeout=timeout)
        self._http = httpx.AsyncClient(base_url=self.address, headers=self._headers, verify=_ssl_context(),
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
        return _barrier_result(table, writers, readers, timeout)

    async def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        return (await self.wait_table(writers=writers, readers=readers, timeout=timeout)).participants()

    async def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
                   documents: Sequence[str] = ()) -> ParticipantTable:
        table = await self._poll(
            lambda w: calls.join(self.job, participant, writers=writers, readers=readers, wait=w,
                                 documents=documents),
            lambda t: t.count("writer") >= writers and t.count("reader") >= readers, timeout)
        return _barrier_result(table, writers, readers, timeout)

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
        newer = _newer(after, after_attempt)
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
        _readers_result(report, self.job, min_version, readers, timeout)
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


def connect(address: str | None = None, *, job: str = "default", token: str | None = None,
            timeout: float = 30.0) -> tuple[MetaClient, EmbeddedMetaServer | None]:
    """A client for ``address`` / ``WEIGHTSYNC_META_ADDR``, or else for a new embedded server.

    Single-machine runs need not start anything: without an address an
    :class:`~weightsync.meta.embedded.EmbeddedMetaServer` is started on 127.0.0.1 (a daemon
    thread of this process). The caller closes the client and stops the server (if not None).
    """
    env = MetaEnv.from_env()
    address = address or env.address
    if address is not None:
        return MetaClient(address, job=job, token=token or env.token, timeout=timeout), None
    from weightsync.meta.embedded import EmbeddedMetaServer

    server = EmbeddedMetaServer(token=token).start()
    try:
        return MetaClient(server.address, job=job, token=server.token, timeout=timeout), server
    except BaseException:
        server.stop()
        raise


def __getattr__(name: str) -> Any:
    if name == "EmbeddedMetaServer":  # imported lazily: clients need not import the server stack
        from weightsync.meta.embedded import EmbeddedMetaServer

        return EmbeddedMetaServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
