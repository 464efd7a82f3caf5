"""What a transport needs from the job channel: who this rank is, its peers' endpoints, and
whether its peers are alive.

A transport reaches its peers only through this port. :class:`~weightsync.job.channel.JobChannel`
provides it; a test or a third-party harness may give a transport any object that has these
members (tests/fake_meta.py's directory-backed channel does), so a transport never probes the
channel for what it can do: everything it may ask is declared here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from typing_extensions import Self

    from weightsync.clock.deadline import Deadline
    from weightsync.plan.ops import Role
    from weightsync.ports.coordinator import Holder

__all__ = ["EndpointRecord", "TransportChannel"]


class EndpointRecord(Protocol):
    """How peers reach one rank's transport in one epoch (see :mod:`weightsync.transport.endpoints`).

    ``transport`` names the transport whose endpoint this is (the channel keys it by that name,
    the epoch and the rank); ``to_wire`` gives its msgpack map and ``from_wire`` checks one.
    """

    transport: ClassVar[str]

    def to_wire(self) -> dict[str, Any]: ...

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> Self: ...


E = TypeVar("E", bound=EndpointRecord)


class TransportChannel(Protocol):
    """The job channel as a transport sees it.

    ``lease_seconds`` is this rank's lease (0: the job runs without leases, and peers are
    never declared dead); a transport that must tell a peer's death from a slow peer sizes its
    waits by it.
    """

    @property
    def role(self) -> Role: ...

    @property
    def rank(self) -> int: ...

    @property
    def who(self) -> str: ...

    @property
    def lease_seconds(self) -> float: ...

    def publish_endpoint(self, epoch: int, endpoint: EndpointRecord) -> None:
        """What peers need to reach this rank's transport (``endpoint.transport``) in ``epoch``."""

    def wait_endpoint(self, kind: type[E], epoch: int, role: Role, rank: int, *, deadline: Deadline) -> E | None:
        """A peer's endpoint of ``kind`` in ``epoch`` once published; None at the deadline.
        Raises WireError when the peer published something malformed."""

    def dead_peers(self, role: Role, ranks: Iterable[int], *, max_age: float = 0.25,
                   known: Mapping[tuple[str, int], Holder] | None = None, departed: bool = True) -> dict[int, str]:
        """Peers of ``role`` among ``ranks`` that died (or, with ``known``, were replaced):
        rank -> why. ``departed=False``: a peer that released its lease (it left on purpose) is
        not counted."""

    def lease_holders(self, *, max_age: float = 0.25) -> dict[tuple[str, int], Holder]:
        """Who holds each live lease now (empty without leases)."""

    def writers_out_of_epoch(self, epoch: int, ranks: Iterable[int]) -> dict[int, str]:
        """The writers of ``ranks`` that will never take part in ``epoch``: rank -> why. A writer
        with no live process that had not joined the epoch is closed out of it by this call, so
        that its restart joins a later epoch and no rank waits for it (``weightsync.job.epochs``).
        One call for every writer a transport waits on: the channel reads the leases once."""

    def writer_writes(self, rank: int) -> int | None:
        """The version writer ``rank``'s live process writes now (None: it recorded none, or has no
        live process). Writers write versions in order, so a reader waiting for an older one from
        it waits for a version that process will never send again."""

    @property
    def incarnation(self) -> str:
        """This process's claim on its rank (a restarted process has another): a transport puts it
        in what it publishes where a restart must not be taken for its predecessor."""

    def current_epoch(self) -> int:
        """The job's epoch now: past a transport's own when the job re-planned since it connected
        (a rank restarted, a reader joined or left), so that a peer's retired memory or
        connection is named as superseded rather than as broken."""
