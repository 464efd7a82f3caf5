"""What :class:`~weightsync.meta.client.MetaClient` and
:class:`~weightsync.meta.async_client.AsyncMetaClient` share: settings, the retry and poll loops,
and what every call means. The two clients differ only in how they wait (threads or asyncio).

Each operation is written once, as a generator of *steps* (sans I/O): it yields a
:class:`~weightsync.meta.calls.Call` to send and receives the :class:`Answer` (or the transport
error), or yields a :class:`Sleep` for a backoff, and finally returns its result. A client only
drives the steps: the sync one with blocking sends and ``time.sleep``, the async one with
awaits. So there is one retry loop (:func:`exchange`) and one ``Deadline``-based long-poll loop
(:func:`poll`), whichever client runs them::

    def _counter(self, name, at_least, wait) -> Steps[int]:
        return poll(self, lambda w: calls.counter(self.job, name, at_least=at_least, wait=w),
                    lambda v: v >= at_least, wait)
    value = client._run(client._counter("epoch", 3, 10.0))     # MetaClient
    value = await client._run(client._counter("epoch", 3, 10.0))   # AsyncMetaClient
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import ssl
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import httpx

import weightsync
from weightsync.clock.deadline import Deadline
from weightsync.meta import calls, wire
from weightsync.meta.calls import Call
from weightsync.meta.config import MetaEnv, check_token, normalize_address
from weightsync.meta.etcd.address import is_etcd_address
from weightsync.meta.records import ParticipantTable, check_job
from weightsync.ports.records import LeaseRow, Participant, ReaderReport, VersionInfo

logger = logging.getLogger("weightsync.meta.client")
T = TypeVar("T")

#: longest single long-poll a client asks for; longer waits are a loop of these
MAX_POLL_SECONDS = 25.0
#: a wait for peers says who is missing at INFO at most this often (and its long-polls are this short)
PROGRESS_SECONDS = 5.0
#: libraries that log every request at INFO; their loggers go to WARNING unless the application set a level
REQUEST_LOGGERS = ("httpx",)
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 1.0


@functools.lru_cache(maxsize=1)
def ssl_context() -> ssl.SSLContext:
    # httpx builds (and loads CA files into) a new context per client unless given one: ~20 ms each.
    return ssl.create_default_context()


def backoff(tries: int) -> float:
    return min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** tries) * random.uniform(0.5, 1.0)


def shorten(ranks: Sequence[int], limit: int = 20) -> str:
    text = ", ".join(map(str, ranks[:limit]))
    return f"[{text}{', ...' if len(ranks) > limit else ''}] ({len(ranks)})"


def quiet_request_logs() -> None:
    """Per-request INFO lines of the HTTP libraries off (httpx logs every long-poll: dozens of
    lines a minute while a rank waits), by their own loggers' levels: the root logger and any
    level the application set stay as they are."""
    for name in REQUEST_LOGGERS:
        library = logging.getLogger(name)
        if library.level == logging.NOTSET:
            library.setLevel(logging.WARNING)


def missing_ranks(table: ParticipantTable, writers: int, readers: int) -> str:
    """``"writer ranks [...] and reader ranks [...]"``: who has not registered yet ("" if nobody)."""
    missing = []
    if table.count("writer") < writers:
        missing.append(f"writer ranks {shorten(table.missing('writer', writers))}")
    if table.count("reader") < readers:
        missing.append(f"reader ranks {shorten(table.missing('reader', readers))}")
    return " and ".join(missing)


def barrier_result(table: ParticipantTable, writers: int, readers: int, timeout: float) -> ParticipantTable:
    have_w, have_r = table.count("writer"), table.count("reader")
    if have_w >= writers and have_r >= readers:
        return table
    raise TimeoutError(f"timed out after {timeout:.1f} s waiting for job {table.job!r}: {have_w}/{writers} writers "
                       f"and {have_r}/{readers} readers registered; missing {missing_ranks(table, writers, readers)}")


def log_missing(table: ParticipantTable, writers: int, readers: int, left: float) -> None:
    """The INFO line a wait for peers logs every :data:`PROGRESS_SECONDS`."""
    logger.info("job %r: waiting for %s to register (%d/%d writers, %d/%d readers so far); %.0f s left",
                table.job, missing_ranks(table, writers, readers), table.count("writer"), writers,
                table.count("reader"), readers, left)


def readers_result(report: ReaderReport, job: str, min_version: int, readers: int,
                   timeout: float, *, settled: int | None = None, applied: int = 0) -> dict[int, int | None]:
    versions = report.versions
    done = report.settled(min_version, readers)
    if report.enough(min_version, readers, settled=settled, applied=applied):
        return versions
    expected = [row for row in report.rows if int(row["rank"]) < readers and row.get("registered", True)]
    laggards = [f"rank {row['rank']} at {'no valid version' if row['version'] is None else row['version']}"
                + (f" ({row['error']})" if row.get("error") else "")
                for row in expected if int(row["rank"]) not in done]
    missing = sorted(set(range(readers)) - {int(row["rank"]) for row in expected})
    if missing:
        laggards.append(f"ranks {shorten(missing)} not registered")
    raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {readers} readers of job {job!r} to apply "
                       f"(or fail) version >= {min_version}: {len(done)} did; "
                       f"laggards: {'; '.join(laggards[:20]) or 'none'}"
                       + (f" (+{len(laggards) - 20} more)" if len(laggards) > 20 else ""))


def newer_than(after: int, after_epoch: int | None) -> Callable[[VersionInfo | None], bool]:
    key = (after, (1 << 62) if after_epoch is None else after_epoch)
    return lambda v: v is not None and (v.version, v.epoch) > key


# -- steps: what an operation asks its client to do ------------------------------------------------

@dataclass(frozen=True, slots=True)
class Sleep:
    """Back off this long before the next try."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Answer:
    """The server's answer to a sent call."""

    status: int
    content: bytes


#: what a sent call comes back as: an answer, or the error that kept it from being answered
Outcome: TypeAlias = Answer | httpx.TransportError
Steps: TypeAlias = Generator[Call[Any] | Sleep, Outcome | None, T]


def exchange(client: ClientBase, call: Call[T]) -> Steps[T]:
    """Send ``call`` until the server answers it for good (retrying 502/503/504 and transport
    errors with jittered backoff); returns the parsed answer or raises what it means."""
    unreachable: Deadline | None = None
    for tries in itertools.count():
        outcome = yield call
        if isinstance(outcome, Answer):
            if outcome.status not in calls.RETRY_STATUSES:
                return calls.finish(call, outcome.status, outcome.content, client.address)
            reason = calls.detail(outcome.content).strip()
            error: BaseException | str = f"HTTP {outcome.status}: {reason}" if reason else f"HTTP {outcome.status}"
        else:
            assert outcome is not None, "a client answers every call it is given"
            error = outcome
        unreachable = unreachable or Deadline.after(client.timeout)
        yield Sleep(client._retry_delay(call, error, tries, unreachable))
    raise AssertionError("unreachable")


def poll(client: ClientBase, make: Callable[[float], Call[T]], done: Callable[[T], bool], timeout: float,
         progress: Callable[[T, float], None] | None = None) -> Steps[T]:
    """Long-poll: ask with ``make(wait)`` until ``done(result)`` or ``timeout`` seconds passed;
    returns the last result. Each request waits on the server at most :data:`MAX_POLL_SECONDS`;
    with ``progress``, at most :data:`PROGRESS_SECONDS`, and ``progress(result, seconds_left)``
    is called at most that often while not done."""
    deadline = Deadline.after(max(0.0, timeout))
    longest = MAX_POLL_SECONDS if progress is None else PROGRESS_SECONDS
    said = time.monotonic()
    while True:
        result = yield from exchange(client, make(min(deadline.remaining(0.0), longest)))
        if done(result) or deadline.expired:
            return result
        if progress is not None and time.monotonic() - said >= PROGRESS_SECONDS:
            said = time.monotonic()
            progress(result, deadline.remaining(0.0))


class ClientBase:
    """Settings shared by both clients."""

    def __init__(self, address: str, *, job: str = "default", token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.address = normalize_address(address)
        if is_etcd_address(self.address):
            raise ValueError(f"{self.address!r} is an etcd cluster, which {type(self).__name__} does not speak: use "
                             "weightsync.meta.open_meta(address, job=...) (or EtcdMetaClient) for etcd:// addresses")
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
        quiet_request_logs()

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

    def _request_timeout(self, call: Call[Any]) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0), read=call.wait + self.timeout)

    def _retry_delay(self, call: Call[Any], error: BaseException | str, tries: int, unreachable: Deadline) -> float:
        """Seconds to back off before the next try; ConnectionError once the call has failed for
        longer than ``timeout`` (``unreachable``: since the first failure). ``error`` is the
        transport's exception, or the server's answer (``"HTTP 503: <its reason>"``), which the
        ConnectionError then quotes: a server that refuses (e.g. its disk is full) is not unreachable."""
        delay = backoff(tries)
        if unreachable.remaining(0.0) < delay:
            failing = self.timeout - (unreachable.at - time.monotonic())
            if isinstance(error, str):
                raise ConnectionError(
                    f"meta server {self.address} kept refusing {call.method} {call.path} for {failing:.1f} s "
                    f"(retried until the client's timeout of {self.timeout:g} s); its last answer: {error}")
            raise ConnectionError(
                f"meta server {self.address} unreachable for {failing:.1f} s on "
                f"{call.method} {call.path} ({error}); is `weightsync meta-server` running there and "
                "WEIGHTSYNC_META_ADDR right?") from error
        (logger.warning if tries == 0 else logger.debug)(
            "meta server %s: %s on %s %s; retrying", self.address, error, call.method, call.path)
        return delay

    # -- every operation, once (see module docstring) ------------------------------------------
    def _one(self, call: Call[T]) -> Steps[T]:
        return exchange(self, call)

    def _wait_table(self, writers: int, readers: int, timeout: float, documents: Sequence[str],
                    join: Participant | None = None) -> Steps[ParticipantTable]:
        def make(w: float) -> Call[ParticipantTable]:
            if join is not None:
                return calls.join(self.job, join, writers=writers, readers=readers, wait=w, documents=documents)
            return calls.roster(self.job, writers=writers, readers=readers, wait=w, documents=documents)
        table = yield from poll(self, make, lambda t: t.count("writer") >= writers and t.count("reader") >= readers,
                                timeout, progress=lambda t, left: log_missing(t, writers, readers, left))
        return barrier_result(table, writers, readers, timeout)

    def _get_document(self, key: str, wait: float) -> Steps[bytes | None]:
        return poll(self, lambda w: calls.get_document(self.job, key, wait=w), lambda v: v is not None, wait)

    def _counter(self, name: str, at_least: int, wait: float) -> Steps[int]:
        return poll(self, lambda w: calls.counter(self.job, name, at_least=at_least, wait=w),
                    lambda v: v >= at_least, wait)

    def _wait_version(self, after: int, timeout: float, after_epoch: int | None) -> Steps[VersionInfo | None]:
        newer = newer_than(after, after_epoch)
        info = yield from poll(self, lambda w: calls.latest_version(self.job, after=after, wait=w,
                                                                    after_epoch=after_epoch), newer, timeout)
        return info if newer(info) else None

    def _wait_reader_report(self, min_version: int, readers: int, timeout: float, settled: int | None = None,
                            applied: int = 0) -> Steps[ReaderReport]:
        report = yield from poll(self, lambda w: calls.readers(self.job, min_version=min_version, count=readers,
                                                               wait=w, settled=settled, applied=applied),
                                 lambda r: r.enough(min_version, readers, settled=settled, applied=applied), timeout)
        readers_result(report, self.job, min_version, readers, timeout, settled=settled, applied=applied)
        return report

    def _pin_instance(self) -> Steps[str]:
        self.instance = None
        self.instance = str((yield from exchange(self, calls.server()))["instance"])
        return self.instance

    def _job_status(self) -> Steps[dict[str, Any]]:
        jobs = (yield from exchange(self, calls.status(self.job)))["jobs"]
        return jobs[0] if jobs else {"job": self.job, "writers": 0, "readers": 0, "latest_version": None}

    def _leases(self) -> Steps[list[LeaseRow]]:
        return exchange(self, calls.leases(self.job))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, job={self.job!r})"

