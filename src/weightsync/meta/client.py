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

:class:`AsyncMetaClient` lives in :mod:`weightsync.meta.async_client` (re-exported here); what
both clients share (settings, retries, barrier errors) in :mod:`weightsync.meta.client_base`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import httpx

from weightsync.meta import calls
from weightsync.meta.async_client import AsyncMetaClient
from weightsync.meta.calls import Call
from weightsync.meta.client_base import Answer, ClientBase, Outcome, Sleep, Steps, T, ssl_context
from weightsync.meta.config import MetaEnv, same_coordinator
from weightsync.meta.etcd.address import is_etcd_address
from weightsync.meta.fleet.answers import FleetAnswer, FleetTicked, FleetView
from weightsync.meta.fleet.commands import Command, Join
from weightsync.meta.records import ParticipantTable
from weightsync.ports.records import LeaseRow, Participant, ReaderReport, VersionInfo

if TYPE_CHECKING:
    from weightsync.meta.embedded import EmbeddedMetaServer
    from weightsync.meta.etcd.client import EtcdMetaClient

__all__ = ["AnyMetaClient", "AsyncMetaClient", "EmbeddedMetaServer", "MetaClient", "Participant", "ParticipantTable",
           "VersionInfo", "connect", "open_meta"]

#: a coordinator client: the embedded meta server's, or etcd's (both provide the job channel's MetaPort)
AnyMetaClient: TypeAlias = "MetaClient | EtcdMetaClient"


class MetaClient(ClientBase):
    """Synchronous, thread-safe client of one job namespace. Use as a context manager or close()."""

    def __init__(self, address: str, *, job: str = "default", token: str | None = None,
                 timeout: float = 30.0) -> None:
        super().__init__(address, job=job, token=token, timeout=timeout)
        self._http = httpx.Client(base_url=self.address, headers=self._headers, verify=ssl_context(),
                                  trust_env=False, timeout=self.timeout,
                                  limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MetaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: Call[Any]) -> Outcome:
        try:
            r = self._http.request(call.method, call.url, content=call.body, headers=self._request_headers(call),
                                   timeout=self._request_timeout(call))
        except httpx.TransportError as exc:
            return exc
        return Answer(r.status_code, r.content)

    def _run(self, steps: Steps[T]) -> T:
        """Drive an operation's steps (see :mod:`weightsync.meta.client_base`) with blocking calls."""
        outcome: Outcome | None = None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(step, Sleep):
                time.sleep(step.seconds)  # backoff, not polling
                outcome = None
            else:
                outcome = self._send(step)

    # --- participants ----------------------------------------------------------------------
    def register(self, participant: Participant) -> bool:
        """Register a rank (idempotent). Returns True if it was new.

        Raises:
            ValueError: the rank is already registered with different data (names the fields).
        """
        return self._run(self._one(calls.register(self.job, participant)))

    def table(self, *, documents: Sequence[str] = ()) -> ParticipantTable:
        """The roster in one bulk call, decoded lazily (the fast path for thousands of ranks),
        with the job documents named in ``documents`` (``table.documents``)."""
        return self._run(self._one(calls.roster(self.job, documents=documents)))

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
        return self._run(self._wait_table(writers, readers, timeout, documents))

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
        return self._run(self._wait_table(writers, readers, timeout, documents, join=participant))

    # --- documents -------------------------------------------------------------------------
    def put_document(self, key: str, value: bytes) -> None:
        """Store a job-level document (e.g. the model config) under ``key``; overwrites."""
        self._run(self._one(calls.put_document(self.job, key, value)))

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        """The document ``key``; with ``wait > 0``, long-poll until it exists. None if absent."""
        return self._run(self._get_document(key, wait))

    # --- counters --------------------------------------------------------------------------
    def counter(self, name: str, *, at_least: int = 0, wait: float = 0.0) -> int:
        """The job's counter ``name`` (0 until set); with ``wait``, long-poll until it reaches ``at_least``."""
        return self._run(self._counter(name, at_least, wait))

    def compare_and_set(self, name: str, *, expected: int, value: int) -> tuple[bool, int]:
        """Set counter ``name`` to ``value`` if it holds ``expected``, atomically on the server.
        Returns (whether it was set, the value it holds now)."""
        return self._run(self._one(calls.compare_and_set(self.job, name, expected=expected, value=value)))

    # --- versions --------------------------------------------------------------------------
    def publish_version(self, version: int, fingerprint: str, *, writer_rank: int,
                        num_writers: int, epoch: int = 0) -> VersionInfo | None:
        """One writer's "version ``version`` is ready" (written in the job's transport ``epoch``).
        Returns the VersionInfo once all ``num_writers`` writers reported it with the same
        fingerprint and epoch, else None.

        Raises:
            ValueError: another writer reported a different fingerprint (both named), or the
                version is not newer than the published one.
        """
        return self._run(self._one(calls.publish_version(self.job, version, fingerprint, writer_rank=writer_rank,
                                                         num_writers=num_writers, epoch=epoch)))

    def latest_version(self) -> VersionInfo | None:
        return self._run(self._one(calls.latest_version(self.job)))

    def wait_version(self, after: int, timeout: float, *, after_epoch: int | None = None) -> VersionInfo | None:
        """Long-poll for a published version newer than ``after`` (with ``after_epoch``: or
        version ``after`` published again in a later epoch); None on timeout."""
        return self._run(self._wait_version(after, timeout, after_epoch))

    # --- readers ---------------------------------------------------------------------------
    def report_applied(self, reader_rank: int, version: int, *, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Reader ``reader_rank`` now serves ``version`` (``nbytes`` received in ``seconds``)."""
        self._run(self._one(calls.report_applied(self.job, reader_rank, version, nbytes=nbytes, seconds=seconds)))

    def report_failed(self, reader_rank: int, version: int, error: str, *, epoch: int | None = None,
                      invalid: bool = True, holds: int | None = None) -> None:
        """Reader ``reader_rank`` failed to apply ``version`` (as published in ``epoch``): its engine
        is ``invalid`` (the failure touched its weights), or still serves ``holds`` (None: what it
        started with). A failure of an epoch that a later one superseded is ignored."""
        self._run(self._one(calls.report_failed(self.job, reader_rank, version, error, epoch, invalid=invalid,
                                                holds=holds)))

    def reader_versions(self) -> dict[int, int | None]:
        """Reader rank -> last applied version (None: never applied, or failed since)."""
        return self._run(self._one(calls.readers(self.job))).versions

    def wait_readers(self, *, min_version: int, readers: int, timeout: float) -> dict[int, int | None]:
        """Long-poll until reader ranks ``0..readers-1`` (registered) are done with ``min_version``:
        applied it or newer, or reported failing it or newer (such a reader waits for a newer
        version, never this one). Returns reader rank -> applied version.

        Raises:
            TimeoutError: naming the laggards and their versions.
        """
        return self.wait_reader_report(min_version=min_version, readers=readers, timeout=timeout).versions

    def wait_reader_report(self, *, min_version: int, readers: int, timeout: float, settled: int | None = None,
                           applied: int = 0) -> ReaderReport:
        """:meth:`wait_readers`, answering the whole report (``report.failed(v)``: who failed and why).
        ``settled``: done once that many (not all) are done with it; ``applied`` (when positive):
        done also once that many applied it (a completion policy's quorum)."""
        return self._run(self._wait_reader_report(min_version, readers, timeout, settled, applied))

    # --- identity and liveness ---------------------------------------------------------------
    def pin_instance(self) -> str:
        """Pin the server's current instance: from now on every call fails at once with
        :class:`~weightsync.meta.calls.ServerStateLostError` if the server restarted without its
        state (its registrations gone). Returns the instance."""
        return self._run(self._pin_instance())

    def acquire_lease(self, role: str, rank: int, *, incarnation: str, ttl: float, pid: int = 0, host: str = "",
                      wait: float = 0.0, release: bool = False) -> bool:
        """Take, renew or release the lease of ``(role, rank)`` (see :mod:`weightsync.meta.leases`).
        Returns True if this incarnation took it over from a dead one.

        Raises:
            ValueError: another live process holds it (after ``wait`` seconds), naming it.
        """
        return self._run(self._one(calls.lease(self.job, role, rank, incarnation=incarnation, ttl=ttl, pid=pid,
                                               host=host, wait=wait, release=release)))

    def leases(self) -> list[LeaseRow]:
        """Every lease of this job: role, rank, holder (pid, host), alive, seconds since its heartbeat."""
        return self._run(self._leases())

    # --- the fleet coordinator (docs/fleet.md: wired on the server, not yet used by the roles) ---
    def fleet_join(self, join: Join, *, ttl: float | None = None) -> FleetAnswer:
        """Join the fleet (``reply.id``: the seat; ``ttl``: this member's lease period).

        Raises:
            ValueError: the join contradicts the job (another shape, a seat held by a live process).
        """
        return self._run(self._one(calls.fleet_command(self.job, join, ttl=ttl)))

    def fleet_command(self, command: Command) -> FleetAnswer:
        """Send a member's command (``Leave``, ``OpenTry``, ``Ready``, ``Fail``, ``Report``)."""
        return self._run(self._one(calls.fleet_command(self.job, command)))

    def fleet_beat(self, role: str, id_: int, incarnation: str) -> bool:
        """Renew this member's lease; False: the coordinator ended it (join again as a new process)."""
        return self._run(self._one(calls.fleet_beat(self.job, role, id_, incarnation)))

    def fleet_tick(self) -> FleetTicked:
        """Expire the members whose lease ran out and decide the tries whose deadline came."""
        return self._run(self._one(calls.fleet_tick(self.job)))

    def fleet_record(self, *, after: int = -1, wait: float = 0.0) -> FleetView:
        """The fleet record; with ``wait``, long-poll until its revision is past ``after``."""
        return self._run(self._one(calls.fleet_record(self.job, after=after, wait=wait)))

    # --- jobs ------------------------------------------------------------------------------
    def server_status(self) -> dict[str, Any]:
        """The server's own status: ``instance``, ``started_at``, ``uptime_seconds``, ``durable``,
        and ``waiting`` (long-polls it holds now, which tests and operators can watch)."""
        return dict(self._run(self._one(calls.status(self.job)))["server"])

    def status(self) -> dict[str, Any]:
        """This job's status (participants, versions, each reader's lag and last sync), as JSON data."""
        return self._run(self._job_status())

    def delete_job(self) -> bool:
        """Forget this job on the server (participants, documents, versions). True if it existed."""
        return self._run(self._one(calls.delete_job(self.job)))


def open_meta(address: str | None = None, *, job: str = "default", token: str | None = None,
              timeout: float = 30.0) -> AnyMetaClient:
    """A client of the coordinator at ``address`` or ``WEIGHTSYNC_META_ADDR``: an etcd cluster
    (``etcd://host1:2379,...``: :class:`~weightsync.meta.etcd.client.EtcdMetaClient`, its
    password from ``WEIGHTSYNC_ETCD_PASSWORD``) or a meta server (:class:`MetaClient`, with
    ``token`` or ``WEIGHTSYNC_META_TOKEN``).

    Raises:
        ValueError: no address, or a malformed one (naming what is wrong).
        ModuleNotFoundError: an etcd address without etcd3gw installed (naming the install command).
    """
    env = MetaEnv.from_env()
    address = address or env.address
    if address is not None and is_etcd_address(address):
        from weightsync.meta.etcd import EtcdMetaClient

        return EtcdMetaClient(address, job=job, timeout=timeout, password=env.etcd_password)
    return MetaClient.from_env(job=job, address=address, token=token, timeout=timeout)


def job_meta(address: str, *, job: str, given: AnyMetaClient | None) -> AnyMetaClient:
    """The coordinator client a writer or reader uses: ``given`` when the caller passed one (it
    must then be for ``address``, when a config names one), else a new client for ``address``
    (``SyncConfig.meta_address``), or ``WEIGHTSYNC_META_ADDR`` when that is "".

    Raises:
        ValueError: ``given`` is for another coordinator than ``address`` (both named), or the
            address is malformed.
    """
    if given is None:
        return open_meta(address or None, job=job)
    if address and not same_coordinator(address, given.address):
        raise ValueError(f"SyncConfig.meta_address is {address!r} but the meta client passed is for {given.address!r}: "
                         "leave meta_address empty when passing a client, or pass the client of that coordinator")
    return given


def connect(address: str | None = None, *, job: str = "default", token: str | None = None,
            timeout: float = 30.0) -> tuple[AnyMetaClient, EmbeddedMetaServer | None]:
    """A client for ``address`` / ``WEIGHTSYNC_META_ADDR``, or else for an embedded server.

    Runs need not start anything: without an address a single process starts an
    :class:`~weightsync.meta.embedded.EmbeddedMetaServer` on 127.0.0.1 (a daemon thread of this
    process); under torchrun or accelerate (``WORLD_SIZE`` > 1) rank 0 starts it and the others
    find it through torch's store (:mod:`weightsync.meta.launch`), and a multi-process job that
    has no store fails at once naming ``WEIGHTSYNC_META_ADDR``. The caller closes the client and
    stops the server (if not None).
    """
    from weightsync.meta.launch import LaunchEnv, shared_meta_server

    env = MetaEnv.from_env()
    address = address or env.address
    if address is not None:
        return open_meta(address, job=job, token=token or env.token, timeout=timeout), None
    launch = LaunchEnv.from_env()
    if launch.launched:
        address, shared_token, server = shared_meta_server(job, launch, timeout=timeout)
        return MetaClient(address, job=job, token=shared_token, timeout=timeout), server
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
