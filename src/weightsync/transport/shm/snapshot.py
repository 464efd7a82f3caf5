"""Shared-memory transport, snapshot mode: each version is packed into a slot readers copy from.

Each writer exposes the pieces it must provide (:mod:`weightsync.transport.exposed`) in a
segment with ``slots`` version slots. ``send(V)`` copies its pieces into slot ``V % slots``
(the one writer-side copy); ``receive(V)`` copies each of the reader's ops straight from
the writer's slot into the destination view (the one reader-side copy, and the only one
per byte on the receiving side). Writers never wait for readers in this mode: the
orchestrator (``WeightWriter``) keeps writers at most ``slots - 1`` versions ahead of the
slowest reader, and training may change its weights as soon as ``send`` returns. The
slots are packed from wherever the weights are at each ``send``, so weights that move to
new storage within an epoch keep the writer's segment (see :meth:`SnapshotWriter.serves`).

Each slot carries a sequence word (the version it holds, -1 while being written). A
reader checks it before and after copying, so a version overwritten mid-read is detected
and reported, never silently applied.

Each slot also has a progress word: the version being written into it and how many of its
bytes are packed, in one 64-bit word (:func:`~weightsync.transport.shm.segment.pack_progress`:
two words could be seen half old, half new on a weakly ordered CPU).

**Streaming (host memory on x86-64; ``TransportOptions.shm_streaming``).** A reader does not
wait for a writer to finish the whole slot: pieces are packed in offset order, and a reader
copies each of its ops as soon as the progress word has passed that op's bytes. Packing and
reading overlap, so a sync costs about one copy instead of two back to back. It needs the
writer's byte stores to be visible before its progress store: x86-64 keeps stores in
program order; other CPUs may not, and Python has no fence, so there readers of host slots
wait for the finished slot.

**Phases on GPU (every CPU).** Device memory is written by asynchronous copies; the writer
publishes each completed phase in the progress word after a device synchronise (a CUDA call,
which orders the copies before the store), so readers take a phase while the writer is
busy elsewhere (the routed transport's other route blocks per phase: waiting for the whole
slot would hang the job).

On GPU the slots are one CUDA allocation shared by IPC handle, **one share per reader**:
torch counts a share's consumers in a counter that starts at 1 and that each consumer's free
decrements, and the exporter's block stays allocated while the counter is above 0 (read as
unsigned: below 0 it never frees). So each reader opens its own share once per epoch (a
re-attach in the epoch keeps its mapping), and a reader in the writer's own process, which
cannot open it, releases its share instead. The handles are published msgpack-encoded in the
segment header; only the small control page stays in ``/dev/shm``::

    side = SnapshotWriter(ctx, index, copies, slots=2, device=device, streaming=True, dev=dev, readers=[0, 1])
    side.send(version, flats, deadline, phase=0, last=True)         # writer: pack, seal the slot
    peer = attach_snapshot(path, mem, words, header, index, writer=w, ctx=ctx, streaming=True, dev=dev,
                           mapped={})                               # mapped: kept for the epoch
    peer.begin(version, deadline); peer.source(op, at, version, deadline); peer.finish(version, deadline)
"""

from __future__ import annotations

import logging
import platform
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from weightsync.clock.deadline import Deadline
from weightsync.ports import device as device_port
from weightsync.ports.device import DevicePort, IpcHandle
from weightsync.tools.devices import ipc_attach_device, visible_gpus
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport.base import PeerWatch, PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.delta.published import ChangeLayout, SlotChanges, published_views
from weightsync.transport.shm.segment import (
    CONTROL_BYTES,
    EMPTY,
    MAX_SLOT_BYTES,
    OwnSegment,
    check_live,
    pack_progress,
    packed_bytes,
    progress_word,
    seq_word,
    spin_wait,
)
from weightsync.transport.tensors import op_src_view

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp
    from weightsync.transport.digests import VersionDigests
    from weightsync.transport.exposed import ExposedIndex

logger = logging.getLogger(__name__)

#: Pack progress is published every this many bytes (and at the end of the slot).
_PROGRESS_BYTES = 4 << 20
#: The CPU makes stores visible in program order (x86-64 TSO): host-memory readers may copy bytes
#: a progress word announces without fences (streaming). Device phases do not depend on it.
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")

#: This process's CUDA IPC version slots, by segment path. CUDA refuses to open a handle in the
#: process that exported it (``cudaIpcOpenMemHandle``: invalid context), so a reader in the
#: writer's process (an in-process trainer and engine, which ``auto`` gives shm) takes the
#: writer's tensor from here, as torch's own reductions do from their cache.
_OWN_SLOTS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def host_streams() -> bool:
    """Readers of host-memory slots may copy bytes as the writer announces them (module docstring)."""
    return _ORDERED_STORES


def streams(device: torch.device, enabled: bool, dev: DevicePort) -> bool:
    """Readers may copy while the writer packs: host-memory slots on a CPU that keeps store order
    (device memory is written by asynchronous copies, and published per phase instead)."""
    return enabled and not dev.is_gpu(device) and host_streams()


class SnapshotWriter:
    """Snapshot mode, writer side: pack every exposed piece into version slot ``V % slots``."""

    def __init__(self, ctx: TransportContext, index: ExposedIndex, copies: list[list[tuple[str, TransferOp]]], *,
                 slots: int, device: torch.device, streaming: bool, dev: DevicePort, readers: Sequence[int]) -> None:
        slot_bytes = max(index.total_bytes, 64)
        if slot_bytes > MAX_SLOT_BYTES:
            raise ValueError(f"{ctx.who} exposes {slot_bytes} bytes in one shared-memory slot, more than its "
                             f"progress word counts ({MAX_SLOT_BYTES}): use more writers")
        header: dict[str, Any] = {"mode": "snapshot", "index": index.encode(), "slots": slots,
                                  "slot_bytes": slot_bytes, "device": str(device)}
        data: torch.Tensor | None = None
        if dev.is_gpu(device):
            data = device_port.allocate(dev, slots * slot_bytes, device, what=f"{ctx.who}'s CUDA IPC version slots "
                                        f"({slots} x {device_port.gib(slot_bytes)})",
                                        fix="use fewer TransportOptions.slots, or SyncConfig(layer_phases=True) with "
                                            "transport 'torch' (NCCL stages one bucket, not the model)",
                                        shareable=True)
            header["ipc"] = {str(r): dev.share(data).to_wire() for r in readers}  # one share per reader
        # the change area lives in host shared memory after the slots (deltas between GPUs are
        # refused when the transport is created)
        changes = ChangeLayout.for_index(index, slots, after=slots * slot_bytes, header=header) \
            if ctx.options.delta_anchor_every and data is None else None
        self.segment = OwnSegment(ctx.rank, header, 0 if data is not None else (
            changes.end if changes is not None else slots * slot_bytes))
        self.segment.words[3: 3 + 2 * slots].fill_(EMPTY)
        self.segment.seal()
        if data is not None:
            assert self.segment.path is not None, "a segment has its path until it is closed"
            _OWN_SLOTS[self.segment.path] = data
        self.data = data if data is not None else self.segment.data
        self.index, self.copies, self.slots, self.slot_bytes = index, copies, slots, slot_bytes
        self.device, self.streaming, self.dev = device, streaming, dev
        #: with integrity checks fused into the pack (transport/digests.py); set by the transport
        self.digests: VersionDigests | None = None
        # device memory: each phase is published once complete (module docstring)
        self.phased = data is not None
        self.changes = None if changes is None else SlotChanges(
            index, changes, self.segment.data, slot_bytes=slot_bytes, anchor_every=ctx.options.delta_anchor_every)
        logger.info("%s exposes %d bytes x %d slots in %s", ctx.who, index.total_bytes, slots, self.segment.path)

    def serves(self, index: ExposedIndex, copies: list[list[tuple[str, TransferOp]]], plan: Plan,
               flats: Mapping[str, torch.Tensor]) -> bool:
        """The same pieces: they are packed from wherever the weights are at each send."""
        return (index, copies) == (self.index, self.copies)

    def send(self, version: int, flats: Mapping[str, torch.Tensor], deadline: Deadline, *, phase: int,
             last: bool, epoch: int | None = None) -> TransferStats:
        """Pack ``phase``'s pieces into the version's slot; the last phase seals it. (``epoch``: the
        zero-copy writer's, which waits for readers; this one waits for none.)"""
        stats = TransferStats(version)
        slot = version % self.slots
        base = slot * self.slot_bytes
        control = self.segment.words
        progress_at = progress_word(self.slots, slot)
        if phase == 0:
            control[seq_word(slot)] = EMPTY  # readers of the old version in this slot will notice
            if self.changes is not None:  # before readers may look at the slot
                self.changes.begin(version)
            control[progress_at] = pack_progress(version, 0)
        published = packed_bytes(int(control[progress_at]), version) or 0
        with PhaseTimer(stats)("pack"):
            for key, op in self.copies[phase]:
                at, nbytes = self.index.entries[key]
                out = self.data[base + at: base + at + nbytes].view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes)
                if self.digests is None:
                    self.dev.copy(out, op_src_view(flats, op))
                else:  # the piece's digest in the same pass (a digest op: its pair's digests first)
                    self.digests.pack(op, out, op_src_view(flats, op), copy=self.dev.copy)
                if self.changes is not None:  # against the previous version, in the previous slot
                    self.changes.piece(version, key, op, at)
                stats.nbytes += nbytes
                stats.messages += 1
                if self.streaming and at + nbytes - published >= _PROGRESS_BYTES:
                    published = at + nbytes
                    control[progress_at] = pack_progress(version, published)
            if self.streaming and self.copies[phase]:  # the whole phase is readable now
                key, _ = self.copies[phase][-1]
                control[progress_at] = pack_progress(version, max(published, sum(self.index.entries[key])))
        if last:
            self.dev.synchronize(self.device)  # the copies above are asynchronous on a GPU
            if self.changes is not None:
                self.changes.end(version)
            self.dev.signal(control, seq_word(slot), version, covers=[self.data[base: base + self.slot_bytes]])
        elif self.phased and self.copies[phase]:
            key, _ = self.copies[phase][-1]
            end = sum(self.index.entries[key])  # a slot is laid out phase after phase
            self.dev.synchronize(self.device)
            self.dev.signal(control, progress_at, pack_progress(version, end), covers=[self.data[base: base + end]])
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

    def source(self, op: TransferOp, at: int, version: int, deadline: Deadline, *, phase: int = 0) -> torch.Tensor:
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
        if not last and packed_bytes(self.word(progress_word(self.slots, slot)), version) is not None:
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
            if need is not None:
                packed = packed_bytes(self.word(progress_word(self.slots, slot)), version)
                if packed is not None and packed >= need:
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


def attach_snapshot(path: str, mem: torch.Tensor, words: torch.Tensor, header: Mapping[str, Any],
                    index: ExposedIndex, *, writer: int, ctx: TransportContext, streaming: bool,
                    dev: DevicePort, mapped: dict[str, torch.Tensor], watch: PeerWatch | None = None) -> SnapshotPeer:
    """Writer ``writer``'s snapshot segment (``mem``, read by :func:`~weightsync.transport.shm.segment.read_segment`)
    as a reader's peer: its slots in the file, or its CUDA IPC allocation.

    ``mapped`` holds this reader's CUDA IPC mappings by segment path for the epoch: a share is
    taken (opened, or released in the writer's own process) once, and a re-attach to the same
    segment reuses the mapping (another open would count this reader twice: module docstring).
    ``watch``: the liveness of the segment's maker (:func:`~weightsync.transport.shm.transport.maker_watch`).
    """
    slot_bytes, slots = int(header["slot_bytes"]), int(header["slots"])
    shares = header.get("ipc")
    if shares is not None:
        data = mapped.get(path)
        if data is None:
            data = mapped[path] = take_share(path, shares, writer=writer, ctx=ctx, dev=dev)
    else:
        data = mem[CONTROL_BYTES:CONTROL_BYTES + slots * slot_bytes]
    changes = published_views(header, mem[CONTROL_BYTES:], writer=writer)
    return SnapshotPeer(words, data, index, slot_bytes=slot_bytes, slots=slots, writer=writer, reader=ctx.rank,
                        streaming=streaming and shares is None, phased=shares is not None,
                        watch=watch or PeerWatch(ctx, "writer", [writer]), changes=changes)


def take_share(path: str, shares: Mapping[str, Any], *, writer: int, ctx: TransportContext,
               dev: DevicePort) -> torch.Tensor:
    """This reader's share of writer ``writer``'s CUDA IPC slots: opened on the writer's GPU, or,
    in the writer's own process (which CUDA refuses to open it in), taken from :data:`_OWN_SLOTS`
    and released, so that torch's counter of the share still reaches 0."""
    wire = shares.get(str(ctx.rank))
    if wire is None:
        raise TransportError(f"reader {ctx.rank}: writer {writer}'s CUDA IPC slots in {path} carry no share for "
                             f"this reader (the writer shares them with readers {sorted(shares, key=int)}): the "
                             "two disagree on the plan")
    handle = IpcHandle.from_wire(wire)
    if handle.process == dev.process():  # our own export: never opened here (see _OWN_SLOTS)
        own = _OWN_SLOTS.get(path)
        if own is None:
            raise TransportError(f"reader {ctx.rank}: writer {writer}'s CUDA IPC slots in {path} were exported "
                                 "by this process and are already released (the writer closed)")
        dev.release(handle)
        return own
    home = ipc_home(handle)
    # the first open on the writer's GPU creates this process's CUDA context there
    device_port.check_fits(
        dev, dev.context_bytes(home), home,
        what=f"reader {ctx.rank}'s CUDA context on writer {writer}'s GPU (CUDA IPC maps its slots there)",
        fix="leave it free on the trainer's GPU (fewer TransportOptions.slots, a smaller max_bucket_bytes), "
            "run the engine on the trainer's GPU, or use transport='torch' between GPUs")
    return dev.open(handle, home)


def ipc_home(handle: IpcHandle) -> str:
    """The local device a writer's CUDA IPC slots are mapped on: the writer's GPU, as this process
    numbers it (:func:`weightsync.tools.devices.ipc_attach_device`)."""
    if not handle.device.startswith("cuda"):
        return handle.device  # the device model's "GPU" memory
    return ipc_attach_device(handle.device, handle.gpu, visible_gpus())
