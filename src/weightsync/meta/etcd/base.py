"""What every part of the etcd coordinator shares: the connection, the job's keys, the pinned
store instance, one-round-trip reads and writes, and the watch-driven wait.

Every change is one etcd transaction that compares what the change read (the keys' revisions)
and, once :meth:`EtcdBase.pin_instance` ran, that the store is still the one this client
registered with; a transaction whose compares fail is read and decided again. Every wait reads
the state and then watches the keys it depends on from the revision of that read, so no change
is missed and nothing polls; it wakes at least every :data:`PROGRESS_SECONDS` to re-read (and, in a
barrier, to log who is missing).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from weightsync.clock.deadline import Deadline
from weightsync.meta.calls import ServerStateLostError
from weightsync.meta.etcd import kv as ops
from weightsync.meta.etcd.address import EtcdAddress
from weightsync.meta.etcd.kv import EtcdKV, Row
from weightsync.meta.etcd.schema import JobKeys
from weightsync.meta.records import check_job

T = TypeVar("T")
#: a wait re-reads at least this often (a watch on a member that stopped answering ends no later)
PROGRESS_SECONDS = 5.0


class EtcdBase:
    """The shared part of :class:`~weightsync.meta.etcd.client.EtcdMetaClient` (see module docstring)."""

    def __init__(self, address: str | EtcdAddress, *, job: str = "default", timeout: float = 30.0,
                 password: str | None = None) -> None:
        etcd = address if isinstance(address, EtcdAddress) else EtcdAddress.parse(address)
        self.etcd = etcd.with_password(password)
        self.address = str(self.etcd)
        self.job = check_job(job)
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.kv = EtcdKV(self.etcd, timeout=self.timeout)
        self.keys = JobKeys(self.etcd.prefix, self.job)
        #: the store instance this client pinned (None: any); see :meth:`pin_instance`
        self.instance: str | None = None
        #: (role, rank) -> (incarnation, etcd lease id) of the leases this client took
        self._granted: dict[tuple[str, int], tuple[str, int]] = {}
        self._granted_lock = threading.Lock()

    def close(self) -> None:
        self.kv.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, job={self.job!r})"

    # -- identity ----------------------------------------------------------------------------------
    def pin_instance(self) -> str:
        """Pin the store's instance (``<prefix>/instance``, created by the first client): from now
        on every change fails with :class:`~weightsync.meta.calls.ServerStateLostError` if the
        store was wiped or replaced (its registrations gone). Returns the instance."""
        self.instance = None
        created = secrets.token_hex(8).encode()
        key = self.keys.instance
        ok, _, answers = self.kv.txn([ops.unchanged(key, 0)], [ops.put(key, created)], [ops.read(key)],
                                     what="pin the store instance")
        self.instance = created.decode() if ok else ops.rows_of(answers[0])[0].value.decode()
        return self.instance

    def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
            failure: Sequence[dict[str, Any]] = (), *, what: str) -> tuple[bool, list[dict[str, Any]]]:
        """One transaction, also comparing the pinned instance: (whether it applied, the answers
        of ``success`` or ``failure``).

        Raises:
            ServerStateLostError: the store is not the one this client pinned.
        """
        if self.instance is None:
            ok, _, answers = self.kv.txn(compare, success, failure, what=what)
            return ok, answers
        key = self.keys.instance
        ok, _, answers = self.kv.txn([*compare, ops.holds(key, self.instance.encode())], success,
                                     [ops.read(key), *failure], what=what)
        if ok:
            return True, answers
        now = ops.rows_of(answers[0])
        if not now or now[0].value.decode() != self.instance:
            raise ServerStateLostError(
                f"etcd {self.address}: the store is not the one this client registered with (instance "
                f"{self.instance} is now {now[0].value.decode() if now else 'gone'}): it was wiped or replaced, so "
                f"job {self.job!r}'s registrations, versions and reader progress are gone; restart the job")
        return False, answers[1:]

    def read(self, *requests: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """Several ranges read at one revision in one round trip: (their answers, the revision)."""
        _, revision, answers = self.kv.txn([], requests, what="read the job's state")
        return answers, revision

    def rows(self, *requests: dict[str, Any]) -> tuple[list[Row], int]:
        answers, revision = self.read(*requests)
        return [row for answer in answers for row in ops.rows_of(answer)], revision

    def wait(self, watch: str, read: Callable[[], tuple[T, int]], done: Callable[[T], bool], timeout: float, *,
             prefix: bool = False, progress: Callable[[T, float], None] | None = None) -> T:
        """Read until ``done(value)`` or ``timeout`` seconds passed, watching ``watch`` (a key, or
        with ``prefix`` every key under it) between reads; returns the last value read."""
        deadline = Deadline.after(max(0.0, timeout))
        said = time.monotonic()
        while True:
            value, revision = read()
            if done(value) or deadline.expired:
                return value
            if progress is not None and time.monotonic() - said >= PROGRESS_SECONDS:
                said = time.monotonic()
                progress(value, deadline.remaining(0.0))
            step = Deadline.after(min(deadline.remaining(0.0), PROGRESS_SECONDS))
            self.kv.watch(watch, prefix=prefix, after=revision, deadline=step)
