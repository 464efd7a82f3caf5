"""Delta sync over the file transport: a change file next to each full version, never a chain.

With ``TransportOptions(delta_anchor_every=K)`` a file writer writes, next to
``v<V>/writer-<r>.p<phase>.safetensors``, ``writer-<r>.p<phase>.changes.safetensors``: the
changes of that version from ``V - 1`` in the encodings and table of
:mod:`weightsync.transport.delta.published` (one table row and one encoding per piece of the
full file). The writer compares each piece with its bytes in its own previous full file (as a
snapshot writer compares with its previous slot; no copy of the model in memory), and writes
the change file before it renames the full file into place, so a reader that sees a version
sees its change file too.

A reader that holds ``V - 1`` of a writer's pieces, and vouches for it (the reader-side
digests of :class:`~weightsync.transport.delta.published.ChangeReader`), reads the table and
only its own pieces' encodings (and, whole from the full file, a piece the table marks
``DENSE``); any other reader reads the full file, as without deltas. A version never depends
on more than its predecessor, and old change files go with their versions.

A change file is a safetensors file: ``table`` (int64 ``[rows, 5]``) and ``changes`` (uint8,
the encodings back to back); its metadata ``keys`` lists the pieces of the table's rows 1..n
(JSON), so a reader, whose plan holds only its own ops, finds its rows.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from weightsync.tools.codecs.delta import Kind
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport.base import TransportError
from weightsync.transport.delta.published import (
    BASE,
    COLUMNS,
    DIGEST,
    KIND,
    NBYTES,
    OFFSET,
    USED,
    VERSION,
    ChangeReader,
    ChangeWriter,
    area_capacity,
    check_row,
    table_rows,
)
from weightsync.transport.exposed import ExposedIndex, piece_key
from weightsync.transport.tensors import as_bytes, op_dst_view

if TYPE_CHECKING:
    from weightsync.plan import TransferOp


def changes_path(full_path: str) -> str:
    """The change file next to a full version file."""
    return full_path.removesuffix(".safetensors") + ".changes.safetensors"


def write_header(f: BinaryIO, entries: Mapping[str, tuple[str, list[int], int]], metadata: dict[str, str]) -> int:
    """Write a safetensors header for ``entries`` (key -> (dtype code, shape, nbytes), in file
    order) padded to 8 bytes (so int64 and int32 data stay aligned); returns where data starts."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **metadata}}
    cursor = 0
    for key, (dtype, shape, nbytes) in entries.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    return 8 + len(raw)


def read_header(f: BinaryIO, path: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and where its data starts."""
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{path} is shorter than a safetensors header")
    (size,) = struct.unpack("<Q", head)
    if size > 1 << 30:
        raise ValueError(f"{path} declares a header of {size} bytes")
    header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}'s header is not a JSON object")
    return header, 8 + size


def read_at(f: BinaryIO, at: int, nbytes: int, path: str) -> torch.Tensor:
    """``nbytes`` bytes of ``f`` from ``at``, as a 1-d uint8 tensor (exactly those bytes are read)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    f.seek(at)
    if nbytes and f.readinto(out.numpy()) != nbytes:  # type: ignore[attr-defined]  # an ndarray is a buffer
        raise ValueError(f"{path} ends before byte {at + nbytes}")
    return out


class FileChangeWriter:
    """One writer's change files for one phase (its pieces, in full-file order)."""

    def __init__(self, pieces: Sequence[tuple[str, TransferOp]], *, anchor_every: int) -> None:
        index = ExposedIndex.for_ops(op for _, op in pieces)[0]
        self.keys = list(index.entries)
        self.book = ChangeWriter(index, anchor_every=anchor_every)
        self.table = torch.zeros(table_rows(index), COLUMNS, dtype=torch.int64)
        self.area = torch.empty(area_capacity(index.total_bytes), dtype=torch.uint8)
        self.largest = max((op.nbytes for _, op in pieces), default=0)
        self.new = torch.empty(self.largest, dtype=torch.uint8)  # a piece's bytes, written then compared
        self._old = torch.empty(self.largest, dtype=torch.uint8)
        self._previous: tuple[str, dict[str, int]] | None = None  # the last full file: path, key -> byte
        self._current: tuple[str, dict[str, int]] | None = None
        self._old_file: BinaryIO | None = None

    @property
    def extra_bytes(self) -> int:
        """Host memory this phase's change files take: a piece's new and old bytes, table, area."""
        return 2 * self.largest + int(self.table.numel()) * 8 + int(self.area.numel())

    def begin(self, version: int, path: str, offsets: dict[str, int]) -> None:
        """Start ``version``, whose full file ``path`` holds each piece at ``offsets[key]``."""
        self.book.begin(version, self.table, self.area)
        self._current = (path, offsets)
        if self.book.base >= 0:
            assert self._previous is not None, "a base is the previous version this writer wrote"
            self._old_file = open(self._previous[0], "rb")  # noqa: SIM115  # closed in end()/abandon()

    def piece(self, key: str, op: TransferOp, new: torch.Tensor) -> None:
        """Row and encoding of one piece, ``new`` its bytes in this version (1-d uint8)."""
        old = None
        if self._old_file is not None:
            assert self._previous is not None
            old = self._old[: op.nbytes]
            self._old_file.seek(self._previous[1][key])
            if self._old_file.readinto(old.numpy()) != op.nbytes:  # type: ignore[attr-defined]
                raise TransportError(f"{self._previous[0]} (the previous version) ends inside {key}")
        self.book.piece(key, op, new, old, table=self.table, area=self.area, update_old=False)

    def write(self, path: str, version: int) -> None:
        """Write this version's change file at ``path`` (atomically: a temporary, then a rename)."""
        used = int(self.table[0, USED])
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            write_header(f, {"table": ("I64", list(self.table.shape), int(self.table.numel()) * 8),
                             "changes": ("U8", [used], used)},
                         {"weightsync_version": str(version), "keys": json.dumps(self.keys)})
            f.write(as_bytes(self.table).numpy().data)  # type: ignore[attr-defined]
            f.write(self.area[:used].numpy().data)  # type: ignore[attr-defined]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def end(self, version: int) -> None:
        self._close_old()
        self.book.end(version)
        self._previous = self._current

    def abandon(self) -> None:
        self._close_old()
        self.book.abandon()

    def _close_old(self) -> None:
        if self._old_file is not None:
            self._old_file.close()
            self._old_file = None


def receive_changes(changes: ChangeReader, key: tuple[int, int], ops: Sequence[TransferOp], *, path: str,
                    version: int, flats: Mapping[str, torch.Tensor], read_whole: Any) -> int:
    """Bring ``ops`` of writer ``key[1]`` (phase ``key[0]``) to ``version`` from its full file
    ``path`` and change file: only the changes when this reader vouches for the base, else
    ``read_whole(path, ops)``. Returns the bytes read from either file (tables aside)."""
    base = changes.vouch(key, ops, flats)
    shadow = changes.shadow_of(key, ops)
    cpath = changes_path(path)
    with open(cpath, "rb") as cf:
        header, table, area_at, used = _read_table(cf, cpath, version)
        rows = _rows(header, cpath, table, ops)
        if base < 0 or int(table[0, BASE]) != base:
            read_whole(path, ops)
            for op, own in zip(ops, shadow or (), strict=False):  # the reader's own copy of each op
                own.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes).copy_(op_dst_view(flats, op))
            nbytes = sum(op.nbytes for op in ops)
        else:
            nbytes = _apply_rows(changes, ops, rows, files=(cf, cpath, path), area=(area_at, used), flats=flats,
                                 shadow=shadow, writer=key[1])
    changes.received(key, version, [row[DIGEST] for row in rows])
    return nbytes


def _read_table(cf: BinaryIO, cpath: str, version: int) -> tuple[dict[str, Any], torch.Tensor, int, int]:
    """The change file's header, its table (checked: its version) and where and how long its area is."""
    header, data_at = read_header(cf, cpath)
    try:
        t, c = header["table"], header["changes"]
        rows, cols = (int(n) for n in t["shape"])
        t0, t1 = (int(n) for n in t["data_offsets"])
        c0, c1 = (int(n) for n in c["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{cpath} is not a change file: {exc!r}") from exc
    if t["dtype"] != "I64" or cols != COLUMNS or t1 - t0 != rows * COLUMNS * 8 or c1 < c0 or t0 % 8:
        raise ValueError(f"{cpath} holds a malformed change table ({t!r:.80})")
    table = read_at(cf, data_at + t0, t1 - t0, cpath).view(torch.int64).view(rows, COLUMNS)
    if int(table[0, VERSION]) != version:
        raise ValueError(f"{cpath} holds the changes of version {int(table[0, VERSION])}, not {version}")
    return header, table, data_at + c0, c1 - c0


def _rows(header: Mapping[str, Any], cpath: str, table: torch.Tensor, ops: Sequence[TransferOp]) -> list[list[int]]:
    """Each op's row of the table, found by its piece key in the file's ``keys``."""
    try:
        keys = json.loads(header["__metadata__"]["keys"])
        row_of = {k: 1 + i for i, k in enumerate(keys)}
        rows = [row_of[piece_key(op)] for op in ops]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{cpath} lists no row for a piece this reader takes: {exc!r}") from exc
    if max(rows, default=0) >= table.shape[0]:
        raise ValueError(f"{cpath}'s table has {table.shape[0]} rows, fewer than its keys")
    return [table[r].tolist() for r in rows]


def _apply_rows(changes: ChangeReader, ops: Sequence[TransferOp], rows: list[list[int]], *,
                files: tuple[BinaryIO, str, str], area: tuple[int, int], flats: Mapping[str, torch.Tensor],
                shadow: list[torch.Tensor] | None, writer: int) -> int:
    """Apply each op's encoding, or copy it whole from the full file where the table says ``DENSE``
    (``files``: the open change file, its path, the full file's path; ``area``: where the
    encodings start in the change file, and their length)."""
    cf, cpath, path = files
    area_at, used = area
    nbytes = 0
    with open(path, "rb") as full:
        header, data_at = read_header(full, path)
        for i, (op, row) in enumerate(zip(ops, rows, strict=True)):
            kept = None if shadow is None else shadow[i]
            if row[KIND] == Kind.DENSE:
                start = data_at + int(header[piece_key(op)]["data_offsets"][0])
                whole = read_at(full, start, op.nbytes, path)
                changes.copy(op, whole.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes), flats, shadow=kept)
                nbytes += op.nbytes
                continue
            check_row(row, op, used, reader=changes.rank, writer=writer)
            encoded = read_at(cf, area_at + row[OFFSET], row[NBYTES], cpath)
            changes.apply(op, row, encoded, flats, writer=writer, shadow=kept)
            nbytes += row[NBYTES]
    return nbytes
