"""The asyncio client of the etcd coordinator, for what a joining rank does:
:class:`AsyncEtcdMetaClient`.

It runs the steps the sync :class:`~weightsync.meta.etcd.client.EtcdMetaClient` runs
(:mod:`weightsync.meta.etcd.barrier`, :mod:`weightsync.meta.etcd.steps`: one transaction to
register and announce the barrier, a watch to wait for it, the roster decoded from the watch
event) over :class:`~weightsync.meta.etcd.gateway.AsyncEtcdKV` (``aiohttp``), so that many ranks
share one event loop instead of a thread each, as the embedded server's
:class:`~weightsync.meta.async_client.AsyncMetaClient` lets them. Same keys, same records, same
answers and errors; a rank registered by either client is the same rank to the other.

    async with AsyncEtcdMetaClient("etcd://n1:2379,n2:2379,n3:2379", job="grpo") as meta:
        if rank == 0:
            await meta.put_document("model/config", config)
        table = await meta.join(participant, writers=1024, readers=256, timeout=300,
                                documents=["model/config"])

Versions, reader reports and leases are the sync client's (a rank joins once; what follows is
a few calls per version). The fleet record's five calls (docs/fleet.md) are here too, the same
steps as the sync client's (:mod:`weightsync.meta.etcd.fleet`), so that a coordinator of many
members (a serving fleet's engines joining and beating) runs on one event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TypeVar

from weightsync.clock.clock import SYSTEM, Clock
from weightsync.clock.deadline import Deadline
from weightsync.meta.etcd import barrier, fleet, steps
from weightsync.meta.etcd.address import EtcdAddress
from weightsync.meta.etcd.gateway import AsyncEtcdKV
from weightsync.meta.etcd.ops import Row, TxnAnswer
from weightsync.meta.etcd.settings import EtcdSettings
from weightsync.meta.etcd.steps import Grant, KeepAlive, Steps, Txn, Watch
from weightsync.meta.fleet.answers import FleetAnswer, FleetTicked, FleetView
from weightsync.meta.fleet.commands import Command, Join
from weightsync.meta.records import ParticipantTable
from weightsync.ports.records import Participant

__all__ = ["AsyncEtcdMetaClient"]

T = TypeVar("T")


class AsyncEtcdMetaClient(EtcdSettings):
    """A rank's asyncio client of the etcd coordinator (see module docstring). Use ``async with``
    or :meth:`aclose`; one event loop.

    Args:
        address: ``etcd://host1:2379,host2:2379,...`` (see :mod:`weightsync.meta.etcd.address`).
        job: the job's namespace.
        timeout: how long a call keeps failing over between members before it raises.
        password: the etcd user's password (``WEIGHTSYNC_ETCD_PASSWORD``), if the address names a user.
        clock: the time the fleet calls decide at (a test's ``ManualClock``; the system's by default).
    """

    def __init__(self, address: str | EtcdAddress, *, job: str = "default", timeout: float = 30.0,
                 password: str | None = None, clock: Clock = SYSTEM) -> None:
        super().__init__(address, job=job, timeout=timeout, password=password)
        #: the time of the fleet coordinator's decisions (:mod:`weightsync.meta.etcd.fleet`)
        self.clock = clock
        self.kv = AsyncEtcdKV(self.etcd, timeout=self.timeout)

    async def aclose(self) -> None:
        await self.kv.aclose()

    async def forget_lease(self, lease: int) -> None:
        """Revoke an etcd lease this client no longer uses, if etcd answers soon (it expires on its own)."""
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.kv.revoke(lease, Deadline.after(min(self.timeout, 2.0)))

    async def __aenter__(self) -> AsyncEtcdMetaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- steps -------------------------------------------------------------------------------------
    async def run(self, operation: Steps[T]) -> T:
        """Drive an operation's steps (see :mod:`weightsync.meta.etcd.steps`) with awaits."""
        answer: TxnAnswer | tuple[Row, ...] | int | None = None
        try:
            while True:
                try:
                    step = operation.send(answer)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                if isinstance(step, Txn):
                    answer = await self.commit(step)
                elif isinstance(step, Watch):
                    answer = await self.kv.watch_rows(step.key, prefix=step.prefix, after=step.after,
                                                      deadline=Deadline.after(step.seconds))
                elif isinstance(step, Grant):
                    answer = await self.kv.grant(step.ttl)
                elif isinstance(step, KeepAlive):
                    answer = await self.kv.keepalive(step.lease)
                else:
                    await self.forget_lease(step.lease)
                    answer = None
        finally:
            await self.kv.release_watch()  # a watch kept open between this call's waits

    async def commit(self, step: Txn) -> TxnAnswer:
        """One transaction, also comparing the pinned instance.

        Raises:
            ServerStateLostError: the store is not the one this client pinned.
        """
        compare, failure, instance = self.pinned(step)
        return self.unpinned(await self.kv.txn(compare, step.success, failure, what=step.what), instance)

    # -- the calls ---------------------------------------------------------------------------------
    async def pin_instance(self) -> str:
        """Pin the store's instance (see :meth:`weightsync.meta.etcd.client.EtcdMetaClient.pin_instance`)."""
        self.instance = None
        self.instance = await self.run(steps.pin_instance(self.keys))
        return self.instance

    async def register(self, participant: Participant) -> bool:
        """Register a rank (idempotent). Returns True if it was new.

        Raises:
            ValueError: the rank is already registered with different data (names the fields).
        """
        return (await self.run(barrier.register(self.keys, participant)))[0]

    async def table(self, *, documents: Sequence[str] = ()) -> ParticipantTable:
        """The roster (and the documents named in ``documents``: ``table.documents``)."""
        return await self.run(barrier.table(self.keys, documents))

    async def participants(self, role: str | None = None) -> list[Participant]:
        """All registered participants (or those of ``role``), sorted by ``(role, rank)``."""
        return (await self.table()).participants(role)

    async def wait_table(self, *, writers: int, readers: int, timeout: float,
                         documents: Sequence[str] = ()) -> ParticipantTable:
        """Barrier: wait until ``writers`` writers and ``readers`` readers registered; the roster.

        Raises:
            TimeoutError: naming the ranks still missing.
        """
        return await self.run(barrier.wait(self.keys, writers=writers, readers=readers, timeout=timeout,
                                           documents=documents))

    async def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        return (await self.wait_table(writers=writers, readers=readers, timeout=timeout)).participants()

    async def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
                   documents: Sequence[str] = ()) -> ParticipantTable:
        """Register, then wait at the barrier: one transaction and one watch (see
        :mod:`weightsync.meta.etcd.barrier`); the roster, with the documents named in ``documents``."""
        return await self.run(barrier.join(self.keys, participant, writers=writers, readers=readers, timeout=timeout,
                                           documents=documents))

    async def put_document(self, key: str, value: bytes) -> None:
        """Store a job-level document under ``key``; overwrites."""
        await self.run(steps.put_document(self.keys, key, value))

    async def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None:
        """The document ``key``; with ``wait > 0``, watched for until it exists. None if absent."""
        return await self.run(steps.get_document(self.keys, key, wait))


    # -- the fleet record (docs/fleet.md) ------------------------------------------------------------
    async def fleet_join(self, join: Join, *, ttl: float | None = None) -> FleetAnswer:
        """See :meth:`weightsync.meta.etcd.fleet.Fleet.fleet_join`."""
        return await self.run(fleet.fleet_join(self.keys, self.clock, join, ttl))

    async def fleet_command(self, command: Command) -> FleetAnswer:
        """See :meth:`weightsync.meta.etcd.fleet.Fleet.fleet_command`."""
        return await self.run(fleet.fleet_command(self.keys, self.clock, command))

    async def fleet_beat(self, role: str, id_: int, incarnation: str) -> bool:
        """See :meth:`weightsync.meta.etcd.fleet.Fleet.fleet_beat`."""
        return await self.run(fleet.fleet_beat(self.keys, role, id_, incarnation))

    async def fleet_tick(self) -> FleetTicked:
        """See :meth:`weightsync.meta.etcd.fleet.Fleet.fleet_tick`."""
        return await self.run(fleet.fleet_tick(self.keys, self.clock))

    async def fleet_record(self, *, after: int = -1, wait: float = 0.0) -> FleetView:
        """See :meth:`weightsync.meta.etcd.fleet.Fleet.fleet_record`."""
        return await self.run(fleet.fleet_record(self.keys, after=after, wait=wait))
