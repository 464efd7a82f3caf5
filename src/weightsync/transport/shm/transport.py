"""Shared-memory transport for co-located engines: POSIX shared memory, CUDA IPC on GPU.

Each writer exposes the pieces it must provide (:mod:`weightsync.transport.exposed`) in a
*segment* of its own, in one of two modes it picks by itself; a reader handles each writer's
segment by what that segment says it is:

- **snapshot mode** (:mod:`weightsync.transport.shm.snapshot`): ``send(V)`` packs the pieces
  into version slot ``V % slots``, readers copy from the slot (streaming while it is packed);
- **zero-copy mode** (:mod:`weightsync.transport.shm.zero_copy`): the writer's weights already
  live in ``/dev/shm``, readers copy straight from them while the writer holds the version.

The segment lives in ``/dev/shm`` (mapped with ``torch.from_file(shared=True)``, so no
Python buffer bookkeeping; its control page: :mod:`weightsync.transport.shm.segment`), is
named by :mod:`weightsync.transport.shm.files` (the writer's pid and a random token; the
path is the writer's endpoint of the epoch), and is unlinked by its writer on ``close()``
or, if it died, by the next writer's sweep.

**Weights that move within an epoch.** ``SyncSession.arm`` binds a writer again, without
connecting it, when its weights' storage changed (``param.data = t``, an optimizer swapping buffers), but readers
attach to a writer's segment once per epoch. So a writer keeps its segment while it still
serves (snapshot slots always do: they are packed from wherever the weights are); a
zero-copy writer whose files changed *retires* its segment (word 0) and publishes a new one
for the same epoch, and a reader waiting on a retired segment maps the new one before it
copies anything of the version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from weightsync.clock.deadline import Deadline
from weightsync.ports import device as device_port
from weightsync.ports.device import DevicePort
from weightsync.transport.base import (
    PeerWatch,
    TransferStats,
    TransportBase,
    TransportContext,
    TransportError,
)
from weightsync.transport.delta.published import ChangeReader, check_delta, published_views
from weightsync.transport.endpoint_wait import peer_endpoint
from weightsync.transport.endpoints import ShmEndpoint
from weightsync.transport.exposed import ExposedIndex, piece_key
from weightsync.transport.shm.segment import (
    CONTROL_BYTES,
    FileGoneError,
    OwnSegment,
    SegmentRetiredError,
    read_segment,
    segment_maker,
)
from weightsync.transport.shm.snapshot import SnapshotWriter, attach_snapshot, streams
from weightsync.transport.shm.zero_copy import ZeroCopyPeer, ZeroCopyWriter
from weightsync.transport.tensors import flat_views, op_dst_view

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp
    from weightsync.transport.digests import VersionDigests

logger = logging.getLogger(__name__)


class WriterSide(Protocol):
    """How a writer exposes versions: snapshot slots (shm_snapshot), or its live weights (zero-copy)."""

    segment: OwnSegment
    digests: VersionDigests | None  # integrity checks, fused (transport/digests.py)

    def send(self, version: int, flats: Mapping[str, torch.Tensor], deadline: Deadline, *, phase: int,
             last: bool, epoch: int | None = None) -> TransferStats: ...

    def serves(self, index: ExposedIndex, copies: list[list[tuple[str, TransferOp]]], plan: Plan,
               flats: Mapping[str, torch.Tensor]) -> bool:
        """Whether this side may go on exposing ``index`` for weights now in ``flats`` (readers
        attached to its segment need not move)."""
        ...


class PeerSegment(Protocol):
    """A reader's mapping of one writer's segment, of whichever mode the writer chose."""

    index: ExposedIndex

    def begin(self, version: int, deadline: Deadline) -> None:
        """Before copying ``version`` (wait until the writer exposes it, if it must)."""

    def source(self, op: TransferOp, at: int, version: int, deadline: Deadline, *, phase: int = 0) -> torch.Tensor:
        """The view to copy ``op`` (of ``phase``) from, once its bytes are there."""
        ...

    def changes(self, version: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The table and change area published with ``version`` (None: the writer publishes none);
        valid for an op once :meth:`source` returned its view."""
        ...

    def finish(self, version: int, deadline: Deadline, *, last: bool = True) -> None:
        """After copying (``last``: the version's last phase): raise if ``version`` changed under
        the reader."""

    def release(self, version: int) -> None:
        """The reader is done with ``version`` (copied, or gave up)."""


class SharedMemoryTransport(TransportBase):
    """One-sided shared-memory transport (see module docstring)."""

    name: ClassVar[str] = "shm"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = True
    #: receive(V) waits for V's bytes itself, so writers publish V before packing it.
    publishes_before_send: ClassVar[bool] = True
    serves_cpu: ClassVar[bool] = True
    serves_cuda: ClassVar[bool] = True  # CUDA IPC
    carries_deltas: ClassVar[bool] = True  # host memory only (delta_published.check_delta)
    #: Integrity digests in the same pass as the copies (transport/digests.py): writers while they
    #: pack (snapshot) or while readers copy (zero-copy), readers while they copy.
    fuses_digests: ClassVar[frozenset[str]] = frozenset({"writer", "reader"})

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.dev = device_port.current()
        self.device = torch.device(ctx.device)
        self.slots = ctx.options.slots
        self.streaming = streams(self.device, ctx.options.shm_streaming, self.dev)
        self._flats: dict[str, torch.Tensor] = {}
        self._writer: WriterSide | None = None
        self._peers: dict[int, PeerSegment] = {}
        self._paths: dict[int, str] = {}  # each writer's segment the reader maps
        #: CUDA IPC mappings by segment path, kept for the epoch (shm_snapshot.attach_snapshot)
        self._mapped: dict[str, torch.Tensor] = {}
        self._parts: list[Plan] = []
        self._reads: list[list[tuple[int, TransferOp, int, int]]] = []  # per phase: (writer, op, offset, row)
        check_delta(self.name, ctx)
        self._changes = ChangeReader(ctx) if ctx.options.delta_anchor_every and ctx.role == "reader" else None
        self._digests: VersionDigests | None = None

    def use_digests(self, digests: VersionDigests | None) -> bool:
        """Digest while copying (see :attr:`fuses_digests`); with deltas too (writers still pack or
        expose every piece; readers' changes applied in place are digested by the check)."""
        self._digests = digests
        if self._writer is not None:
            self._writer.digests = digests
        return True

    def _connect(self, epoch: int, deadline: Deadline) -> None:
        """A new epoch: a writer's segment goes (its readers attach to the one it exposes at bind),
        and a reader unmaps the old epoch's segments."""
        self._release_own()
        self._close_peers()
        self._mapped.clear()

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        self._flats = flat_views(tensors)
        assert self.epoch is not None, "bind runs within a connected epoch"
        if self.ctx.role == "writer":
            self._bind_writer(plan, list(parts), self.epoch)
        else:
            self._bind_reader(list(parts), self.epoch, deadline)

    # -- writer ---------------------------------------------------------------------------
    @property
    def writer_side(self) -> WriterSide | None:
        """The bound writer side: :class:`SnapshotWriter` or a zero-copy writer."""
        return self._writer

    def _bind_writer(self, plan: Plan, parts: list[Plan], epoch: int) -> None:
        # Pieces laid out phase by phase, so "packed up to byte X" also means "phases so far".
        me = self.ctx.rank
        index, first_ops = ExposedIndex.for_ops(op for part in parts for op in part.ops if op.src_rank == me)
        phase_of = {t: i for i, part in enumerate(parts) for t in {op.canonical for op in part.ops}}
        copies = [[(key, op) for key, op in first_ops if phase_of[op.canonical] == i] for i in range(len(parts))]
        # A segment still here was exposed in this epoch (connect releases it), and the weights
        # moved to new storage within it (SyncSession.arm binds without connecting): readers stay
        # attached to this segment until the next epoch, so keep it while it serves (snapshot
        # slots are packed from wherever the weights are); else readers must move with it.
        if self._writer is not None:
            if self._writer.serves(index, copies, plan, self._flats):
                return
            self._writer.segment.retire()  # attached readers look up the endpoint published below
        self._release_own()
        writer = ZeroCopyWriter.create(self.ctx, plan, self._flats, index, copies, device=self.device)
        readers = sorted({op.dst_rank for part in parts for op in part.ops if op.src_rank == me})
        self._writer = writer if writer is not None else SnapshotWriter(self.ctx, index, copies, slots=self.slots,
                                                                         device=self.device,
                                                                         streaming=self.streaming, dev=self.dev,
                                                                         readers=readers)
        self._writer.digests = self._digests
        path = self._writer.segment.path
        assert path is not None, "a segment has its path until it is closed"
        self.ctx.channel.publish_endpoint(epoch, ShmEndpoint(path))

    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        if self._writer is None:
            raise RuntimeError("SharedMemoryTransport.send() before bind()")
        self.check_phase(phase)
        return self._writer.send(version, self._flats, deadline, phase=phase, last=phase == self.phase_count - 1,
                                 epoch=self.epoch)

    # -- reader ---------------------------------------------------------------------------
    def _bind_reader(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        self._close_peers()  # its CUDA IPC mappings stay for the epoch (connect drops them)
        writers = sorted({op.src_rank for part in parts for op in part.ops})
        for w in writers:
            endpoint = peer_endpoint(self.ctx, ShmEndpoint, epoch, "writer", w, deadline=deadline)
            if endpoint is None:
                raise TransportError(f"reader {self.ctx.rank}: writer {w} did not expose its shared memory "
                                     f"for epoch {epoch} in time")
            self._attach(w, endpoint.path)
        self._parts = parts
        self._locate_reads()
        if self._changes is not None:
            self._changes.prepared(len(parts))

    def _attach(self, w: int, path: str) -> None:
        self._peers[w] = attach(path, w, self.ctx, self.device, self.streaming, dev=self.dev, mapped=self._mapped,
                                epoch=self.epoch)
        self._paths[w] = path

    def _reattach(self, w: int, epoch: int, deadline: Deadline) -> None:
        """Writer ``w`` retired the segment this reader maps (its weights moved within the epoch):
        map the one it exposes now."""
        old = self._paths[w]
        while (endpoint := peer_endpoint(self.ctx, ShmEndpoint, epoch, "writer", w, deadline=deadline)) is None \
                or endpoint.path == old:
            if deadline.expired:
                raise TransportError(f"reader {self.ctx.rank}: writer {w} replaced its shared memory {old} (its "
                                     f"weights moved to new storage) but exposed no other for epoch {epoch} in time")
            time.sleep(0.005)
        logger.info("reader %d: writer %d's weights moved within epoch %d; now mapping %s", self.ctx.rank, w, epoch,
                    endpoint.path)
        self._attach(w, endpoint.path)
        self._locate_reads()

    def _begin(self, w: int, version: int, deadline: Deadline) -> None:
        """Writer ``w``'s segment is ready for ``version`` (following the writer to a new segment)."""
        while True:
            try:
                return self._peers[w].begin(version, deadline)
            except SegmentRetiredError:
                assert self.epoch is not None, "a reader receives once bound"
                self._reattach(w, self.epoch, deadline)

    def _locate_reads(self) -> None:
        """Each phase's reads: (writer, op, offset in its segment, its row in the writer's table)."""
        self._reads = []
        rows = {w: {key: 1 + i for i, key in enumerate(peer.index.entries)} for w, peer in self._peers.items()}
        for part in self._parts:
            reads = []
            for op in part.ops:
                at, nbytes = self._peers[op.src_rank].index.locate(op, op.src_rank)
                if nbytes != op.nbytes:
                    raise TransportError(f"reader {self.ctx.rank}: writer {op.src_rank} exposes {nbytes} bytes for "
                                         f"{op.canonical} {op.box}, expected {op.nbytes}")
                reads.append((op.src_rank, op, at, rows[op.src_rank][piece_key(op)]))
            self._reads.append(reads)

    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        self.check_phase(phase)
        stats, timer = self.new_stats(version)
        involved = list(dict.fromkeys(w for w, _, _, _ in self._reads[phase]))
        with timer("vouch"):  # per writer: the base this reader vouches for (deltas on)
            taking = {} if self._changes is None else self._changes.begin_writers(
                phase, {w: [op for v, op, _, _ in self._reads[phase] if v == w] for w in involved}, self._flats,
                publishes=lambda w: self._peers[w].changes(0) is not None)
        done = False
        try:
            for w in involved:
                self._begin(w, version, deadline)
            with timer("transfer"):
                for w, op, at, row in self._reads[phase]:  # (located again if a writer moved)
                    source = self._peers[w].source(op, at, version, deadline, phase=phase)
                    if w in taking:
                        assert self._changes is not None
                        stats.nbytes += self._changes.take(op, self._peers[w].changes(version), version=version,
                                                           row=row, source=source, flats=self._flats,
                                                           taking=taking[w], writer=w)
                    elif self._digests is not None:  # digested as it lands, in the same pass
                        self._digests.land(op, op_dst_view(self._flats, op), source, copy=self.dev.copy)
                        stats.nbytes += op.nbytes
                    else:
                        self.dev.copy(op_dst_view(self._flats, op), source)
                        stats.nbytes += op.nbytes
                    stats.messages += 1
                # the sequence words are checked after the copies: they must have read the slot by then
                self.dev.synchronize(self.device)
            for w in involved:
                self._peers[w].finish(version, deadline, last=phase == self.phase_count - 1)
            done = True
        finally:  # zero-copy writers hold their weights until every reader is done (or gave up)
            if phase == self.phase_count - 1 or not done:
                for peer in self._peers.values():
                    peer.release(version)
        if self._changes is not None:
            for w, took in taking.items():
                self._changes.received((phase, w), version, took.digests)
            stats.peak_extra_bytes = self._changes.extra_bytes()
        return stats

    def abandon(self, version: int) -> None:
        """Tell every writer this reader maps that it is done with ``version`` (a zero-copy writer
        holds its weights until then): it gave the version up, maybe before it mapped them all
        (issue 36's probe: a writer dead before it exposed its memory failed the bind, and the
        other writers waited for this reader until their timeout)."""
        for peer in self._peers.values():
            peer.release(version)

    def forget_received(self) -> None:
        if self._changes is not None:
            self._changes.forget()

    # -- teardown -------------------------------------------------------------------------
    def _release_own(self) -> None:
        if self._writer is not None:
            self._writer.segment.unlink()
            self._writer = None

    def _close_peers(self) -> None:
        self._peers.clear()
        self._paths.clear()
        self._reads = []

    def close(self) -> None:
        self._release_own()
        self._close_peers()
        self._mapped.clear()
        self._flats = {}
        self.epoch = None
        if self._changes is not None:
            self._changes.close()


def gone_why(ctx: TransportContext, writer: int, epoch: int | None) -> str:
    """What a missing file of ``writer``'s says, by its lease and the job's epoch: it exited, it
    retired the file for a newer plan than this reader's ``epoch``, or someone else removed it."""
    dead = PeerWatch(ctx, "writer", [writer]).dead()
    if dead:
        return f" (writer {writer} exited: {dead[writer]})"
    if epoch is not None and (now := ctx.channel.current_epoch()) > epoch:
        return (f": writer {writer} retired it, as the job re-planned (epoch {now}, past this reader's {epoch}: a "
                "rank restarted, or a reader joined or left); the version is superseded here, and the next one is "
                "planned anew")
    return (f" while writer {writer} is alive (its lease is held): another process removed it (a cleanup of "
            "/dev/shm, or a sweep that judges liveness by pid, from another pid namespace)")


def attach(path: str, writer: int, ctx: TransportContext, device: torch.device, streaming: bool, *,
           dev: DevicePort, mapped: dict[str, torch.Tensor], epoch: int | None = None) -> PeerSegment:
    """Map writer ``writer``'s segment (exposed for ``epoch``) and return the peer of the mode it was written in."""
    try:
        mem, words, header = read_segment(path, writer)
        index = ExposedIndex.decode(header["index"])
        watch = maker_watch(ctx, writer, path, header)
        if header.get("mode") == "zero_copy":
            views = published_views(header, mem[CONTROL_BYTES:], writer=writer)
            changes = None if views is None else (views[0][0], views[1][0])
            return ZeroCopyPeer(words, index, header["files"], writer=writer, reader=ctx.rank, watch=watch,
                                changes=changes)
    except FileGoneError as exc:
        raise TransportError(f"{ctx.who}: {exc}{gone_why(ctx, writer, epoch)}") from None
    return attach_snapshot(path, mem, words, header, index, writer=writer, ctx=ctx, streaming=streaming, dev=dev,
                           mapped=mapped, watch=watch)


def maker_watch(ctx: TransportContext, writer: int, path: str, header: Mapping[str, Any]) -> PeerWatch:
    """The watch of the process that made writer ``writer``'s segment, not of whoever holds the
    rank now.

    A reader that attaches after the writer rank restarted (a restarted engine taking a version
    its predecessor began, in the epoch the dead writer published it in) would otherwise watch
    the restart's lease, alive, and wait in the dead writer's memory until its timeout, holding
    the live writers' wait for it as long. A segment made by a process that no longer holds the
    rank fails at once, naming both; one made by the holder is watched as that process, so that
    a restart from now on counts as its death.

    Raises:
        TransportError: another process holds the rank now.
    """
    maker = segment_maker(header)
    try:
        holder = ctx.channel.lease_holders(max_age=0.0).get(("writer", writer))
    except Exception as exc:  # the meta server is away: expired leases alone will tell
        logger.debug("%s: cannot read leases: %s", ctx.who, exc)
        holder = None
    if maker is not None and holder is not None and holder.pid != maker:
        raise TransportError(f"{ctx.who}: writer {writer}'s shared memory {path} was made by pid {maker}, which "
                             f"holds the rank no more: a restarted process does (pid {holder.pid} on "
                             f"{holder.host or 'an unnamed host'}), so what that memory holds will not complete; "
                             "the restart writes the next version")
    return PeerWatch(ctx, "writer", [writer], known=None if holder is None else {("writer", writer): holder})
