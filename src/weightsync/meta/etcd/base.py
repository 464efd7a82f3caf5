"""What every part of the sync etcd coordinator shares: the connection, the job's keys, the pinned
store instance, one-round-trip reads and writes, and the driver of the shared steps.

Every change is one etcd transaction that compares what the change read (the keys' revisions)
and, once :meth:`EtcdBase.pin_instance` ran, that the store is still the one this client
registered with; a transaction whose compares fail is read and decided again. Every wait reads
the state and then watches the keys it depends on from the revision of that read, so no change
is missed and nothing polls (:func:`weightsync.meta.etcd.steps.watched`). Operations written once
for this client and the asyncio one (:mod:`weightsync.meta.etcd.steps`) run through :meth:`EtcdBase.run`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from weightsync.clock.clock import SYSTEM, Clock
from weightsync.clock.deadline import Deadline
from weightsync.meta.etcd import steps
from weightsync.meta.etcd.address import EtcdAddress
from weightsync.meta.etcd.kv import EtcdKV
from weightsync.meta.etcd.ops import Row, TxnAnswer
from weightsync.meta.etcd.settings import EtcdSettings
from weightsync.meta.etcd.steps import PROGRESS_SECONDS, Grant, KeepAlive, Steps, Txn, Watch

__all__ = ["PROGRESS_SECONDS", "EtcdBase", "EtcdSettings"]

T = TypeVar("T")


class EtcdBase(EtcdSettings):
    """The shared part of :class:`~weightsync.meta.etcd.client.EtcdMetaClient` (see module docstring)."""

    def __init__(self, address: str | EtcdAddress, *, job: str = "default", timeout: float = 30.0,
                 password: str | None = None, clock: Clock = SYSTEM) -> None:
        super().__init__(address, job=job, timeout=timeout, password=password)
        #: the time of the fleet coordinator's decisions (:mod:`weightsync.meta.etcd.fleet`)
        self.clock = clock
        self.kv = EtcdKV(self.etcd, timeout=self.timeout)
        #: (role, rank) -> (incarnation, etcd lease id) of the leases this client took
        self._granted: dict[tuple[str, int], tuple[str, int]] = {}
        self._granted_lock = threading.Lock()

    def close(self) -> None:
        self.kv.close()

    def forget_lease(self, lease: int) -> None:
        """Revoke an etcd lease this client no longer uses, if etcd answers soon (it expires on its own)."""
        with contextlib.suppress(ConnectionError, RuntimeError):
            self.kv.revoke(lease, Deadline.after(min(self.timeout, 2.0)))

    # -- steps -------------------------------------------------------------------------------------
    def run(self, operation: Steps[T]) -> T:
        """Drive an operation's steps (see :mod:`weightsync.meta.etcd.steps`) with blocking calls."""
        answer: TxnAnswer | tuple[Row, ...] | int | None = None
        while True:
            try:
                step = operation.send(answer)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if isinstance(step, Txn):
                answer = self.commit(step)
            elif isinstance(step, Watch):
                answer = self.kv.watch_rows(step.key, prefix=step.prefix, after=step.after,
                                            deadline=Deadline.after(step.seconds))
            elif isinstance(step, Grant):
                answer = self.kv.grant(step.ttl)
            elif isinstance(step, KeepAlive):
                answer = self.kv.keepalive(step.lease)
            else:
                self.forget_lease(step.lease)
                answer = None

    def commit(self, step: Txn) -> TxnAnswer:
        """One transaction, also comparing the pinned instance.

        Raises:
            ServerStateLostError: the store is not the one this client pinned.
        """
        compare, failure, instance = self.pinned(step)
        return self.unpinned(self.kv.txn(compare, step.success, failure, what=step.what), instance)

    # -- identity ----------------------------------------------------------------------------------
    def pin_instance(self) -> str:
        """Pin the store's instance (``<prefix>/instance``, created by the first client): from now
        on every change fails with :class:`~weightsync.meta.calls.ServerStateLostError` if the
        store was wiped or replaced (its registrations gone). Returns the instance."""
        self.instance = None
        self.instance = self.run(steps.pin_instance(self.keys))
        return self.instance

    def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
            failure: Sequence[dict[str, Any]] = (), *, what: str) -> tuple[bool, list[dict[str, Any]]]:
        """One transaction, also comparing the pinned instance: (whether it applied, the answers
        of ``success`` or ``failure``).

        Raises:
            ServerStateLostError: the store is not the one this client pinned.
        """
        answer = self.commit(Txn(tuple(compare), tuple(success), tuple(failure), what))
        return answer.ok, answer.responses

    def read(self, *requests: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """Several ranges read at one revision in one round trip: (their answers, the revision)."""
        return self.run(steps.read(*requests))

    def rows(self, *requests: dict[str, Any]) -> tuple[list[Row], int]:
        return self.run(steps.rows(*requests))

    def wait(self, watch: str, read: Callable[[], tuple[T, int]], done: Callable[[T], bool], timeout: float, *,
             prefix: bool = False, progress: Callable[[T, float], None] | None = None) -> T:
        """Read until ``done(value)`` or ``timeout`` seconds passed, watching ``watch`` (a key, or
        with ``prefix`` every key under it) between reads; returns the last value read."""
        return self.run(steps.watched(watch, lambda: steps.already(read()), done, timeout, prefix=prefix,
                                      progress=progress))
