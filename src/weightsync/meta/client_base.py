"""What :class:`~weightsync.meta.client.MetaClient` and
:class:`~weightsync.meta.async_client.AsyncMetaClient` share: settings, retry policy, and the
errors a barrier that timed out raises. The two clients differ only in how they wait (threads
or asyncio); everything that decides *what* to send and *what a result means* is here or in
:mod:`weightsync.meta.calls`, once.
"""

from __future__ import annotations

import functools
import logging
import random
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx

import weightsync
from weightsync.meta import calls, wire
from weightsync.meta.calls import Call, ReaderReport
from weightsync.meta.config import MetaEnv, check_token, normalize_address
from weightsync.meta.records import ParticipantTable, VersionInfo, check_job

logger = logging.getLogger("weightsync.meta.client")
T = TypeVar("T")

#: longest single long-poll a client asks for; longer waits are a loop of these
MAX_POLL_SECONDS = 25.0
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 1.0


@functools.lru_cache(maxsize=1)
def ssl_context() -> ssl.SSLContext:
    # httpx builds (and loads CA files into) a new context per client unless given one: ~20 ms each.
    return ssl.create_default_context()


def backoff(attempt: int) -> float:
    return min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** attempt) * random.uniform(0.5, 1.0)


def shorten(ranks: Sequence[int], limit: int = 20) -> str:
    text = ", ".join(map(str, ranks[:limit]))
    return f"[{text}{', ...' if len(ranks) > limit else ''}] ({len(ranks)})"


def barrier_result(table: ParticipantTable, writers: int, readers: int, timeout: float) -> ParticipantTable:
    have_w, have_r = table.count("writer"), table.count("reader")
    if have_w >= writers and have_r >= readers:
        return table
    missing = []
    if have_w < writers:
        missing.append(f"writer ranks {shorten(table.missing('writer', writers))}")
    if have_r < readers:
        missing.append(f"reader ranks {shorten(table.missing('reader', readers))}")
    raise TimeoutError(f"timed out after {timeout:.1f} s waiting for job {table.job!r}: {have_w}/{writers} writers "
                       f"and {have_r}/{readers} readers registered; missing {' and '.join(missing)}")


def readers_result(report: ReaderReport, job: str, min_version: int, readers: int,
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
        laggards.append(f"ranks {shorten(missing)} not registered")
    raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {readers} readers of job {job!r} to apply "
                       f"(or fail) version >= {min_version}: {len(done)} did; "
                       f"laggards: {'; '.join(laggards[:20]) or 'none'}"
                       + (f" (+{len(laggards) - 20} more)" if len(laggards) > 20 else ""))


def newer_than(after: int, after_attempt: int | None) -> Callable[[VersionInfo | None], bool]:
    key = (after, (1 << 62) if after_attempt is None else after_attempt)
    return lambda v: v is not None and (v.version, v.attempt) > key


class ClientBase:
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
        delay = backoff(attempt)
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

