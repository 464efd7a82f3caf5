"""Shared-memory transport for co-located engines: POSIX shared memory, CUDA IPC on GPU.

Each writer exposes the pieces it must provide (:mod:`weightsync.transport.exposed`) in a
segment with ``slots`` version slots. ``send(V)`` copies its pieces into slot ``V % slots``
(the one writer-side copy); ``receive(V)`` copies each of the reader's ops straight from
the writer's slot into the destination view (the one reader-side copy, and the only one
per byte on the receiving side). Readers never wait for writers and writers never wait for
readers inside the transport: the orchestrator (``WeightWriter``) keeps writers at most
``slots - 1`` versions ahead of the slowest reader.

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

The segment lives in ``/dev/shm`` (mapped with ``torch.from_file(shared=True)``, so no
Python buffer bookkeeping), is named with a random token published through the meta
server, and is unlinked by its writer on ``close()``. On GPU the slots are one CUDA
allocation shared by IPC handle (published, msgpack-encoded), and only the small control
page stays in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import torch

from weightsync.transport.base import PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.exposed import ExposedIndex
from weightsync.transport.tensors import TORCH_DTYPES, flat_views

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MAGIC = 0x5753_4D48_0001  # "WSMH" v1
_CONTROL_BYTES = 4096
_EMPTY = -1
#: Pack progress is published every this many bytes (and at the end of the slot).
_PROGRESS_BYTES = 4 << 20
#: Store order is program order (x86-64 TSO), so progress words may be read without fences.
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
#: Diagnostic switch (A/B benchmarks): WEIGHTSYNC_SHM_STREAMING=0 makes readers wait for whole slots.
_STREAMING = _ORDERED_STORES and os.environ.get("WEIGHTSYNC_SHM_STREAMING", "1") != "0"


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
        slot_bytes = max(index.total_bytes, 64)
        token = secrets.token_hex(6)
        path = os.path.join(SHM_DIR, f"weightsync-{os.getpid()}-{token}-w{self.ctx.rank}")
        header: dict[str, Any] = {"index": index.encode(), "slots": self.slots, "slot_bytes": slot_bytes,
                                  "device": self.device.type}
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
        self.ctx.meta.put_document(f"transport/shm/{generation}/writer{self.ctx.rank}", path.encode())
        logger.info("writer %d exposes %d bytes x %d slots in %s", self.ctx.rank, index.total_bytes,
                    self.slots, path)

    def send(self, version: int, *, timeout: float) -> TransferStats:
        if self._control is None or self._data is None or self._index is None:
            raise RuntimeError("SharedMemoryTransport.send() before prepare()")
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
        slot = version % self.slots
        deadline = time.monotonic() + timeout
        streaming = self.device.type == "cpu" and _STREAMING
        if not streaming:
            for w in self._peers:
                self._wait_packed(w, version, slot, None, deadline)
        ready = dict.fromkeys(self._peers, -1)  # bytes of each writer's slot known to be packed
        with timer("transfer"):
            for w, op, at in self._reads:
                peer = self._peers[w]
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
            if streaming:  # the writer may still be packing pieces other readers need
                self._wait_packed(w, version, slot, None, deadline)
            held = peer.slot_version(slot)
            if held != version:
                raise TransportError(self._stale_message(w, version, held) + " (overwritten while reading)")
        return stats

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


def sweep_stale_segments() -> list[str]:
    """Unlink segments whose writer process no longer exists (it was killed, say).

    Segment names carry the creator's pid, so a crash never leaves memory pinned in
    /dev/shm for longer than the next writer start on the machine.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith("weightsync-"):
            continue
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _PeerSegment:
    """A reader's mapping of one writer's segment."""

    def __init__(self, control: torch.Tensor, data: torch.Tensor, index: ExposedIndex, slot_bytes: int,
                 slots: int) -> None:
        self.control = control
        self.data = data
        self.index = index
        self.slot_bytes = slot_bytes
        self.slots = slots

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
        return cls(words, data, index, slot_bytes, slots)

    def slot_version(self, slot: int) -> int:
        return int(self.control[3 + slot])

    def word(self, at: int) -> int:
        return int(self.control[at])
