"""File transport: safetensors files with canonical names, the baseline and the way across
clusters that share only storage.

``send(V)`` streams every piece a writer must provide (canonical box keys, see
:mod:`weightsync.transport.exposed`) into ``<dir>/v<V>/writer-<rank>.p<phase>.safetensors``
(one file per phase), written
to a temporary name and renamed when complete, so a reader never sees half a file. The file
is written piece by piece through one bounded buffer (no full-model copy in memory), in the
documented safetensors layout. ``receive(V)`` opens each writer's file with
``safetensors.safe_open`` and reads only its own slices (``get_slice``) straight into the
destination views; into GPU tensors, it reads each slice slab by slab into one bounded,
page-locked host buffer and copies from there (as the writer packs through one). Writers keep
the last ``slots`` versions and delete older ones.

**Deltas** (``TransportOptions(delta_anchor_every=K)``, host memory): next to each full
version file the writer writes a change file, the changes of that version from the previous
one (compared with its own previous file; :mod:`weightsync.transport.file.changes`). Never a
chain: a reader that holds the previous version, and vouches for it, reads the change file's
table and only its own pieces' encodings; any other reader (the first version, an anchor, a
reader that missed a version, restarted or whose memory changed) reads the full file.
Change files are written before their full file appears and deleted with it.
``TransferStats.nbytes`` counts the encodings and whole pieces a reader read (tables aside).

The directory is ``TransportOptions.file_dir`` (a shared filesystem for multi-node jobs);
when unset, writer 0 creates a temporary directory and publishes it as its endpoint of the
epoch (``{"directory": path}``) through the job channel.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO, ClassVar

import torch
from safetensors import safe_open

from weightsync.clock.deadline import Deadline
from weightsync.layout.types import itemsize
from weightsync.ports import device as device_port
from weightsync.tools.torch_layout import TORCH_DTYPES, strided_view
from weightsync.transport.base import TransferStats, TransportBase, TransportContext, TransportError
from weightsync.transport.delta.published import ChangeReader, check_delta
from weightsync.transport.endpoint_wait import peer_endpoint
from weightsync.transport.endpoints import FileEndpoint
from weightsync.transport.exposed import ExposedIndex, piece_key
from weightsync.transport.file.changes import FileChangeWriter, changes_path, receive_changes, write_header
from weightsync.transport.schedule import slabs
from weightsync.transport.tensors import flat_views, op_dst_view


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major array of ``sizes`` (how a piece is stored)."""
    return tuple(math.prod(sizes[d + 1:]) for d in range(len(sizes)))


def piece_offsets(pieces: Sequence[tuple[str, TransferOp]], data_at: int) -> dict[str, int]:
    """Where each piece starts in a file whose data starts at ``data_at`` (pieces back to back)."""
    out, cursor = {}, data_at
    for key, op in pieces:
        out[key] = cursor
        cursor += op.nbytes
    return out


if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp
    from weightsync.transport.digests import VersionDigests

logger = logging.getLogger(__name__)

#: safetensors dtype codes.
ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
             "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


class FileTransport(TransportBase):
    """safetensors files on (shared) storage (see module docstring)."""

    name: ClassVar[str] = "file"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = True
    publishes_before_send: ClassVar[bool] = False  # a version is published once its files are complete
    serves_cpu: ClassVar[bool] = True
    serves_cuda: ClassVar[bool] = True  # through a host buffer
    carries_deltas: ClassVar[bool] = True  # a change file next to each version (host memory only)
    #: Integrity digests in the same pass as the writer's pack into its buffer and the reader's copy
    #: out of the file.
    fuses_digests: ClassVar[frozenset[str]] = frozenset({"writer", "reader"})

    def __init__(self, ctx: TransportContext) -> None:
        check_delta(self.name, ctx)
        super().__init__(ctx)
        self.dev = device_port.current()
        self.device = torch.device(ctx.device)
        self.directory: str | None = None
        self._owns_directory = False
        self._flats: dict[str, torch.Tensor] = {}
        self._pieces: list[list[tuple[str, TransferOp]]] = []  # per phase
        self._reads: list[dict[int, list[TransferOp]]] = []  # per phase: writer -> ops
        self._written: list[int] = []
        self._buffer: torch.Tensor | None = None
        self._change_writers: list[FileChangeWriter] = []  # writer, deltas on: per phase
        self._changes = ChangeReader(ctx) if ctx.options.delta_anchor_every and ctx.role == "reader" else None
        self._digests: VersionDigests | None = None

    def use_digests(self, digests: VersionDigests | None) -> bool:
        """Digest while packing and reading (see :attr:`fuses_digests`)."""
        self._digests = digests
        return True

    def _connect(self, epoch: int, deadline: Deadline) -> None:
        """The directory announced for the epoch: a reader follows writer 0 to it."""
        self.directory = self._directory(epoch, deadline)

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        self._flats = flat_views(tensors)
        if self.ctx.role == "writer":
            self._pieces = [ExposedIndex.for_writer(part, self.ctx.rank)[1] for part in parts]
            if self.ctx.options.delta_anchor_every:  # a new plan: the next version is full
                self._change_writers = [FileChangeWriter(pieces, anchor_every=self.ctx.options.delta_anchor_every)
                                        for pieces in self._pieces]
        else:
            self._reads = []
            for part in parts:
                reads: dict[int, list[TransferOp]] = {}
                for op in part.ops:
                    reads.setdefault(op.src_rank, []).append(op)
                self._reads.append(reads)
            if self._changes is not None:
                self._changes.prepared(len(parts))

    def _directory(self, epoch: int, deadline: Deadline) -> str:
        if self.ctx.options.file_dir:
            os.makedirs(self.ctx.options.file_dir, exist_ok=True)
            return self.ctx.options.file_dir
        if self.ctx.role == "writer" and self.ctx.rank == 0:
            if self._owns_directory and self.directory is not None:
                path = self.directory  # the same directory across epochs, announced in each
            else:
                path = tempfile.mkdtemp(prefix="weightsync-file-")
                self._owns_directory = True
            self.ctx.channel.publish_endpoint(epoch, FileEndpoint(path))
            return path
        endpoint = peer_endpoint(self.ctx, FileEndpoint, epoch, "writer", 0, deadline=deadline)
        if endpoint is None:
            raise TransportError(f"{self.ctx.who}: writer 0 did not publish the file transport directory for "
                                 f"epoch {epoch} in time")
        return endpoint.directory

    def _path(self, version: int, writer: int, phase: int) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"v{version}", f"writer-{writer}.p{phase}.safetensors")

    # -- writer ---------------------------------------------------------------------------
    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        self.check_phase(phase)
        pieces = self._pieces[phase]
        changes = self._change_writers[phase] if self._change_writers else None
        stats, timer = self.new_stats(version)
        path = self._path(version, self.ctx.rank, phase)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        entries = {key: (ST_DTYPES[op.dst_dtype], list(op.box.sizes), op.nbytes) for key, op in pieces}
        if self._buffer is None:
            self._buffer = self._host_buffer()
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with timer("write"), open(tmp, "wb") as f:
                data_at = write_header(f, entries, {"weightsync_version": str(version)})
                if changes is not None:
                    changes.begin(version, path, piece_offsets(pieces, data_at))
                for key, op in pieces:
                    if changes is None:
                        self._write_piece(f, op)
                    else:
                        self._write_compared(f, key, op, changes)
                    stats.nbytes += op.nbytes
                    stats.messages += 1
                f.flush()
                os.fsync(f.fileno())
            if changes is not None:  # before the full file appears: a reader of the version finds both
                with timer("changes"):
                    changes.write(changes_path(path), version)
            os.replace(tmp, path)
        except BaseException:
            if changes is not None:
                changes.abandon()
            raise
        if changes is not None:
            changes.end(version)
        if phase == len(self._pieces) - 1:
            self._written.append(version)
            self._prune()
        stats.peak_extra_bytes = self.ctx.options.message_bytes + (0 if changes is None else changes.extra_bytes)
        return stats

    def _write_compared(self, f: BinaryIO, key: str, op: TransferOp, changes: FileChangeWriter) -> None:
        """Write a piece whole (host memory: deltas are refused on a GPU) and publish its change
        from the previous version."""
        new = changes.new[: op.nbytes]
        out = new.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes)
        source = strided_view(self._flats[op.src_shard], op.box.sizes, op.src_strides, op.src_offset)
        if self._digests is None:
            out.copy_(source)
        else:
            self._digests.pack(op, out, source)
        f.write(new.numpy().data)  # type: ignore[attr-defined]
        changes.piece(key, op, new)

    def _host_buffer(self) -> torch.Tensor:
        """The one bounded host buffer every byte goes through; page-locked when the tensors are
        on a GPU, so that copies to and from it are DMA transfers (pageable memory makes CUDA
        stage every copy through a pinned bounce buffer of its own, synchronously)."""
        return self.dev.empty(self.ctx.options.message_bytes, "cpu", what=f"{self.ctx.who}'s file staging buffer",
                              pinned=self.dev.is_gpu(self.device))

    def _write_piece(self, f: object, op: TransferOp) -> None:
        assert self._buffer is not None
        flat = self._flats[op.src_shard]
        for box, src_off, _ in slabs(op, self.ctx.options.message_bytes):
            n = box.numel * itemsize(op.dst_dtype)
            out = self._buffer[:n].view(TORCH_DTYPES[op.dst_dtype]).view(box.sizes)
            if self._digests is None:
                self.dev.copy(out, strided_view(flat, box.sizes, op.src_strides, src_off))
            else:  # digested in the same pass (a digest op: its pair's digests first)
                self._digests.pack(op, out, strided_view(flat, box.sizes, op.src_strides, src_off), copy=self.dev.copy)
            self.dev.synchronize(self.device)  # the CPU writes the buffer out next
            self.dev.touch(self._buffer[:n], write=False)
            f.write(self._buffer[:n].numpy().data)  # type: ignore[attr-defined]

    def _prune(self) -> None:
        while len(self._written) > self.ctx.options.slots:
            old = self._written.pop(0)
            self._unlink(old)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self._path(old, self.ctx.rank, 0)))  # fails while other writers' remain

    def _unlink(self, version: int) -> None:
        """Delete this writer's files of ``version``, change files included."""
        for phase in range(len(self._pieces)):
            path = self._path(version, self.ctx.rank, phase)
            for name in (path, changes_path(path)):
                with contextlib.suppress(OSError):
                    os.unlink(name)

    # -- reader ---------------------------------------------------------------------------
    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        self.check_phase(phase)
        stats, timer = self.new_stats(version)
        timeout = deadline.remaining()  # for the message: what the caller gave this call
        for writer, ops in sorted(self._reads[phase].items()):
            path = self._path(version, writer, phase)
            watch = self.peer_watch("writer", [writer])
            look = time.monotonic()
            while not os.path.exists(path):
                if deadline.expired:
                    raise TransportError(f"reader {self.ctx.rank}: writer {writer}'s file for version {version} "
                                         f"did not appear at {path} within {timeout:.0f}s{watch.describe()}")
                watch.check(f"writer {writer}'s file of version {version}")
                if time.monotonic() >= look:
                    look = time.monotonic() + 0.5
                    self._check_not_past(version, writer, phase, path)
                time.sleep(0.005)
            try:
                with timer("read"):
                    if self._changes is not None:
                        stats.nbytes += self._receive_changes(path, writer, ops, version, phase)
                    else:
                        self._read_whole(path, ops)
                        stats.nbytes += sum(op.nbytes for op in ops)
                stats.messages += len(ops)
            except TransportError:
                raise
            except (OSError, KeyError, RuntimeError, ValueError) as exc:
                raise TransportError(f"reader {self.ctx.rank}: reading version {version} from writer {writer} "
                                     f"({path}) failed: {exc}") from exc
        return stats

    def _check_not_past(self, version: int, writer: int, phase: int, path: str) -> None:
        """Raise if ``writer`` wrote a newer version than ``version`` while its file of ``version`` is
        not there: writers write versions in order and keep only their last ``slots``, so it will
        never appear (a version that failed took a slot, or this reader came late to an old one).
        A restarted reader that took the newest published version as its first waited for it
        until its timeout, and the writers for the reader."""
        assert self.directory is not None
        try:
            names = os.listdir(self.directory)
        except OSError:
            return  # the directory itself is gone: the deadline (or the watch) tells
        newer = sorted((int(n[1:]) for n in names if n[:1] == "v" and n[1:].isdigit() and int(n[1:]) > version),
                       reverse=True)
        for n in newer:
            if os.path.exists(self._path(n, writer, phase)):
                raise TransportError(f"reader {self.ctx.rank}: writer {writer}'s file for version {version} is gone "
                                     f"from {path}: it wrote version {n} since and keeps only its last "
                                     f"{self.ctx.options.slots} versions, so version {version} is superseded here; "
                                     "the next update reads a newer one")

    def _read_whole(self, path: str, ops: list[TransferOp]) -> None:
        """Read ``ops`` from a writer's full file, each straight into its destination view."""
        if self.dev.is_gpu(self.device):
            self._read_staged(path, ops)
            return
        with safe_open(path, framework="pt") as f:
            for op in ops:
                data = f.get_slice(piece_key(op))[tuple(slice(None) for _ in op.box.sizes)]
                if self._digests is None:
                    op_dst_view(self._flats, op).copy_(data.view(op.box.sizes))
                else:  # digested as it lands
                    self._digests.land(op, op_dst_view(self._flats, op), data.view(op.box.sizes))

    def _receive_changes(self, path: str, writer: int, ops: list[TransferOp], version: int, phase: int) -> int:
        """Bring ``ops`` to ``version`` from the writer's change file when this reader holds the
        previous version, else from its full file (:mod:`weightsync.transport.file.changes`)."""
        assert self._changes is not None
        if not os.path.exists(changes_path(path)):
            raise TransportError(f"reader {self.ctx.rank}: writer {writer} publishes no changes next to {path}; set "
                                 "the same TransportOptions.delta_anchor_every on every rank")
        return receive_changes(self._changes, (phase, writer), ops, path=path, version=version, flats=self._flats,
                               read_whole=self._read_whole)

    def _read_staged(self, path: str, ops: list[TransferOp]) -> None:
        """Read ``ops`` from a writer's file into device tensors through the bounded pinned host
        buffer, slab by slab (a piece is stored row-major, so each slab is one byte range)."""
        if self._buffer is None:
            self._buffer = self._host_buffer()
        buffer = self._buffer
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            for op in ops:
                entry = header[piece_key(op)]
                if entry["dtype"] != ST_DTYPES[op.dst_dtype] or tuple(entry["shape"]) != op.box.sizes:
                    raise ValueError(f"{piece_key(op)} is {entry['dtype']} {entry['shape']} in the file, this reader "
                                     f"expects {ST_DTYPES[op.dst_dtype]} {list(op.box.sizes)}")
                start = 8 + size + int(entry["data_offsets"][0])
                dense = row_major_strides(op.box.sizes)
                for box, _, dst_off in slabs(op, self.ctx.options.message_bytes):
                    rel = sum((o - b) * s for o, b, s in zip(box.offsets, op.box.offsets, dense, strict=True))
                    n = box.numel * itemsize(op.dst_dtype)
                    self.dev.touch(buffer[:n], write=True)  # the CPU fills it: the last copy out is done
                    f.seek(start + rel * itemsize(op.dst_dtype))
                    if f.readinto(buffer[:n].numpy()) != n:  # type: ignore[arg-type]  # an ndarray is a buffer
                        raise ValueError(f"{path} ends inside {piece_key(op)}")
                    src = buffer[:n].view(TORCH_DTYPES[op.dst_dtype]).view(box.sizes)
                    self.dev.copy(strided_view(self._flats[op.dst_shard], box.sizes, op.dst_strides, dst_off), src)
                    self.dev.synchronize(self.device)  # the next slab refills the buffer

    def forget_received(self) -> None:
        """The destination may no longer hold what arrived: the next version is read in full."""
        if self._changes is not None:
            self._changes.forget()

    def close(self) -> None:
        if self.ctx.role == "writer" and self.directory is not None:
            for version in self._written:
                self._unlink(version)
            self._written.clear()
            if self._owns_directory:
                shutil.rmtree(self.directory, ignore_errors=True)
        self._flats = {}
        self._buffer = None
        self._change_writers = []
        self.epoch = None
        if self._changes is not None:
            self._changes.close()
