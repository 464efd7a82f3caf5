"""Shared-memory transport, zero-copy mode: readers copy straight from the trainer's weights.

When every tensor a writer sends from already lives in a ``/dev/shm`` file (a trainer that
allocated its parameters with :func:`~weightsync.transport.shm.files.share_tensors`), the
writer packs nothing: its segment (the same control page as snapshot mode, see
:mod:`weightsync.transport.shm.segment`) names those files, readers map them and copy each op
straight from the trainer's parameter memory into the engine's, one copy per byte in all.

There is no snapshot, so ``send(V)`` *holds* the version: it writes ``V`` into the exposed
word, waits until every reader with ops from this writer has copied it (each reader writes
the version into its own *done word* in the writer's control page) or the timeout expires,
and blanks the exposed word; training changes its weights only after that. A reader that
finds the exposed word changed after copying reports the version failed instead of
applying what may be a mix of two versions.

CPU only (CUDA memory is not a file), and only while the control page has room for one
done word per reader.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from weightsync.clock.deadline import Deadline
from weightsync.tools.torch_layout import DTYPE_NAMES, TORCH_DTYPES, strided_view
from weightsync.transport.base import PeerWatch, PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.delta.published import ChangeLayout, ChangeWriter
from weightsync.transport.digests import is_digest_name
from weightsync.transport.endpoint_wait import LOOK_EVERY, check_writers
from weightsync.transport.shm.files import SHM_DIR
from weightsync.transport.shm.segment import (
    CONTROL_BYTES,
    EMPTY,
    FileGoneError,
    OwnSegment,
    check_live,
    seq_word,
    spin_wait,
)
from weightsync.transport.tensors import op_src_view

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp
    from weightsync.transport.digests import VersionDigests
    from weightsync.transport.exposed import ExposedIndex

logger = logging.getLogger(__name__)

#: The exposed word: the version the trainer's weights are held at (-1: none).
EXPOSED_WORD = seq_word(0)
#: The digests word (integrity checks): ``digested(V, p)`` once the writer digested phase p of
#: version V from its exposed weights, while readers copy them.
DIGESTED_WORD = seq_word(1)
#: Reader r's done word (the last version it copied) sits at word DONE_BASE + r.
DONE_BASE = 64
MAX_READERS = CONTROL_BYTES // 8 - DONE_BASE


def digested(version: int, phase: int) -> int:
    """The digests word's value once phase ``phase`` of ``version`` is digested (it only grows)."""
    return (version << 16) | (phase + 1)


def shared_sources(plan: Plan, rank: int, flats: Mapping[str, torch.Tensor]) -> dict[str, list[Any]] | None:
    """``{shard: [file, byte offset, dtype, numel]}`` when every shard writer ``rank`` sends
    from lives in a ``/dev/shm`` file, else None (the writer then uses snapshot slots)."""
    files: dict[str, list[Any]] = {}
    for op in plan.ops:
        if op.src_rank != rank or op.src_shard in files:
            continue
        flat = flats[op.src_shard]
        if flat.device.type != "cpu":
            return None
        filename = flat.untyped_storage().filename
        if not filename or not filename.startswith(SHM_DIR + "/"):
            return None
        files[op.src_shard] = [filename, flat.storage_offset() * flat.element_size(), DTYPE_NAMES[flat.dtype],
                               flat.numel()]
    return files or None


class ZeroCopyWriter:
    """Writer side: expose the live parameters as version V until every reader copied them."""

    def __init__(self, ctx: TransportContext, index: ExposedIndex, files: dict[str, list[Any]],
                 readers: list[int], copies: list[list[tuple[str, TransferOp]]]) -> None:
        header: dict[str, Any] = {"mode": "zero_copy", "index": index.encode(), "files": files, "device": "cpu"}
        layout = ChangeLayout.for_index(index, 1, after=0) if ctx.options.delta_anchor_every else None
        if layout is not None:
            header["changes"] = layout.to_header()
        self.segment = OwnSegment(ctx.rank, header, 0 if layout is None else layout.end)
        words = self.segment.words
        words[3: DONE_BASE].fill_(EMPTY)
        words[DONE_BASE: DONE_BASE + ctx.num_readers].fill_(EMPTY)
        self.segment.seal()
        self.who, self.index, self.readers, self.copies, self.files = ctx.who, index, readers, copies, files
        self.pieces = sum(len(phase) for phase in copies)
        self.ctx = ctx
        #: with integrity checks: digested from the exposed weights while readers copy them
        self.digests: VersionDigests | None = None
        #: with deltas: the book, the table and area readers see, this writer's copy of the last
        #: version (packed, the readers' dtype) and a buffer to pack the new one into
        self.changes: tuple[ChangeWriter, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if layout is not None:
            tables, areas = layout.views(self.segment.data)
            biggest = max((n for _, n in index.entries.values()), default=0)
            self.changes = (ChangeWriter(index, anchor_every=ctx.options.delta_anchor_every), tables[0], areas[0],
                            torch.empty(index.total_bytes, dtype=torch.uint8), torch.empty(biggest, dtype=torch.uint8))
        logger.info("%s exposes its parameters' shared memory (zero-copy) in %s", ctx.who, self.segment.path)

    @classmethod
    def create(cls, ctx: TransportContext, plan: Plan, flats: Mapping[str, torch.Tensor], index: ExposedIndex,
               copies: list[list[tuple[str, TransferOp]]], *, device: torch.device) -> ZeroCopyWriter | None:
        """The zero-copy writer side when this writer qualifies (see module docstring), else None."""
        if device.type != "cpu" or ctx.num_readers > MAX_READERS:
            return None
        files = shared_sources(plan, ctx.rank, flats)
        if files is None:
            return None
        readers = sorted({op.dst_rank for op in plan.ops if op.src_rank == ctx.rank})
        return cls(ctx, index, files, readers, copies)

    def serves(self, index: ExposedIndex, copies: list[list[tuple[str, TransferOp]]], plan: Plan,
               flats: Mapping[str, torch.Tensor]) -> bool:
        """Whether readers may go on mapping this segment's files for ``flats`` (the weights did not
        move, or moved within the same files at the same offsets)."""
        return (index, copies) == (self.index, self.copies) and shared_sources(plan, self.ctx.rank, flats) == self.files

    def send(self, version: int, flats: Mapping[str, torch.Tensor], deadline: Deadline, *, phase: int,
             last: bool, epoch: int | None = None) -> TransferStats:
        """Expose the weights as ``version`` (first phase); hold them until readers are done (last).

        Readers come to a version once every writer published it in ``epoch``: while none came,
        the wait stops as soon as another writer is out of the epoch, or (writer 0) writes a newer
        version, naming it, rather than at the deadline (a writer 0 retrying a step its restarted
        peer went past held its weights for the whole timeout). Once a reader copied the version
        it was published, and a writer that went on since (under a quorum, past a slow reader)
        stops nothing here."""
        stats = TransferStats(version)
        control = self.segment.words
        timeout = deadline.remaining()  # for the message: what the caller gave this call
        if phase == 0:
            if self.changes is not None:
                with PhaseTimer(stats)("encode"):
                    self._publish_changes(version, flats)
            control[EXPOSED_WORD] = version
        if self.digests is not None:  # off the readers' path: they copy while this writer digests
            with PhaseTimer(stats)("digest"):
                self.digests.fill(phase, flats)
            control[DIGESTED_WORD] = digested(version, phase)
        if not last:
            return stats  # readers copy phase by phase from the exposed weights
        control[EXPOSED_WORD] = version
        try:
            with PhaseTimer(stats)("wait_readers"):
                waiting = list(self.readers)
                watch = PeerWatch(self.ctx, "reader", waiting)
                spins, look = 0, time.monotonic() + LOOK_EVERY
                while waiting:
                    waiting = [r for r in waiting if int(control[DONE_BASE + r]) < version]
                    if not waiting:
                        break
                    if deadline.expired:
                        raise TransportError(f"{self.who}: readers {waiting} did not copy version {version} from "
                                             f"its shared parameters within {timeout:.0f}s{watch.describe()}")
                    watch.ranks = waiting
                    watch.check(f"readers {waiting} to copy version {version}")
                    if epoch is not None and self.ctx.channel.lease_seconds > 0 and time.monotonic() >= look \
                            and len(waiting) == len(self.readers):  # no reader came: was it ever published?
                        look = time.monotonic() + LOOK_EVERY
                        check_writers(self.ctx, epoch, f"readers {waiting} to copy version {version}")
                    spins = spin_wait(spins)
        finally:
            control[EXPOSED_WORD] = EMPTY  # the trainer may change its weights from now on
        stats.nbytes = self.index.total_bytes
        stats.messages = self.pieces
        if self.changes is not None:
            stats.peak_extra_bytes = sum(int(t.numel()) for t in self.changes[3:]) + self.segment.data.numel()
        return stats

    def _publish_changes(self, version: int, flats: Mapping[str, torch.Tensor]) -> None:
        """Every piece of ``version`` against this writer's copy of the last one, before it is
        exposed (readers apply changes from the table while the weights stay as they are)."""
        assert self.changes is not None
        book, table, area, previous, scratch = self.changes
        book.begin(version, table, area)
        for key, op in (item for phase in self.copies for item in phase):
            at, nbytes = self.index.entries[key]
            new = scratch[:nbytes]
            new.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes).copy_(op_src_view(flats, op))
            book.piece(key, op, new, previous[at: at + nbytes], table=table, area=area, update_old=True)
        book.end(version)


class ZeroCopyPeer:
    """Reader side: the writer's parameter files, mapped; copies come straight from them."""

    def __init__(self, control: torch.Tensor, index: ExposedIndex, files: Mapping[str, list[Any]], *,
                 writer: int, reader: int, watch: PeerWatch,
                 changes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.control, self.index = control, index
        self.writer, self.reader, self.watch = writer, reader, watch
        self.files = map_files(files)
        self._changes = changes  # (the table, the area), published before each version is exposed

    def changes(self, version: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._changes

    def begin(self, version: int, deadline: Deadline) -> None:
        """Wait until the writer exposes ``version`` of its shared parameters.

        A writer exposes versions in order, so the wait stops, naming it, once the writer's live
        process writes a newer one (it gave ``version`` up, superseded, before this reader came:
        a restarted reader that took it waited until its timeout, and the writers for it in the
        next version)."""
        spins, look = 0, time.monotonic() + LOOK_EVERY
        channel = self.watch.ctx.channel
        while (held := int(self.control[EXPOSED_WORD])) != version:
            if held > version:
                raise TransportError(f"reader {self.reader}: writer {self.writer} already exposes version {held}, "
                                     f"not {version}")
            check_live(self.control, self.writer, self.reader)  # the writer's weights moved: see SegmentRetiredError
            if deadline.expired:
                raise TransportError(f"reader {self.reader}: writer {self.writer} did not expose version {version} "
                                     f"of its shared parameters in time{self.watch.describe()}")
            self.watch.check(f"writer {self.writer} to expose version {version}")
            if time.monotonic() >= look:
                look = time.monotonic() + LOOK_EVERY
                writes = channel.writer_writes(self.writer)
                if writes is not None and writes > version and int(self.control[EXPOSED_WORD]) != version:
                    raise TransportError(f"reader {self.reader}: writer {self.writer} writes version {writes} now, so "
                                         f"it will not expose version {version} again (it gave it up, superseded, "
                                         "before this reader came); the next update reads a newer one")
            spins = spin_wait(spins)

    def source(self, op: TransferOp, at: int, version: int, deadline: Deadline, *, phase: int = 0) -> torch.Tensor:
        if is_digest_name(op.canonical):  # the writer digests its weights while this reader copies them
            self._wait_digests(version, phase, deadline)
        return strided_view(self.files[op.src_shard], op.box.sizes, op.src_strides, op.src_offset)

    def _wait_digests(self, version: int, phase: int, deadline: Deadline) -> None:
        spins = 0
        while int(self.control[DIGESTED_WORD]) < digested(version, phase):
            if int(self.control[EXPOSED_WORD]) != version:
                raise TransportError(f"reader {self.reader}: writer {self.writer} stopped exposing version {version} "
                                     "before it digested it")
            if deadline.expired:
                raise TransportError(f"reader {self.reader}: writer {self.writer} did not digest version {version} "
                                     f"in time{self.watch.describe()}")
            self.watch.check(f"writer {self.writer} to digest version {version}")
            spins = spin_wait(spins)

    def finish(self, version: int, deadline: Deadline, *, last: bool = True) -> None:
        if int(self.control[EXPOSED_WORD]) != version:
            raise TransportError(f"reader {self.reader}: writer {self.writer} stopped exposing version {version} "
                                 "while this reader copied it (it gave up waiting)")

    def release(self, version: int) -> None:
        self.control[DONE_BASE + self.reader] = version


def map_files(files: Mapping[str, list[Any]]) -> dict[str, torch.Tensor]:
    """Shard -> the writer's flat parameter tensor, mapped from its ``/dev/shm`` file."""
    mapped: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for shard, (path, offset, dtype_name, numel) in files.items():
        if path not in mapped:
            try:
                mapped[path] = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
            except (FileNotFoundError, RuntimeError) as exc:
                raise FileGoneError(f"the trainer's shared parameter file {path} is gone ({exc})") from None
        dtype = TORCH_DTYPES.get(dtype_name)
        if dtype is None:
            raise TransportError(f"shared parameter {shard} has unknown dtype {dtype_name!r}")
        nbytes = int(numel) * dtype.itemsize
        out[shard] = mapped[path][int(offset): int(offset) + nbytes].view(dtype)
    return out
