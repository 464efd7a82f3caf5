"""Where the meta server keeps what it acknowledged: a small interface, and a store in memory.

The service (:mod:`weightsync.meta.state`) asks a store for two things: the events that rebuild
its state when it starts (``open``), and to make one change's events durable before the change
is applied and answered (``commit``: one transaction; it raises and stores nothing when it
cannot). Anything that can do that can stand behind the server: a store in memory (no
``--state-dir``), SQLite in a state directory (:mod:`weightsync.meta.sqlite_store`), or, later,
a replicated store (etcd, Redis) behind the same five calls.

    store = SqliteStore(Path("state"))
    opened = store.open(new_instance)      # refuses (StoreDamagedError) a store that lost anything
    store.commit(events, encode_events(events))   # durable on return, or StoreError and nothing stored
    store.compact(snapshot(data))          # now and then: the events that rebuild the state, exactly
    store.close()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from weightsync.meta.events import Event


class StoreError(RuntimeError):
    """A change the store could not make durable: nothing of it was stored (the server answers 503)."""


class StoreFullError(StoreError):
    """The store's disk is full: nothing was stored; the same request succeeds once space returns."""


class StoreDamagedError(ValueError):
    """At start: the store fails its integrity check. The message says what is damaged and how to
    recover; the server refuses to start rather than drop acknowledged changes on its own."""


class StoreAccessError(ValueError):
    """At start: the state directory or a file in it cannot be written (permissions, a read-only
    file system). Nothing is damaged; the message names the path and how to give the server access."""


@dataclass(frozen=True, slots=True)
class Opened:
    """What a store holds: the identity of its state and the events that rebuild it, in order."""

    instance: str
    events: list[Event]


@dataclass(slots=True)
class StoreStats:
    """For ``/metrics``: commits, the seconds they took, bytes logged since the last compaction."""

    commits: int = 0
    commit_seconds: float = 0.0
    log_bytes: int = 0
    compactions: int = 0


class Store(Protocol):
    """The durable side of the meta server (see module docstring). One server uses a store at a time."""

    #: whether what it holds outlives the process (the server's ``durable`` flag)
    durable: ClassVar[bool]
    stats: StoreStats

    def open(self, instance: str) -> Opened:
        """Take the store (locking it against a second server) and read what it holds; a new store
        takes ``instance`` as its identity.

        Raises:
            StoreDamagedError: it fails its integrity check or is in use by another server.
            StoreAccessError: it cannot be written (permissions, a read-only file system).
        """
        ...

    def commit(self, events: Sequence[Event], encoded: bytes) -> None:
        """Store one change's ``events`` (``encoded``: their wire form) in one transaction, durably.

        Raises:
            StoreError: nothing was stored (StoreFullError: no space left).
        """
        ...

    def compact(self, snapshot: Sequence[Event]) -> None:
        """Replace everything stored by ``snapshot`` (events that rebuild the same state), atomically.

        Raises:
            StoreError: nothing changed.
        """
        ...

    @property
    def needs_compaction(self) -> bool: ...

    def broken(self) -> str | None:
        """Why the last commit failed (until one succeeds), or None: ``/healthz`` reports it."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class MemoryStore:
    """No state directory: nothing outlives the process, and every commit succeeds."""

    durable: ClassVar[bool] = False
    stats: StoreStats = field(default_factory=StoreStats)

    def open(self, instance: str) -> Opened:
        return Opened(instance, [])

    def commit(self, events: Sequence[Event], encoded: bytes) -> None:
        pass

    def compact(self, snapshot: Sequence[Event]) -> None:
        pass

    @property
    def needs_compaction(self) -> bool:
        return False

    def broken(self) -> str | None:
        return None

    def close(self) -> None:
        pass
