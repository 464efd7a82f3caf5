"""The control page of a shared-memory segment, shared by both modes of the shm transport.

A writer's segment is one ``/dev/shm`` file: a 4 KiB page of int64 control words, then (in
snapshot mode, on CPU) the version slots, then a msgpack header that says which mode the
writer chose and what readers need to map it. Words: ``0`` magic (written last: a segment
without it is not initialised yet; :data:`RETIRED` once the writer replaced it), ``1``/``2``
header length and position, then per mode
(:mod:`weightsync.transport.shm.transport`: sequence, writing and progress words per slot;
:mod:`weightsync.transport.shm.zero_copy`: the exposed word and one done word per reader).
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


def writing_word(slots: int, slot: int) -> int:
    """Control word: the version being written into ``slot`` (or -1)."""
    return 3 + slots + slot


def progress_word(slots: int, slot: int) -> int:
    """Control word: bytes of ``slot`` packed so far for the version being written."""
    return 3 + 2 * slots + slot


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

    def __init__(self, rank: int, header: Mapping[str, Any], data_bytes: int) -> None:
        sweep_stale_segments()
        meta = msgpack.packb(dict(header))
        size = CONTROL_BYTES + data_bytes
        size += -(-len(meta) // CONTROL_BYTES) * CONTROL_BYTES
        self.path: str | None = os.path.join(SHM_DIR, segment_name(f"w{rank}"))
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
