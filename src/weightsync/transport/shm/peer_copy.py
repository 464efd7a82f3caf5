"""A reader's copy of the version it applied, in ``/dev/shm``, for readers that join later.

With ``SyncConfig(peer_sources=K)`` the readers at seats ``0..K-1`` keep a copy of their shards
(:class:`HeldCopy`); a reader that holds no version maps those on its host (:func:`map_copy`)
and copies its first version from them instead of from the trainers
(:mod:`weightsync.roles.peer_copies` decides who and what).

One file per serving reader, a segment of the shared-memory transport's kind
(:mod:`weightsync.transport.shm.segment`): the control page (word :data:`HELD_WORD` is the
version the copy holds, -1 while the reader rewrites it), the reader's shards back to back
(64-byte aligned, in its layout: the joining reader plans against that layout, so any layout
can read any other), then a msgpack header mapping each shard to ``[offset, numel, dtype]``.

**A seqlock.** The holder sets the word to -1, copies, then sets the version; a reader reads
the word before it copies and again after (:meth:`MappedCopy.holds`). If it changed, the copy
was rewritten under it (the holder applied the next version) and what the reader took is torn:
it drops it and reads the writers instead. Each word is one aligned 64-bit store, as in the
transport's segments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.tools.torch_layout import dtype_name, torch_dtype
from weightsync.transport.base import TransportError
from weightsync.transport.exposed import ALIGN
from weightsync.transport.shm.segment import CONTROL_BYTES, EMPTY, FileGoneError, OwnSegment, read_segment

#: Control word: the version a held copy holds (-1: none, or being rewritten).
HELD_WORD = 3


def _shard_table(flats: Mapping[str, torch.Tensor]) -> tuple[dict[str, list[int | str]], int]:
    """Each shard's ``[offset, numel, dtype]`` in the data area, and the area's size."""
    table: dict[str, list[int | str]] = {}
    cursor = 0
    for name, flat in flats.items():
        table[name] = [cursor, flat.numel(), dtype_name(flat.dtype)]
        cursor += -(-flat.numel() * flat.element_size() // ALIGN) * ALIGN
    return table, cursor


class HeldCopy:
    """A serving reader's copy of its shards (see module docstring); the file goes with :meth:`close`."""

    def __init__(self, seat: int, flats: Mapping[str, torch.Tensor]) -> None:
        self.table, self.nbytes = _shard_table(flats)
        self.segment = OwnSegment(seat, {"kind": "peer_copy", "shards": self.table}, max(self.nbytes, ALIGN),
                                  what=f"peer{seat}")
        self.segment.words[HELD_WORD] = EMPTY
        self.segment.seal()

    @property
    def path(self) -> str:
        assert self.segment.path is not None, "a held copy has its file until it is closed"
        return self.segment.path

    def fits(self, flats: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``flats`` are laid out as this copy (an engine whose layout changed needs a new one)."""
        return _shard_table(flats) == (self.table, self.nbytes)

    @property
    def version(self) -> int:
        return int(self.segment.words[HELD_WORD])

    def hold(self, version: int, flats: Mapping[str, torch.Tensor]) -> int:
        """Copy ``flats`` (the reader's shards, holding ``version``) in; returns the bytes copied."""
        words, data = self.segment.words, self.segment.data
        words[HELD_WORD] = EMPTY  # readers copying the previous version find it torn
        for name, flat in flats.items():
            offset, numel, _ = self.table[name]
            assert isinstance(offset, int) and isinstance(numel, int)
            data[offset: offset + numel * flat.element_size()].view(flat.dtype).copy_(flat)  # D2H on a GPU: synchronous
        words[HELD_WORD] = version
        return sum(flat.numel() * flat.element_size() for flat in flats.values())

    def close(self) -> None:
        self.segment.unlink()


@dataclass(frozen=True)
class MappedCopy:
    """A joining reader's mapping of one peer's :class:`HeldCopy`."""

    seat: int
    words: torch.Tensor
    flats: dict[str, torch.Tensor]

    def holds(self) -> int:
        """The version the copy holds now (-1: none, or being rewritten)."""
        return int(self.words[HELD_WORD])


def map_copy(path: str, seat: int) -> MappedCopy:
    """Map reader ``seat``'s copy at ``path``.

    Raises:
        TransportError: the file is gone (the reader left, or a sweep removed it after it died) or
            is not a peer copy.
    """
    try:
        mem, words, header = read_segment(path, seat)
    except FileGoneError:
        raise TransportError(f"reader {seat}'s peer copy {path} is gone (it left, or it died and its file was "
                             "removed)") from None
    shards = header.get("shards")
    if header.get("kind") != "peer_copy" or not isinstance(shards, dict):
        raise TransportError(f"{path} is not a peer copy of reader {seat}'s (its header says {header.get('kind')!r})")
    data = mem[CONTROL_BYTES:]
    flats = {}
    try:
        for name, (offset, numel, dtype) in shards.items():
            kind = torch_dtype(dtype)
            flats[name] = data[offset: offset + numel * kind.itemsize].view(kind)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TransportError(f"reader {seat}'s peer copy {path} has a malformed shard table: {exc}") from None
    return MappedCopy(seat, words, flats)


__all__ = ["HELD_WORD", "HeldCopy", "MappedCopy", "map_copy"]
