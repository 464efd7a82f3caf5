"""The job channel's port: what :class:`~weightsync.job.channel.JobChannel` asks of the meta server.

Kept apart from the channel so that the protocol has one short definition: the meta clients
(:mod:`weightsync.meta`) provide it, the channel is its only caller (tests/test_architecture.py
checks that every other module reaches the meta server through the channel), and the
transport contract tests stand in for its :class:`TransportBoard` part with a directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from weightsync.ports.records import LeaseRow, Participant, ReaderReport, VersionInfo

__all__ = ["Holder", "MetaPort", "PeerDiedError", "TransportBoard"]


@dataclass(frozen=True)
class Holder:
    """The process holding a rank's lease: its incarnation (one per process), pid and host."""

    incarnation: str
    pid: int
    host: str


class PeerDiedError(RuntimeError):
    """A peer this rank waited for died (its lease expired or it left): the message names it."""


class TransportBoard(Protocol):
    """What transports use of the meta server through the channel: job documents (with
    long-poll reads) and peers' leases (:meth:`JobChannel.dead_peers`).

    The transport contract tests give the channel a directory-backed stand-in of this
    (``tests/fake_meta.py``): a channel over it serves transports, nothing else.
    """

    job: str

    def put_document(self, key: str, value: bytes) -> None: ...

    def get_document(self, key: str, *, wait: float = 0.0) -> bytes | None: ...

    def leases(self) -> list[LeaseRow]: ...


class MetaPort(TransportBoard, Protocol):
    """Everything :class:`JobChannel` asks of the meta server (:class:`~weightsync.meta.client.MetaClient`
    provides it; see that class for what each call means)."""

    def pin_instance(self) -> str: ...

    def register(self, participant: Participant) -> bool: ...

    def participants(self, role: str | None = None) -> list[Participant]: ...

    def wait_registered(self, *, writers: int, readers: int, timeout: float) -> list[Participant]: ...

    def counter(self, name: str, *, at_least: int = 0, wait: float = 0.0) -> int: ...

    def compare_and_set(self, name: str, *, expected: int, value: int) -> tuple[bool, int]: ...

    def publish_version(self, version: int, fingerprint: str, *, writer_rank: int, num_writers: int,
                        epoch: int = 0) -> VersionInfo | None: ...

    def latest_version(self) -> VersionInfo | None: ...

    def wait_version(self, after: int, timeout: float, *, after_epoch: int | None = None) -> VersionInfo | None: ...

    def report_applied(self, reader_rank: int, version: int, *, nbytes: int = 0, seconds: float = 0.0) -> None: ...

    def report_failed(self, reader_rank: int, version: int, error: str, *, epoch: int | None = None,
                      invalid: bool = True, holds: int | None = None) -> None: ...

    def reader_versions(self) -> dict[int, int | None]: ...

    def wait_reader_report(self, *, min_version: int, readers: int, timeout: float, settled: int | None = None,
                           applied: int = 0) -> ReaderReport: ...

    def acquire_lease(self, role: str, rank: int, *, incarnation: str, ttl: float, pid: int = 0, host: str = "",
                      wait: float = 0.0, release: bool = False) -> bool: ...
