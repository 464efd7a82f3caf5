"""Shared-memory transport for co-located engines: POSIX shared memory, CUDA IPC on GPU.

Each writer exposes the pieces it must provide (:mod:`weightsync.transport.exposed`) in a
segment with ``slots`` version slots (*snapshot mode*). ``send(V)`` copies its pieces into
slot ``V % slots`` (the one writer-side copy); ``receive(V)`` copies each of the reader's
ops straight from the writer's slot into the destination view (the one reader-side copy,
and the only one per byte on the receiving side). Writers never wait for readers in this
mode: the orchestrator (``WeightWriter``) keeps writers at most ``slots - 1`` versions
ahead of the slowest reader, and training may change its weights as soon as ``send``
returns.

Each slot carries a sequence word (the version it holds, -1 while being written). A
reader checks it before and after copying, so a version overwritten mid-read is detected
and reported, never silently applied.

**Streaming (CPU, x86-64; ``TransportOptions.shm_streaming``).** A reader does not wait for
a writer to finish the whole slot: the writer also records which version it is writing
into the slot and how many bytes of it are packed (pieces are packed in offset order), and
a reader copies each of its ops as soon as the writer's progress has passed that op's
bytes. Packing and reading overlap, so a sync costs about one copy instead of two back to
back. x86-64 keeps stores in program order, so a reader that sees the progress word also
sees the bytes before it; on other CPUs, and for CUDA slots (whose copies are
asynchronous), readers wait for the finished slot. The final sequence-word check still
guards every version.

**Zero-copy mode** (a writer whose weights already live in ``/dev/shm``) is its own module,
:mod:`weightsync.transport.shm_zero_copy`; a writer picks it by itself, and a reader
handles each writer's segment by what that segment says it is.

The segment lives in ``/dev/shm`` (mapped with ``torch.from_file(shared=True)``, so no
Python buffer bookkeeping), is named by :mod:`weightsync.transport.shm_files` (the
writer's pid and a random token; the path is the writer's endpoint of the epoch), and is
unlinked by its writer on ``close()`` or, if it died, by the next writer's sweep. On GPU
the slots are one CUDA allocation shared by IPC handle (published, msgpack-encoded), and
only the small control page stays in ``/dev/shm``.
"""

from __future__ import annotations

import logging
import platform
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from weightsync import device_port
from weightsync.deadline import Deadline
from weightsync.device_port import DevicePort, IpcHandle
from weightsync.devices import ipc_attach_device, visible_gpus
from weightsync.torch_layout import TORCH_DTYPES
from weightsync.transport.base import (
    PeerWatch,
    PhaseTimer,
    TransferStats,
    TransportContext,
    TransportError,
    check_phase,
    check_tensors_device,
    peer_endpoint,
    phase_plans,
)
from weightsync.transport.delta_published import (
    ChangeLayout,
    ChangeReader,
    SlotChanges,
    check_delta,
    published_views,
)
from weightsync.transport.endpoints import ShmEndpoint
from weightsync.transport.exposed import ExposedIndex, piece_key
from weightsync.transport.shm_segment import (
    CONTROL_BYTES,
    EMPTY,
    FileGoneError,
    OwnSegment,
    SegmentRetiredError,
    check_live,
    progress_word,
    read_segment,
    seq_word,
    spin_wait,
    writing_word,
)
from weightsync.transport.shm_zero_copy import ZeroCopyPeer, ZeroCopyWriter
from weightsync.transport.tensors import flat_views, op_dst_view, op_src_view

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp

logger = logging.getLogger(__name__)

#: Pack progress is published every this many bytes (and at the end of the slot).
_PROGRESS_BYTES = 4 << 20
#: Store order is program order (x86-64 TSO), so progress words may be read without fences.
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")

#: This process's CUDA IPC version slots, by segment path. CUDA refuses to open a handle in the
#: process that exported it (``cudaIpcOpenMemHandle``: invalid context), so a reader in the
#: writer's process (an in-process trainer and engine, which ``auto`` gives shm) takes the
#: writer's tensor from here, as torch's own reductions do from their cache.
_OWN_SLOTS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def streams(device: torch.device, enabled: bool, dev: DevicePort) -> bool:
    """Readers may copy while the writer packs: host-memory slots on a CPU that keeps store order
    (device memory is written by asynchronous copies: see :class:`SnapshotWriter`)."""
    return enabled and not dev.is_gpu(device) and _ORDERED_STORES


class WriterSide(Protocol):
    """How a writer exposes versions: snapshot slots here, or its live weights (zero-copy)."""

    segment: OwnSegment

    def send(self, version: int, flats: Mapping[str, torch.Tensor], timeout: float, *, phase: int,
             last: bool) -> TransferStats: ...

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

    def source(self, op: TransferOp, at: int, version: int, deadline: Deadline) -> torch.Tensor:
        """The view to copy ``op`` from (once its bytes are there)."""
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


class SharedMemoryTransport:
    """One-sided shared-memory transport (see module docstring)."""

    name: ClassVar[str] = "shm"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = True
    #: receive(V) waits for V's bytes itself, so writers publish V before packing it.
    publishes_before_send: ClassVar[bool] = True
    serves_cpu: ClassVar[bool] = True
    serves_cuda: ClassVar[bool] = True  # CUDA IPC
    carries_deltas: ClassVar[bool] = True  # host memory only (delta_published.check_delta)

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.dev = device_port.current()
        self.device = torch.device(ctx.device)
        self.slots = ctx.options.slots
        self.streaming = streams(self.device, ctx.options.shm_streaming, self.dev)
        self._flats: dict[str, torch.Tensor] = {}
        self._writer: WriterSide | None = None
        self._peers: dict[int, PeerSegment] = {}
        self._paths: dict[int, str] = {}  # each writer's segment the reader maps
        self._parts: list[Plan] = []
        self._reads: list[list[tuple[int, TransferOp, int, int]]] = []  # per phase: (writer, op, offset, row)
        self._phases = 1
        self.epoch: int | None = None
        check_delta(self.name, ctx)
        self._changes = ChangeReader(ctx) if ctx.options.delta_anchor_every and ctx.role == "reader" else None

    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, epoch: int, timeout: float,
                phases: Sequence[Plan] | None = None) -> None:
        check_tensors_device(self, self.ctx, tensors)
        self._flats = flat_views(tensors)
        parts = phase_plans(plan, phases)
        self._phases = len(parts)
        if self.ctx.role == "writer":
            self._prepare_writer(plan, parts, epoch)
        else:
            self._prepare_reader(parts, epoch, Deadline.after(timeout))
        self.epoch = epoch

    # -- writer ---------------------------------------------------------------------------
    @property
    def writer_side(self) -> WriterSide | None:
        """The prepared writer side: :class:`SnapshotWriter` or a zero-copy writer."""
        return self._writer

    def _prepare_writer(self, plan: Plan, parts: list[Plan], epoch: int) -> None:
        # Pieces laid out phase by phase, so "packed up to byte X" also means "phases so far".
        me = self.ctx.rank
        index, first_ops = ExposedIndex.for_ops(op for part in parts for op in part.ops if op.src_rank == me)
        phase_of = {t: i for i, part in enumerate(parts) for t in {op.canonical for op in part.ops}}
        copies = [[(key, op) for key, op in first_ops if phase_of[op.canonical] == i] for i in range(len(parts))]
        # The weights moved to new storage within the epoch (SyncSession.arm): readers stay attached
        # to this segment until the next epoch, so keep it while it serves (snapshot slots are
        # packed from wherever the weights are); else readers of the epoch must move with it.
        if epoch == self.epoch and self._writer is not None:
            if self._writer.serves(index, copies, plan, self._flats):
                return
            self._writer.segment.retire()  # attached readers look up the endpoint published below
        self._release_own()
        writer = ZeroCopyWriter.create(self.ctx, plan, self._flats, index, copies, device=self.device)
        self._writer = writer if writer is not None else SnapshotWriter(self.ctx, index, copies, slots=self.slots,
                                                                         device=self.device,
                                                                         streaming=self.streaming, dev=self.dev)
        path = self._writer.segment.path
        assert path is not None, "a segment has its path until it is closed"
        self.ctx.channel.publish_endpoint(epoch, ShmEndpoint(path))

    def send(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        if self._writer is None:
            raise RuntimeError("SharedMemoryTransport.send() before prepare()")
        check_phase(phase, self._phases, self.ctx.who)
        return self._writer.send(version, self._flats, timeout, phase=phase, last=phase == self._phases - 1)

    # -- reader ---------------------------------------------------------------------------
    def _prepare_reader(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        self._close_peers()
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
        self._peers[w] = attach(path, w, self.ctx, self.device, self.streaming, dev=self.dev)
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
                assert self.epoch is not None, "a reader receives once prepared"
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

    def receive(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        check_phase(phase, self._phases, self.ctx.who)
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        deadline = Deadline.after(timeout)
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
                    source = self._peers[w].source(op, at, version, deadline)
                    if w in taking:
                        assert self._changes is not None
                        stats.nbytes += self._changes.take(op, self._peers[w].changes(version), version=version,
                                                           row=row, source=source, flats=self._flats,
                                                           taking=taking[w], writer=w)
                    else:
                        self.dev.copy(op_dst_view(self._flats, op), source)
                        stats.nbytes += op.nbytes
                    stats.messages += 1
                # the sequence words are checked after the copies: they must have read the slot by then
                self.dev.synchronize(self.device)
            for w in involved:
                self._peers[w].finish(version, deadline, last=phase == self._phases - 1)
            done = True
        finally:  # zero-copy writers hold their weights until every reader is done (or gave up)
            if phase == self._phases - 1 or not done:
                for peer in self._peers.values():
                    peer.release(version)
        if self._changes is not None:
            for w, took in taking.items():
                self._changes.received((phase, w), version, took.digests)
            stats.peak_extra_bytes = self._changes.extra_bytes()
        return stats

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
        self._flats = {}
        if self._changes is not None:
            self._changes.close()


class SnapshotWriter:
    """Snapshot mode, writer side: pack every exposed piece into version slot ``V % slots``."""

    def __init__(self, ctx: TransportContext, index: ExposedIndex, copies: list[list[tuple[str, TransferOp]]], *,
                 slots: int, device: torch.device, streaming: bool, dev: DevicePort) -> None:
        slot_bytes = max(index.total_bytes, 64)
        header: dict[str, Any] = {"mode": "snapshot", "index": index.encode(), "slots": slots,
                                  "slot_bytes": slot_bytes, "device": str(device)}
        data: torch.Tensor | None = None
        if dev.is_gpu(device):
            data = device_port.allocate(dev, slots * slot_bytes, device, what=f"{ctx.who}'s CUDA IPC version slots "
                                        f"({slots} x {device_port.gib(slot_bytes)})",
                                        fix="use fewer TransportOptions.slots, or SyncConfig(layer_phases=True) with "
                                            "transport 'torch' (NCCL stages one bucket, not the model)")
            header["ipc"] = dev.share(data).to_wire()
        # the change area lives in host shared memory after the slots (deltas between GPUs are
        # refused when the transport is created)
        changes = ChangeLayout.for_index(index, slots, after=slots * slot_bytes, header=header) \
            if ctx.options.delta_anchor_every and data is None else None
        self.segment = OwnSegment(ctx.rank, header, 0 if data is not None else (
            changes.end if changes is not None else slots * slot_bytes))
        self.segment.words[3: 3 + 3 * slots].fill_(EMPTY)
        self.segment.seal()
        if data is not None:
            assert self.segment.path is not None, "a segment has its path until it is closed"
            _OWN_SLOTS[self.segment.path] = data
        self.data = data if data is not None else self.segment.data
        self.index, self.copies, self.slots, self.slot_bytes = index, copies, slots, slot_bytes
        self.device, self.streaming, self.dev = device, streaming, dev
        # device memory: each phase is published once complete (after a synchronise), so that
        # readers take a phase while the writer is busy elsewhere (the routed transport's
        # other route blocks per phase: waiting for the whole slot would hang the job). The
        # words are plain stores, read in order only where the CPU keeps store order.
        self.phased = data is not None and _ORDERED_STORES
        self.changes = None if changes is None else SlotChanges(
            index, changes, self.segment.data, slot_bytes=slot_bytes, anchor_every=ctx.options.delta_anchor_every)
        logger.info("%s exposes %d bytes x %d slots in %s", ctx.who, index.total_bytes, slots, self.segment.path)

    def serves(self, index: ExposedIndex, copies: list[list[tuple[str, TransferOp]]], plan: Plan,
               flats: Mapping[str, torch.Tensor]) -> bool:
        """The same pieces: they are packed from wherever the weights are at each send."""
        return (index, copies) == (self.index, self.copies)

    def send(self, version: int, flats: Mapping[str, torch.Tensor], timeout: float, *, phase: int,
             last: bool) -> TransferStats:
        """Pack ``phase``'s pieces into the version's slot; the last phase seals it."""
        stats = TransferStats(version)
        slot = version % self.slots
        base = slot * self.slot_bytes
        control = self.segment.words
        progress_at = progress_word(self.slots, slot)
        if phase == 0:
            control[seq_word(slot)] = EMPTY  # readers of the old version in this slot will notice
            control[progress_at] = 0
            if self.changes is not None:  # before readers may look at the slot
                self.changes.begin(version)
            control[writing_word(self.slots, slot)] = version if self.streaming or self.phased else EMPTY
        published = int(control[progress_at])
        with PhaseTimer(stats)("pack"):
            for key, op in self.copies[phase]:
                at, nbytes = self.index.entries[key]
                out = self.data[base + at: base + at + nbytes]
                self.dev.copy(out.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes), op_src_view(flats, op))
                if self.changes is not None:  # against the previous version, in the previous slot
                    self.changes.piece(version, key, op, at)
                stats.nbytes += nbytes
                stats.messages += 1
                if self.streaming and at + nbytes - published >= _PROGRESS_BYTES:
                    published = at + nbytes
                    control[progress_at] = published
            if self.streaming and self.copies[phase]:  # the whole phase is readable now
                key, _ = self.copies[phase][-1]
                control[progress_at] = max(published, sum(self.index.entries[key]))
        if last:
            self.dev.synchronize(self.device)  # the copies above are asynchronous on a GPU
            if self.changes is not None:
                self.changes.end(version)
            self.dev.signal(control, seq_word(slot), version, covers=[self.data[base: base + self.slot_bytes]])
        elif self.phased and self.copies[phase]:
            key, _ = self.copies[phase][-1]
            end = sum(self.index.entries[key])  # a slot is laid out phase after phase
            self.dev.synchronize(self.device)
            self.dev.signal(control, progress_at, end, covers=[self.data[base: base + end]])
        stats.peak_extra_bytes = self.slots * self.slot_bytes
        return stats


class SnapshotPeer:
    """Snapshot mode, reader side: copy from the writer's slot, as far as it is packed."""

    def __init__(self, control: torch.Tensor, data: torch.Tensor, index: ExposedIndex, *, slot_bytes: int,
                 slots: int, writer: int, reader: int, streaming: bool, phased: bool = False,
                 watch: PeerWatch, changes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.control, self.data, self.index = control, data, index
        self.slot_bytes, self.slots = slot_bytes, slots
        self.writer, self.reader, self.streaming, self.watch = writer, reader, streaming, watch
        self.phased = phased  # the writer publishes each completed phase (device memory)
        self._changes = changes  # (tables per slot, areas per slot)
        self._ready = -1  # bytes of the current slot known to be packed

    def begin(self, version: int, deadline: Deadline) -> None:
        # streaming: only until the writer begins the version here (it may have moved: SegmentRetiredError)
        self._ready = self._wait_packed(version, 0 if self.streaming or self.phased else None, deadline)

    def source(self, op: TransferOp, at: int, version: int, deadline: Deadline) -> torch.Tensor:
        if at + op.nbytes > self._ready:
            self._ready = self._wait_packed(version, at + op.nbytes, deadline)
        base = (version % self.slots) * self.slot_bytes
        return self.data[base + at: base + at + op.nbytes].view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes)

    def changes(self, version: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._changes is None:
            return None
        tables, areas = self._changes
        return tables[version % self.slots], areas[version % self.slots]

    def finish(self, version: int, deadline: Deadline, *, last: bool = True) -> None:
        slot = version % self.slots
        if not last and self.word(writing_word(self.slots, slot)) == version:
            return  # copied, and the writer has not begun another version in this slot
        if self.streaming or self.phased:  # the writer may still be packing pieces other readers need
            self._wait_packed(version, None, deadline)
        held = self.word(seq_word(slot))
        if held != version:
            raise TransportError(self._stale_message(version, held) + " (overwritten while reading)")

    def release(self, version: int) -> None:
        pass

    def word(self, at: int) -> int:
        return int(self.control[at])

    def _wait_packed(self, version: int, need: int | None, deadline: Deadline) -> int:
        """Wait until the slot holds ``version`` up to byte ``need`` (None: all of it).

        Returns how many bytes are known to be packed (the slot's size once it is complete).
        """
        slot = version % self.slots
        spins = 0
        while True:
            held = self.word(seq_word(slot))
            if held == version:
                return self.slot_bytes
            if held > version:
                raise TransportError(self._stale_message(version, held))
            if need is not None and self.word(writing_word(self.slots, slot)) == version:
                packed = self.word(progress_word(self.slots, slot))
                if packed >= need:
                    return packed
            check_live(self.control, self.writer, self.reader)  # the writer's weights moved: see SegmentRetiredError
            if deadline.expired:
                raise TransportError(self._stale_message(version, held) + self.watch.describe())
            self.watch.check(f"version {version} in writer {self.writer}'s shared memory")
            spins = spin_wait(spins)

    def _stale_message(self, version: int, held: int) -> str:
        if held == EMPTY or held < version:  # the writer is late (or dead), not this reader
            return (f"reader {self.reader}: writer {self.writer} did not finish writing version {version} into its "
                    "shared memory in time")
        return (f"reader {self.reader}: version {version} in writer {self.writer}'s shared memory was already "
                f"replaced by {held}; readers may fall at most {self.slots - 1} version(s) behind")


def gone_why(ctx: TransportContext, writer: int) -> str:
    """What a missing file of ``writer``'s says, by its lease: it exited, or someone else removed it."""
    dead = PeerWatch(ctx, "writer", [writer]).dead()
    if dead:
        return f" (writer {writer} exited: {dead[writer]})"
    return (f" while writer {writer} is alive (its lease is held): another process removed it (a cleanup of "
            "/dev/shm, or a sweep that judges liveness by pid, from another pid namespace)")


def attach(path: str, writer: int, ctx: TransportContext, device: torch.device, streaming: bool, *,
           dev: DevicePort) -> PeerSegment:
    """Map writer ``writer``'s segment and return the peer of the mode it was written in."""
    try:
        mem, words, header = read_segment(path, writer)
        index = ExposedIndex.decode(header["index"])
        if header.get("mode") == "zero_copy":
            views = published_views(header, mem[CONTROL_BYTES:], writer=writer)
            changes = None if views is None else (views[0][0], views[1][0])
            return ZeroCopyPeer(words, index, header["files"], writer=writer, reader=ctx.rank,
                                watch=PeerWatch(ctx, "writer", [writer]), changes=changes)
    except FileGoneError as exc:
        raise TransportError(f"{ctx.who}: {exc}{gone_why(ctx, writer)}") from None
    slot_bytes, slots = int(header["slot_bytes"]), int(header["slots"])
    ipc = header.get("ipc")
    if ipc is not None:
        handle = IpcHandle.from_wire(ipc)
        if handle.process == dev.process():  # our own export: never opened here (see _OWN_SLOTS)
            own = _OWN_SLOTS.get(path)
            if own is None:
                raise TransportError(f"reader {ctx.rank}: writer {writer}'s CUDA IPC slots in {path} were exported "
                                     "by this process and are already released (the writer closed)")
            data = own
        else:
            home = ipc_home(handle)
            # the first open on the writer's GPU creates this process's CUDA context there
            device_port.check_fits(
                dev, dev.context_bytes(home), home,
                what=f"reader {ctx.rank}'s CUDA context on writer {writer}'s GPU (CUDA IPC maps its slots there)",
                fix="leave it free on the trainer's GPU (fewer TransportOptions.slots, a smaller max_bucket_bytes), "
                    "run the engine on the trainer's GPU, or use transport='torch' between GPUs")
            data = dev.open(handle, home)
    else:
        data = mem[CONTROL_BYTES:CONTROL_BYTES + slots * slot_bytes]
    changes = published_views(header, mem[CONTROL_BYTES:], writer=writer)
    return SnapshotPeer(words, data, index, slot_bytes=slot_bytes, slots=slots, writer=writer, reader=ctx.rank,
                        streaming=streaming and ipc is None, phased=ipc is not None and _ORDERED_STORES,
                        watch=PeerWatch(ctx, "writer", [writer]), changes=changes)


def ipc_home(handle: IpcHandle) -> str:
    """The local device a writer's CUDA IPC slots are mapped on: the writer's GPU, as this process
    numbers it (:func:`weightsync.devices.ipc_attach_device`)."""
    if not handle.device.startswith("cuda"):
        return handle.device  # the device model's "GPU" memory
    return ipc_attach_device(handle.device, handle.gpu, visible_gpus())
