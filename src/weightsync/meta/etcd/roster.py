"""Registration and the barrier of :class:`~weightsync.meta.etcd.client.EtcdMetaClient`: the
steps of :mod:`weightsync.meta.etcd.barrier` (one transaction to join, one wake-up per waiting
rank), driven with blocking calls. The asyncio client drives the same steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.meta.etcd import barrier
from weightsync.meta.etcd.base import EtcdBase
from weightsync.meta.records import ParticipantTable
from weightsync.ports.records import Participant


class Roster(EtcdBase):
    """The participant calls of :class:`~weightsync.meta.etcd.client.EtcdMetaClient` (see module docstring)."""

    def register(self, participant: Participant) -> bool:
        """Register a rank (idempotent). Returns True if it was new.

        Raises:
            ValueError: the rank is already registered with different data (names the fields).
        """
        return self.run(barrier.register(self.keys, participant))[0]

    def table(self, *, documents: Sequence[str] = ()) -> ParticipantTable:
        """The roster (and the documents named in ``documents``: ``table.documents``)."""
        return self.run(barrier.table(self.keys, documents))

    def participants(self, role: str | None = None) -> list[Participant]:
        """All registered participants (or those of ``role``), sorted by ``(role, rank)``."""
        return self.table().participants(role)

    def wait_table(self, *, writers: int, readers: int, timeout: float,
                   documents: Sequence[str] = ()) -> ParticipantTable:
        """Barrier: wait until ``writers`` writers and ``readers`` readers registered; returns the
        roster (and the documents named in ``documents``).

        Raises:
            TimeoutError: naming the ranks still missing.
        """
        return self.run(barrier.wait(self.keys, writers=writers, readers=readers, timeout=timeout,
                                     documents=documents))

    def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]:
        """:meth:`wait_table`, as a list of participants sorted by ``(role, rank)``."""
        return self.wait_table(writers=writers, readers=readers, timeout=timeout).participants()

    def join(self, participant: Participant, *, writers: int, readers: int, timeout: float,
             documents: Sequence[str] = ()) -> ParticipantTable:
        """:meth:`register`, then :meth:`wait_table`, the registration's transaction reading what
        the wait needs (see :mod:`weightsync.meta.etcd.barrier`)."""
        return self.run(barrier.join(self.keys, participant, writers=writers, readers=readers, timeout=timeout,
                                     documents=documents))
