"""A reader's copy of the version it applied, in ``/dev/shm``, for readers that join later.

With ``SyncConfig(peer_sources=K)`` the readers at seats ``0..K-1`` keep a copy of their shards
(:class:`HeldCopy`); a reader that holds no version maps those on its host (:func:`map_copy`)
and copies its first version from them instead of from the trainers
(:mod:`weightsync.roles.peer_copies` decides who and what).

One file per serving reader, a segment of the shared-memory transport's kind
(:mod:`weightsync.transport.shm.segment`): the control page (word :data:`HELD_WORD` is the
version the copy holds, -1 while the reader rewrites it), the reader's shards back to back
(64-byte aligned, in its layout: the joining reader plans against that layout, so any layout
can read any other), then the version's digest table (with ``integrity=True``: each op the
reader received, where it landed and the digest the writers sent for it; word
:data:`ENTRIES_WORD` counts them), then a msgpack header mapping each shard to ``[offset, numel,
dtype]`` and placing the table.

**A seqlock.** The holder sets the word to -1, copies, then sets the version; a reader reads
the word before it copies and again after (:meth:`MappedCopy.holds`). If it changed, the copy
was rewritten under it (the holder applied the next version) and what the reader took is torn:
it drops it and reads the writers instead. Each word is one aligned 64-bit store, as in the
transport's segments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.ports import device as device_port
from weightsync.tools.codecs.digest import as_signed, as_unsigned
from weightsync.tools.torch_layout import dtype_name, torch_dtype
from weightsync.transport.base import TransportError
from weightsync.transport.exposed import ALIGN
from weightsync.transport.shm.segment import CONTROL_BYTES, EMPTY, FileGoneError, OwnSegment, read_segment

if TYPE_CHECKING:
    from weightsync.plan.ops import TransferOp

#: Control word: the version a held copy holds (-1: none, or being rewritten).
HELD_WORD = 3
#: Control word: how many digest entries the table holds for that version (0: none).
ENTRIES_WORD = 4
#: Most dimensions of a box the table holds (a version with a box of more has no table).
MAX_DIMS = 4
#: int64 words per digest entry: shard index, offset, dimensions, 4 sizes, 4 strides, digest.
ENTRY_WORDS = 3 + 2 * MAX_DIMS + 1


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

    def __init__(self, seat: int, flats: Mapping[str, torch.Tensor], *, entries: int = 0) -> None:
        self.table, self.nbytes = _shard_table(flats)
        self.capacity = entries
        header = {"kind": "peer_copy", "shards": self.table, "entries_at": self.nbytes, "capacity": entries}
        self.segment = OwnSegment(seat, header, max(self.nbytes + 8 * ENTRY_WORDS * entries, ALIGN),
                                  what=f"peer{seat}")
        self.entries = self.segment.data[self.nbytes: self.nbytes + 8 * ENTRY_WORDS * entries].view(
            torch.int64).view(entries, ENTRY_WORDS)
        self.segment.words[HELD_WORD] = EMPTY
        self.segment.words[ENTRIES_WORD] = 0
        self.segment.seal()

    @property
    def path(self) -> str:
        assert self.segment.path is not None, "a held copy has its file until it is closed"
        return self.segment.path

    def fits(self, flats: Mapping[str, torch.Tensor], entries: int = 0) -> bool:
        """Whether ``flats`` are laid out as this copy, with room for ``entries`` digests (an engine
        whose layout changed, or a plan with more ops, needs a new one)."""
        return _shard_table(flats) == (self.table, self.nbytes) and entries <= self.capacity

    @property
    def version(self) -> int:
        return int(self.segment.words[HELD_WORD])

    def hold(self, version: int, flats: Mapping[str, torch.Tensor], entries: torch.Tensor | None = None) -> int:
        """Copy ``flats`` (the reader's shards, holding ``version``) in, and ``entries`` (its digest
        table, :func:`digest_entries`) beside them; returns the bytes copied."""
        words, data = self.segment.words, self.segment.data
        words[HELD_WORD] = EMPTY  # readers copying the previous version find it torn
        words[ENTRIES_WORD] = 0
        if entries is not None:
            self.entries[: len(entries)] = entries
            words[ENTRIES_WORD] = len(entries)
        dev = device_port.current()
        for name, flat in flats.items():
            offset, numel, _ = self.table[name]
            assert isinstance(offset, int) and isinstance(numel, int)
            dev.copy(data[offset: offset + numel * flat.element_size()].view(flat.dtype), flat)  # D2H on a GPU
        for device in {flat.device for flat in flats.values()}:
            dev.synchronize(device)  # every byte is in the file before the word says which version it is
        words[HELD_WORD] = version
        return sum(flat.numel() * flat.element_size() for flat in flats.values())

    def close(self) -> None:
        self.segment.unlink()


def digest_entries(names: list[str], checked: list[tuple[TransferOp, int]]) -> torch.Tensor | None:
    """The digest table of a version (see module docstring) from a reader's checked ops
    (:meth:`~weightsync.transport.digests.VersionDigests.checked`) and its shards' names, in the
    copy's order; None when a box has more than :data:`MAX_DIMS` dimensions."""
    index = {name: i for i, name in enumerate(names)}
    rows = []
    for op, value in checked:
        n = len(op.box.sizes)
        if n > MAX_DIMS:
            return None
        pad = [0] * (MAX_DIMS - n)
        rows.append([index[op.dst_shard], op.dst_offset, n, *op.box.sizes, *pad, *op.dst_strides, *pad,
                     as_signed(value)])
    return torch.tensor(rows, dtype=torch.int64).view(-1, ENTRY_WORDS)


def refill_digests(table: torch.Tensor, checked: list[tuple[TransferOp, int]]) -> torch.Tensor:
    """``table``, built by :func:`digest_entries` for the same ops, with ``checked``'s digests: a
    plan's boxes stay from version to version, only their digests change."""
    table[:, -1] = torch.tensor([as_signed(value) for _, value in checked], dtype=torch.int64)
    return table


@dataclass(frozen=True)
class MappedCopy:
    """A joining reader's mapping of one peer's :class:`HeldCopy`."""

    seat: int
    words: torch.Tensor
    flats: dict[str, torch.Tensor]
    table: torch.Tensor  # (capacity, ENTRY_WORDS) int64

    def holds(self) -> int:
        """The version the copy holds now (-1: none, or being rewritten)."""
        return int(self.words[HELD_WORD])

    def entries(self) -> list[tuple[str, int, tuple[int, ...], tuple[int, ...], int]]:
        """The digest table of the version it holds: (shard, offset, sizes, strides, digest) each."""
        names = list(self.flats)
        out = []
        for row in self.table[: int(self.words[ENTRIES_WORD])].tolist():
            n = row[2]
            out.append((names[row[0]], row[1], tuple(row[3: 3 + n]), tuple(row[3 + MAX_DIMS: 3 + MAX_DIMS + n]),
                        as_unsigned(row[-1])))
        return out


def map_copy(path: str, seat: int) -> MappedCopy:
    """Map reader ``seat``'s copy at ``path``.

    Raises:
        TransportError: the file is gone (the reader left, or a sweep removed it after it died) or
            is not a peer copy.
    """
    try:
        mem, _, header = read_segment(path, seat)
    except FileGoneError:
        raise TransportError(f"reader {seat}'s peer copy {path} is gone (it left, or it died and its file was "
                             "removed)") from None
    shards = header.get("shards")
    if header.get("kind") != "peer_copy" or not isinstance(shards, dict):
        raise TransportError(f"{path} is not a peer copy of reader {seat}'s (its header says {header.get('kind')!r})")
    try:
        return copy_in(mem, seat, shards, int(header["entries_at"]), int(header["capacity"]))
    except (TypeError, ValueError, RuntimeError, KeyError) as exc:
        raise TransportError(f"reader {seat}'s peer copy {path} has a malformed shard table: {exc}") from None


def copy_in(mem: torch.Tensor, seat: int, shards: Mapping[str, Sequence[Any]], entries_at: int,
            capacity: int) -> MappedCopy:
    """Reader ``seat``'s copy laid out in ``mem`` (a whole segment: the control page, then the data
    area): the file mapped on this host, or the bytes read from another host's memory
    (:mod:`weightsync.transport.nixl.peer_read`), whose layout came with the record.

    Raises:
        ValueError: a shard or the table does not fit in ``mem`` (or names an unknown dtype).
    """
    words = mem[:CONTROL_BYTES].view(torch.int64)
    data = mem[CONTROL_BYTES:]
    flats = {}
    for name, (offset, numel, dtype) in shards.items():
        kind = torch_dtype(dtype)
        if offset + numel * kind.itemsize > data.numel():
            raise ValueError(f"shard {name} ends past the copy's {data.numel()} bytes")
        flats[name] = data[offset: offset + numel * kind.itemsize].view(kind)
    if entries_at + 8 * ENTRY_WORDS * capacity > data.numel():
        raise ValueError(f"the digest table ends past the copy's {data.numel()} bytes")
    table = data[entries_at: entries_at + 8 * ENTRY_WORDS * capacity].view(torch.int64).view(capacity, ENTRY_WORDS)
    return MappedCopy(seat, words, flats, table)


__all__ = ["ENTRIES_WORD", "HELD_WORD", "HeldCopy", "MappedCopy", "copy_in", "digest_entries", "map_copy",
           "refill_digests"]
