"""What the parts of :class:`~weightsync.job.channel.JobChannel` share: the attributes the channel
sets and the liveness call they ask it, declared once for the type checker."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from weightsync.plan.ops import Role
from weightsync.ports.coordinator import Holder, MetaPort


class ChannelPart:
    """A part of the job channel: :class:`~weightsync.job.board.Board`, :class:`~weightsync.job.epochs.Epochs`,
    :class:`~weightsync.job.reader_waits.ReaderWaits`, :class:`~weightsync.job.fleet_commit.FleetCommit`
    (the channel sets these attributes)."""

    meta: MetaPort
    role: Role
    rank: int
    lease_seconds: float

    if TYPE_CHECKING:
        @property
        def who(self) -> str: ...

        def dead_peers(self, role: Role, ranks: Iterable[int], *, max_age: float = 0.25,
                       known: Mapping[tuple[str, int], Holder] | None = None,
                       departed: bool = True) -> dict[int, str]: ...


__all__ = ["ChannelPart"]
