"""Shared-memory transport for co-located engines: POSIX shared memory, CUDA IPC on GPU.

Each writer exposes the pieces it must provide (:mod:`weightsync.transport.exposed`) in a
segment with ``slots`` version slots. ``send(V)`` copies its pieces into slot ``V % slots``
(the one writer-side copy); ``receive(V)`` copies each of the reader's ops straight from
the writer's slot into the destination view (the one reader-side copy, and the only one
per byte on the receiving side). Writers never wait for readers in this (snapshot) mode:
the orchestrator (``WeightWriter``) keeps writers at most ``slots - 1`` versions ahead of
the slowest reader, and training may change its weights as soon as ``send`` returns.

Each slot carries a sequence word (the version it holds, -1 while being written). A
reader checks it before and after copying, so a version overwritten mid-read is detected
and reported, never silently applied.

**Streaming (CPU, x86-64).** A reader does not wait for a writer to finish the whole slot:
the writer also records which version it is writing into the slot and how many bytes of
it are packed (pieces are packed in offset order), and a reader copies each of its ops as
soon as the writer's progress has passed that op's bytes. Packing and reading overlap, so
a sync costs about one copy instead of two back to back. x86-64 keeps stores in program
order, so a reader that sees the progress word also sees the bytes before it; on other
CPUs, and for CUDA slots (whose copies are asynchronous), readers wait for the finished
slot as before. The final sequence-word check still guards every version.

**Zero-copy sources (CPU).** When every tensor a writer sends from already lives in a
``/dev/shm`` file (a trainer that allocated its parameters with
:func:`~weightsync.transport.shm_files.share_tensors`), the writer packs nothing: its
segment names those files, readers map them and copy each op straight from the trainer's
parameter memory into the engine's, one copy per byte in all. There is no snapshot then,
so ``send(V)`` holds the version until every reader with ops from this writer has copied
it (each reader writes a done word into the writer's control page) or the timeout
expires; training changes its weights only after that.

The segment lives in ``/dev/shm`` (mapped with ``torch.from_file(shared=True)``, so no
Python buffer bookkeeping), is named by :mod:`weightsync.transport.shm_files` (the
writer's pid and a random token; the path is published through the meta server), and is
unlinked by its writer on ``close()`` or, if it died, by the next writer's sweep. On GPU
the slots are one CUDA allocation shared by IPC handle (published, msgpack-encoded), and
only the small control page stays in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import torch

from weightsync.transport.base import PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.exposed import ExposedIndex
from weightsync.transport.shm_files import SHM_DIR, segment_name, sweep_stale_segments
from weightsync.transport.tensors import DTYPE_NAMES, TORCH_DTYPES, flat_views

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp

logger = logging.getLogger(__name__)

_MAGIC = 0x5753_4D48_0001  # "WSMH" v1
_CONTROL_BYTES = 4096
_EMPTY = -1
#: Pack progress is published every this many bytes (and at the end of the slot).
_PROGRESS_BYTES = 4 << 20
#: Store order is program order (x86-64 TSO), so progress words may be read without fences.
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
#: Diagnostic switch (A/B benchmarks): WEIGHTSYNC_SHM_STREAMING=0 makes readers wait for whole slots.
_STREAMING = _ORDERED_STORES and os.environ.get("WEIGHTSYNC_SHM_STREAMING", "1") != "0"
#: Zero-copy mode: reader r's done word (the last version it copied) sits at word _DONE_BASE + r.
_DONE_BASE = 64
_MAX_ZERO_COPY_READERS = _CONTROL_BYTES // 8 - _DONE_BASE


def _writing_word(slots: int, slot: int) -> int:
    """Control word: the version being written into ``slot`` (or -1)."""
    return 3 + slots + slot


def _progress_word(slots: int, slot: int) -> int:
    """Control word: bytes of ``slot`` packed so far for the version being written."""
    return 3 + 2 * slots + slot


class SharedMemoryTransport:
    """One-sided shared-memory transport (see module docstring)."""

    name: ClassVar[str] = "shm"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = True
    #: receive(V) waits for V's bytes itself, so writers publish V before packing it.
    receive_waits_for_data: ClassVar[bool] = True

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = torch.device(ctx.options.device)
        self.slots = ctx.options.slots
        self._path: str | None = None  # writer's own segment
        self._control: torch.Tensor | None = None
        self._data: torch.Tensor | None = None
        self._copies_ops: list[tuple[str, TransferOp]] = []
        self._slot_bytes = 0
        self._flats: dict[str, torch.Tensor] = {}
        self._index: ExposedIndex | None = None
        self._zero_copy = False  # writer: readers copy from the trainer's shared parameters
        self._zero_copy_readers: list[int] = []
        self._peers: dict[int, _PeerSegment] = {}
        self._reads: list[tuple[int, TransferOp, int]] = []
        self.generation: int | None = None

    # -- writer ---------------------------------------------------------------------------
    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, generation: int,
                timeout: float) -> None:
        self._flats = flat_views(tensors)
        if self.ctx.role == "writer":
            self._prepare_writer(plan, generation)
        else:
            self._prepare_reader(plan, generation, timeout)
        self.generation = generation

    def _prepare_writer(self, plan: Plan, generation: int) -> None:
        self._release_own()
        sweep_stale_segments()
        index, first_ops = ExposedIndex.for_writer(plan, self.ctx.rank)
        files = self._shared_sources(plan)
        self._zero_copy_readers = sorted({op.dst_rank for op in plan.ops if op.src_rank == self.ctx.rank})
        slot_bytes = 64 if files is not None else max(index.total_bytes, 64)
        path = os.path.join(SHM_DIR, segment_name(f"w{self.ctx.rank}"))
        header: dict[str, Any] = {"index": index.encode(), "slots": self.slots, "slot_bytes": slot_bytes,
                                  "device": self.device.type}
        if files is not None:
            header["files"] = files
        if self.device.type == "cuda":
            data = torch.empty(self.slots * slot_bytes, dtype=torch.uint8, device=self.device)
            header["cuda_ipc"] = list(data.untyped_storage()._share_cuda_())
            control_bytes = _CONTROL_BYTES
        else:
            control_bytes = _CONTROL_BYTES + self.slots * slot_bytes
        meta = msgpack.packb(header)
        control_bytes += -(-len(meta) // _CONTROL_BYTES) * _CONTROL_BYTES
        mem = torch.from_file(path, shared=True, size=control_bytes, dtype=torch.uint8)
        self._path = path
        words = mem[:_CONTROL_BYTES].view(torch.int64)
        words[: 3 + 3 * self.slots].fill_(_EMPTY)
        if files is not None:
            words[_DONE_BASE: _DONE_BASE + self.ctx.num_readers].fill_(_EMPTY)
        words[1], words[2] = len(meta), control_bytes - len(meta)
        mem[control_bytes - len(meta):] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        words[0] = _MAGIC
        self._control = words
        if self.device.type == "cuda":
            self._data = data
        else:
            self._data = mem[_CONTROL_BYTES:_CONTROL_BYTES + self.slots * slot_bytes]
        self._slot_bytes = slot_bytes
        self._copies_ops = first_ops
        self._index = index
        self._zero_copy = files is not None
        self.ctx.meta.put_document(f"transport/shm/{generation}/writer{self.ctx.rank}", path.encode())
        if self._zero_copy:
            logger.info("writer %d exposes its parameters' shared memory (zero-copy) in %s", self.ctx.rank, path)
        else:
            logger.info("writer %d exposes %d bytes x %d slots in %s", self.ctx.rank, index.total_bytes,
                        self.slots, path)

    def _shared_sources(self, plan: Plan) -> dict[str, list[Any]] | None:
        """``{shard: [file, byte offset, dtype, numel]}`` when every shard this writer sends from
        lives in a ``/dev/shm`` file (zero-copy mode), else None."""
        if (self.device.type != "cpu" or self.ctx.num_readers > _MAX_ZERO_COPY_READERS
                or 3 + 3 * self.slots > _DONE_BASE):  # the control page has no room for the done words
            return None
        files: dict[str, list[Any]] = {}
        for op in plan.ops:
            if op.src_rank != self.ctx.rank or op.src_shard in files:
                continue
            flat = self._flats[op.src_shard]
            filename = flat.untyped_storage().filename
            if not filename or not filename.startswith(SHM_DIR + "/"):
                return None
            files[op.src_shard] = [filename, flat.storage_offset() * flat.element_size(),
                                   DTYPE_NAMES[flat.dtype], flat.numel()]
        return files or None

    def send(self, version: int, *, timeout: float) -> TransferStats:
        if self._control is None or self._data is None or self._index is None:
            raise RuntimeError("SharedMemoryTransport.send() before prepare()")
        if self._zero_copy:
            return self._hold_for_readers(version, timeout)
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        slot = version % self.slots
        base = slot * self._slot_bytes
        control = self._control
        streaming = self.device.type == "cpu" and _STREAMING
        control[3 + slot] = _EMPTY  # readers of the old version in this slot will notice
        progress_at = _progress_word(self.slots, slot)
        control[progress_at] = 0
        control[_writing_word(self.slots, slot)] = version if streaming else _EMPTY
        published = 0
        with timer("pack"):
            for key, op in self._copies_ops:
                at, nbytes = self._index.entries[key]
                out = self._data[base + at: base + at + nbytes].view(TORCH_DTYPES[op.dst_dtype])
                src = self._flats[op.src_shard].as_strided(op.box.sizes, op.src_strides,
                                                          self._flats[op.src_shard].storage_offset()
                                                          + op.src_offset)
                out.view(op.box.sizes).copy_(src)
                stats.nbytes += nbytes
                stats.messages += 1
                if streaming and at + nbytes - published >= _PROGRESS_BYTES:
                    published = at + nbytes
                    control[progress_at] = published
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._control[3 + slot] = version
        stats.peak_extra_bytes = self.slots * self._slot_bytes
        return stats

    def _hold_for_readers(self, version: int, timeout: float) -> TransferStats:
        """Zero-copy send: expose the parameters as ``version`` until every reader copied them."""
        assert self._control is not None
        stats = TransferStats(version)
        control = self._control
        deadline = time.monotonic() + timeout
        control[3] = version
        try:
            with PhaseTimer(stats)("wait_readers"):
                waiting = list(self._zero_copy_readers)
                spins = 0
                while waiting:
                    waiting = [r for r in waiting if int(control[_DONE_BASE + r]) < version]
                    if not waiting:
                        break
                    if time.monotonic() > deadline:
                        raise TransportError(
                            f"writer {self.ctx.rank}: readers {waiting} did not copy version {version} from its "
                            f"shared parameters within {timeout:.0f}s")
                    spins += 1
                    time.sleep(0 if spins < 50 else 0.0002)
        finally:
            control[3] = _EMPTY  # the trainer may change its weights from now on
        stats.nbytes = self._index.total_bytes if self._index is not None else 0
        stats.messages = len(self._copies_ops)
        return stats

    # -- reader ---------------------------------------------------------------------------
    def _prepare_reader(self, plan: Plan, generation: int, timeout: float) -> None:
        self._close_peers()
        deadline = time.monotonic() + timeout
        writers = sorted({op.src_rank for op in plan.ops})
        for w in writers:
            doc = self.ctx.meta.get_document(f"transport/shm/{generation}/writer{w}",
                                             wait=max(deadline - time.monotonic(), 0.0))
            if doc is None:
                raise TransportError(f"reader {self.ctx.rank}: writer {w} did not expose its shared memory "
                                     f"for generation {generation} within {timeout:.0f}s")
            self._peers[w] = _PeerSegment.attach(doc.decode(), self.device)
        self._reads = []
        for op in plan.ops:
            at, nbytes = self._peers[op.src_rank].index.locate(op, op.src_rank)
            if nbytes != op.nbytes:
                raise TransportError(f"reader {self.ctx.rank}: writer {op.src_rank} exposes {nbytes} bytes for "
                                     f"{op.canonical} {op.box}, expected {op.nbytes}")
            self._reads.append((op.src_rank, op, at))

    def receive(self, version: int, *, timeout: float) -> TransferStats:
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        deadline = time.monotonic() + timeout
        streaming = self.device.type == "cpu" and _STREAMING
        zero_copy = [w for w, peer in self._peers.items() if peer.files is not None]
        try:
            for w in zero_copy:
                self._wait_exposed(w, version, deadline)
            self._copy_in(stats, timer, streaming=streaming, deadline=deadline)
        finally:  # release zero-copy writers (they hold their weights until every reader is done)
            for w in zero_copy:
                self._peers[w].control[_DONE_BASE + self.ctx.rank] = version
        return stats

    def _copy_in(self, stats: TransferStats, timer: PhaseTimer, *, streaming: bool, deadline: float) -> None:
        version = stats.version
        slot = version % self.slots
        if not streaming:
            for w, peer in self._peers.items():
                if peer.files is None:
                    self._wait_packed(w, version, slot, None, deadline)
        ready = dict.fromkeys(self._peers, -1)  # bytes of each writer's slot known to be packed
        with timer("transfer"):
            for w, op, at in self._reads:
                peer = self._peers[w]
                if peer.files is not None:  # zero-copy: straight from the trainer's parameters
                    flat = self._flats[op.dst_shard]
                    dst = flat.as_strided(op.box.sizes, op.dst_strides, flat.storage_offset() + op.dst_offset)
                    dst.copy_(peer.source_view(op))
                    stats.nbytes += op.nbytes
                    stats.messages += 1
                    continue
                if at + op.nbytes > ready[w]:
                    ready[w] = self._wait_packed(w, version, slot, at + op.nbytes, deadline)
                base = slot * peer.slot_bytes
                data = peer.data[base + at: base + at + op.nbytes].view(TORCH_DTYPES[op.dst_dtype])
                flat = self._flats[op.dst_shard]
                dst = flat.as_strided(op.box.sizes, op.dst_strides, flat.storage_offset() + op.dst_offset)
                dst.copy_(data.view(op.box.sizes))
                stats.nbytes += op.nbytes
                stats.messages += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        for w, peer in self._peers.items():
            if peer.files is not None:
                held = peer.word(3)
                if held != version:
                    raise TransportError(f"reader {self.ctx.rank}: writer {w} stopped exposing version {version} "
                                         "while this reader copied it (it gave up waiting)")
                continue
            if streaming:  # the writer may still be packing pieces other readers need
                self._wait_packed(w, version, slot, None, deadline)
            held = peer.slot_version(slot)
            if held != version:
                raise TransportError(self._stale_message(w, version, held) + " (overwritten while reading)")

    def _wait_exposed(self, writer: int, version: int, deadline: float) -> None:
        """Zero-copy: wait until ``writer`` exposes ``version`` of its parameters."""
        peer = self._peers[writer]
        spins = 0
        while (held := peer.word(3)) != version:
            if held > version:
                raise TransportError(f"reader {self.ctx.rank}: writer {writer} already exposes version {held}, "
                                     f"not {version}")
            if time.monotonic() > deadline:
                raise TransportError(f"reader {self.ctx.rank}: writer {writer} did not expose version {version} "
                                     "of its shared parameters in time")
            spins += 1
            time.sleep(0 if spins < 50 else 0.0002)

    def _wait_packed(self, writer: int, version: int, slot: int, need: int | None, deadline: float) -> int:
        """Wait until writer's ``slot`` holds ``version`` up to byte ``need`` (None: all of it).

        Returns how many bytes are known to be packed (the slot's size once it is complete).
        """
        peer = self._peers[writer]
        spins = 0
        while True:
            held = peer.slot_version(slot)
            if held == version:
                return peer.slot_bytes
            if held > version:
                raise TransportError(self._stale_message(writer, version, held))
            if need is not None and peer.word(_writing_word(peer.slots, slot)) == version:
                packed = peer.word(_progress_word(peer.slots, slot))
                if packed >= need:
                    return packed
            if time.monotonic() > deadline:
                raise TransportError(self._stale_message(writer, version, held))
            spins += 1
            time.sleep(0 if spins < 50 else 0.0002)

    def _stale_message(self, writer: int, version: int, held: int) -> str:
        what = "not yet written" if held in (_EMPTY,) or held < version else f"already replaced by {held}"
        return (f"reader {self.ctx.rank}: version {version} in writer {writer}'s shared memory is {what}; "
                f"readers may fall at most {self.slots - 1} version(s) behind")

    # -- teardown -------------------------------------------------------------------------
    def _release_own(self) -> None:
        self._control = None
        self._data = None
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None

    def _close_peers(self) -> None:
        self._peers.clear()
        self._reads = []

    def close(self) -> None:
        self._release_own()
        self._close_peers()
        self._flats = {}


class _PeerSegment:
    """A reader's mapping of one writer's segment."""

    def __init__(self, control: torch.Tensor, data: torch.Tensor, index: ExposedIndex, slot_bytes: int, *,
                 slots: int, files: dict[str, torch.Tensor] | None = None) -> None:
        self.control = control
        self.data = data
        self.index = index
        self.slot_bytes = slot_bytes
        self.slots = slots
        #: zero-copy writers: shard -> the writer's flat parameter tensor, mapped from its file
        self.files = files

    def source_view(self, op: TransferOp) -> torch.Tensor:
        assert self.files is not None
        flat = self.files[op.src_shard]
        return flat.as_strided(op.box.sizes, op.src_strides, flat.storage_offset() + op.src_offset)

    @staticmethod
    def map_files(files: Mapping[str, list[Any]]) -> dict[str, torch.Tensor]:
        mapped: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for shard, (path, offset, dtype_name, numel) in files.items():
            if path not in mapped:
                try:
                    mapped[path] = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
                except (FileNotFoundError, RuntimeError) as exc:
                    raise TransportError(f"the trainer's shared parameter file {path} is gone: {exc}") from None
            dtype = TORCH_DTYPES.get(dtype_name)
            if dtype is None:
                raise TransportError(f"shared parameter {shard} has unknown dtype {dtype_name!r}")
            nbytes = int(numel) * dtype.itemsize
            out[shard] = mapped[path][int(offset): int(offset) + nbytes].view(dtype)
        return out

    @classmethod
    def attach(cls, path: str, device: torch.device) -> _PeerSegment:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise TransportError(f"shared memory segment {path} is gone (its writer exited)") from None
        mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        words = mem[:_CONTROL_BYTES].view(torch.int64)
        if int(words[0]) != _MAGIC:
            raise TransportError(f"{path} is not a weightsync segment (or is not initialised yet)")
        meta_len, meta_at = int(words[1]), int(words[2])
        header = msgpack.unpackb(mem[meta_at: meta_at + meta_len].numpy().tobytes())
        index = ExposedIndex.decode(header["index"])
        slot_bytes = int(header["slot_bytes"])
        slots = int(header["slots"])
        if header.get("device") == "cuda":
            storage = torch.UntypedStorage._new_shared_cuda(*header["cuda_ipc"])
            data = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        else:
            data = mem[_CONTROL_BYTES:_CONTROL_BYTES + slots * slot_bytes]
        files = cls.map_files(header["files"]) if "files" in header else None
        return cls(words, data, index, slot_bytes, slots=slots, files=files)

    def slot_version(self, slot: int) -> int:
        return int(self.control[3 + slot])

    def word(self, at: int) -> int:
        return int(self.control[at])
