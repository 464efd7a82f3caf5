"""The control page of a shared-memory segment, shared by both modes of the shm transport.

A writer's segment is one ``/dev/shm`` file: a 4 KiB page of int64 control words, then (in
snapshot mode, on CPU) the version slots, then a msgpack header that says which mode the
writer chose and what readers need to map it. Words: ``0`` magic (written last: a segment
without it is not initialised yet; :data:`RETIRED` once the writer replaced it), ``1``/``2``
header length and position, then per mode
(:mod:`weightsync.transport.shm.snapshot`: a sequence word and a progress word per slot;
:mod:`weightsync.transport.shm.zero_copy`: the exposed word and one done word per reader).

**Memory order.** Readers and the writer share these words without fences (Python has
none), and weakly ordered CPUs (aarch64: GH200, GB200) may make two stores visible in
either order. So whatever a reader must see *together* lives in *one* aligned 64-bit word,
which every CPU stores and loads whole: a slot's progress word holds the version being
written and how many of its bytes are packed (:func:`pack_progress`), never two words that
could be seen half old and half new.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Mapping
from typing import Any

import msgpack
import torch

from weightsync.transport.base import TransportError
from weightsync.transport.shm.files import (
    SHM_DIR,
    create_shared,
    remove_shared,
    segment_name,
    sweep_stale_segments,
)

MAGIC = 0x5753_4D48_0001  # "WSMH" v1
#: Word 0 of a segment its writer replaced within an epoch (its weights moved to new storage).
RETIRED = 0x5753_4D48_DEAD
CONTROL_BYTES = 4096
EMPTY = -1


def seq_word(slot: int) -> int:
    """Control word: the version ``slot`` holds (-1 while it is being written)."""
    return 3 + slot


def progress_word(slots: int, slot: int) -> int:
    """Control word: the version being written into ``slot`` and its bytes packed so far, in one
    word (:func:`pack_progress`; -1 before any)."""
    return 3 + slots + slot


#: Low bits of a progress word: bytes packed (a slot holds at most 1 TiB); high bits: the version.
PROGRESS_BITS = 40
_VERSION_MASK = (1 << (63 - PROGRESS_BITS)) - 1  # 23 bits: the word stays a non-negative int64
MAX_SLOT_BYTES = (1 << PROGRESS_BITS) - 1


def pack_progress(version: int, nbytes: int) -> int:
    """One word saying "``nbytes`` of ``version`` are packed": the version modulo 2**23 (readers
    compare it with the version they wait for, never more than ``slots - 1`` behind), the bytes
    below. Written and read whole, so no reader sees one half of it new and the other old."""
    if not 0 <= nbytes <= MAX_SLOT_BYTES:
        raise ValueError(f"a shared-memory slot holds at most {MAX_SLOT_BYTES} bytes, got {nbytes}")
    return ((version & _VERSION_MASK) << PROGRESS_BITS) | nbytes


def packed_bytes(word: int, version: int) -> int | None:
    """Bytes of ``version`` a progress word says are packed; None if it is about another version
    (or none: -1)."""
    if word < 0 or word >> PROGRESS_BITS != version & _VERSION_MASK:
        return None
    return word & MAX_SLOT_BYTES


def spin_wait(spins: int) -> int:
    """Yield the CPU while waiting on a control word: spin briefly, then sleep 0.2 ms."""
    time.sleep(0 if spins < 50 else 0.0002)
    return spins + 1


class FileGoneError(TransportError):
    """A writer's file in /dev/shm is gone: the caller says why, from the writer's lease."""


class SegmentRetiredError(TransportError):
    """The writer replaced this segment within the epoch: its successor is the writer's endpoint now."""

    def __init__(self, writer: int, reader: int) -> None:
        super().__init__(f"reader {reader}: writer {writer} replaced its shared memory segment (its weights moved "
                         "to new storage)")
        self.writer = writer


def check_live(words: torch.Tensor, writer: int, reader: int) -> None:
    """Raise :class:`SegmentRetiredError` if writer ``writer`` retired the segment whose control ``words`` these are."""
    if int(words[0]) == RETIRED:
        raise SegmentRetiredError(writer, reader)


class OwnSegment:
    """A writer's segment file: the control page, its header and (CPU) the slot area."""

    def __init__(self, rank: int, header: Mapping[str, Any], data_bytes: int, *, what: str = "") -> None:
        sweep_stale_segments()
        # "pid": the process that made it (the one whose lease its readers watch: segment_maker)
        meta = msgpack.packb({**header, "pid": os.getpid()})
        size = CONTROL_BYTES + data_bytes
        size += -(-len(meta) // CONTROL_BYTES) * CONTROL_BYTES
        self.path: str | None = os.path.join(SHM_DIR, segment_name(what or f"w{rank}"))
        self.mem = create_shared(self.path, size)
        self.words = self.mem[:CONTROL_BYTES].view(torch.int64)
        self.words[1], self.words[2] = len(meta), size - len(meta)
        self.mem[size - len(meta):] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        self.data = self.mem[CONTROL_BYTES:CONTROL_BYTES + data_bytes]
        # A writer never closed (dropped, or alive at interpreter exit) still removes its file:
        # otherwise a 2x-model-size file stays in /dev/shm until the next writer's sweep.
        self._remove = weakref.finalize(self, _remove_file, self.path)

    def seal(self) -> None:
        """Mark the segment initialised: readers attaching from now on trust it."""
        self.words[0] = MAGIC

    def retire(self) -> None:
        """Tell readers still attached that this segment is replaced (see :class:`SegmentRetiredError`);
        their mappings stay valid, so a version they are copying from it completes."""
        self.words[0] = RETIRED

    def unlink(self) -> None:
        if self.path is not None:
            self._remove()
            self.path = None


def _remove_file(path: str) -> None:
    remove_shared(path)


def segment_maker(header: Mapping[str, Any]) -> int | None:
    """The pid of the process that made a segment (None: a segment of a release before it said)."""
    pid = header.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def read_segment(path: str, writer: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Map writer ``writer``'s segment: (whole file, control words, header)."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise FileGoneError(f"shared memory segment {path} of writer {writer} is gone") from None
    mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    words = mem[:CONTROL_BYTES].view(torch.int64)
    if int(words[0]) != MAGIC:
        raise TransportError(f"{path} is not a weightsync segment (or is not initialised yet)")
    meta_len, meta_at = int(words[1]), int(words[2])
    header = msgpack.unpackb(mem[meta_at: meta_at + meta_len].numpy().tobytes())
    if not isinstance(header, dict):
        raise TransportError(f"{path}: malformed segment header")
    return mem, words, header
