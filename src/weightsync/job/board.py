"""What ranks post for each other on the job channel: transport endpoints, FP8 tile maxima,
tensor-store indexes and versions. :class:`~weightsync.job.channel.JobChannel` inherits these methods.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import msgpack

from weightsync.job.keys import endpoint_key, peer_copy_key, store_index_key, tile_maxima_key
from weightsync.job.parts import ChannelPart
from weightsync.job.wire import STORE_FINGERPRINT, PeerCopy, WireError, unpack_map
from weightsync.plan.ops import Role
from weightsync.ports.channel import EndpointRecord

if TYPE_CHECKING:
    from weightsync.clock.deadline import Deadline

E = TypeVar("E", bound=EndpointRecord)
logger = logging.getLogger(__name__)


class Board(ChannelPart):
    """The document part of :class:`~weightsync.job.channel.JobChannel` (which sets these attributes)."""

    # -- transport endpoints ------------------------------------------------------------------
    def publish_endpoint(self, epoch: int, endpoint: EndpointRecord) -> None:
        """What peers need to reach this rank's transport (``endpoint.transport``) in ``epoch``."""
        key = endpoint_key(endpoint.transport, epoch, self.role, self.rank)
        self.meta.put_document(key, msgpack.packb(endpoint.to_wire(), use_bin_type=True))

    def wait_endpoint(self, kind: type[E], epoch: int, role: Role, rank: int, *, deadline: Deadline) -> E | None:
        """A peer's endpoint of ``kind``'s transport in ``epoch``, once published; None at the deadline.

        Raises:
            WireError: the peer published something else (names the peer and the field).
        """
        raw = self.meta.get_document(endpoint_key(kind.transport, epoch, role, rank), wait=deadline.remaining(0.0))
        if raw is None:
            return None
        try:
            return kind.from_wire(unpack_map(raw))
        except WireError as exc:
            raise WireError(f"{self.who}: {role} {rank}'s {kind.transport} endpoint for epoch {epoch} is malformed "
                            f"({exc}): is it running another weightsync release?") from None

    # -- peer copies --------------------------------------------------------------------------
    def publish_peer_copy(self, copy: PeerCopy) -> None:
        """This reader keeps ``copy`` for readers that join (``SyncConfig.peer_sources``)."""
        self.meta.put_document(peer_copy_key(self.rank), msgpack.packb(copy.to_wire(), use_bin_type=True))

    def peer_copies(self, seats: Sequence[int]) -> dict[int, PeerCopy]:
        """The copies readers at ``seats`` keep, by seat (a seat that published none, or something
        malformed, is left out: a joining reader then reads the writers, as without peers)."""
        out = {}
        for seat in seats:
            raw = self.meta.get_document(peer_copy_key(seat))
            if raw is None:
                continue
            try:
                out[seat] = PeerCopy.from_wire(unpack_map(raw))
            except WireError as exc:
                logger.warning("%s: reader %d's peer copy record is malformed (%s); not reading from it", self.who,
                               seat, exc)
        return out

    # -- FP8 tile maxima ----------------------------------------------------------------------
    def exchange_tile_maxima(self, version: int, payload: bytes | None, publishers: Sequence[int], *,
                             deadline: Deadline) -> list[bytes]:
        """Publish this writer's maxima of shared FP8 tiles for ``version`` (when it holds any)
        and collect those of ``publishers`` (see :mod:`weightsync.tools.codecs.fp8`).

        Raises:
            TimeoutError: naming the writers whose maxima did not arrive.
        """
        if payload is not None:
            self.meta.put_document(tile_maxima_key(version, self.rank), payload)
        out = []
        missing = []
        for writer in publishers:
            if writer == self.rank and payload is not None:
                out.append(payload)
                continue
            raw = self.meta.get_document(tile_maxima_key(version, writer), wait=deadline.remaining(0.0))
            if raw is None:
                missing.append(writer)
            else:
                out.append(raw)
        if missing:
            raise TimeoutError(f"{self.who}: FP8 tile maxima of version {version} never came from writer(s) "
                               f"{missing} (they share FP8 blocks with this writer)")
        return out

    # -- tensor store -------------------------------------------------------------------------
    def publish_store_index(self, version: int, index: bytes) -> None:
        """This store writer's part of ``version`` (an encoded index; empty: retired)."""
        self.meta.put_document(store_index_key(version, self.rank), index)

    def store_index(self, version: int, writer: int) -> bytes | None:
        """Writer ``writer``'s part of ``version``: None if never published, empty if retired."""
        doc: bytes | None = self.meta.get_document(store_index_key(version, writer))
        return doc

    def publish_store_version(self, version: int, *, num_writers: int) -> None:
        """This store writer completed ``version``."""
        self.meta.publish_version(version, STORE_FINGERPRINT, writer_rank=self.rank, num_writers=num_writers)

    def latest_store_version(self) -> int | None:
        info = self.meta.latest_version()
        return info.version if info is not None else None

    def wait_store_version(self, *, after: int, deadline: Deadline) -> int | None:
        info = self.meta.wait_version(after=after, timeout=deadline.remaining(0.0))
        return info.version if info is not None else None
