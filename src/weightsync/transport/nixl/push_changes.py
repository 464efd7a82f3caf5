"""NIXL push with deltas: each reader states the base it holds, writers WRITE it only the changes.

A push writer never reads its readers' memory, but it READs each reader's ready word before
it WRITEs a version. With ``TransportOptions(delta_anchor_every=K)`` a reader also raises,
per writer, a *vouch word* next to its ready word: the token of ``(V, phase)`` when its memory
holds ``V - 1`` of that writer's ops of the phase, checked by digest
(:meth:`~weightsync.transport.delta.published.ChangeReader.vouch`), else -1. The writer packs
every version into one of two slots and compares it with the previous one in the other slot
(:class:`~weightsync.transport.delta.published.SlotChanges`, as NIXL pull and shm do), then,
per reader:

- vouch word equal to this ``(V, phase)`` and the version has a base (no anchor, no failure
  since ``V - 1``): one WRITE of the reader's *staged table* (a row per op of the pair, with
  the offset of its encoding in the reader's inbox), the encodings of its changed ops into the
  *inbox* and, straight into the destination, the ops that changed too much (``DENSE``), with the
  notification ``v<token>``;
- otherwise the staged table (the digests the reader vouches with next time), then the version
  in full, as without deltas, with ``v<token>``. The staged table's row 0 (its base) tells the
  reader which of the two came.

A stale vouch word (an earlier version's token) only ever gives a full version. The reader
applies the inbox's encodings (:meth:`ChangeReader.apply`) when the notification arrives.

**Memory.** Each reader registers one inbox per writer that feeds it: a table of ``1 + ops``
rows of 40 bytes and an area of a quarter of the bytes it receives from that writer (at least
4 KiB; :func:`~weightsync.transport.delta.published.area_capacity`), reused phase by phase; an
op whose encoding no longer fits the area goes ``DENSE``. So a reader's inboxes hold at most
about a quarter of what it receives, plus 40 bytes per op. The writer packs every op (nothing
is sent from the live shards): two version slots of its exposed bytes, two change tables and
areas (a quarter of its exposed bytes each) and one staged table per reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from weightsync.tools.codecs.delta import Kind
from weightsync.transport.base import TransportError
from weightsync.transport.delta.published import (
    BASE,
    COLUMNS,
    KIND,
    NBYTES,
    OFFSET,
    VERSION,
    area_capacity,
    check_row,
)
from weightsync.transport.exposed import ALIGN, piece_key

if TYPE_CHECKING:
    from weightsync.plan import TransferOp

#: Row 0 of a staged table: ``[version, base (-1: full), used bytes of the inbox, phase, 0]``.
PHASE = 3
#: Bytes of one table row.
ROW = COLUMNS * 8


@dataclass(frozen=True, slots=True)
class InboxLayout:
    """One writer's inbox in one reader: ``rows`` table rows, then ``capacity`` bytes of area.
    Both ends derive it from the ops between them (each phase's ``ops_between``, in order)."""

    rows: int
    capacity: int

    @classmethod
    def for_ops(cls, ops_by_phase: Sequence[Sequence[TransferOp]]) -> InboxLayout:
        return cls(1 + sum(len(ops) for ops in ops_by_phase),
                   area_capacity(sum(op.nbytes for ops in ops_by_phase for op in ops)))

    @property
    def table_bytes(self) -> int:
        return -(-self.rows * ROW // ALIGN) * ALIGN

    @property
    def nbytes(self) -> int:
        return self.table_bytes + self.capacity

    def views(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table [rows, COLUMNS] int64, area uint8)`` within ``data`` (uint8, ``nbytes`` long)."""
        table = data[: self.rows * ROW].view(torch.int64).view(self.rows, COLUMNS)
        return table, data[self.table_bytes: self.table_bytes + self.capacity]


def first_rows(ops_by_phase: Sequence[Sequence[TransferOp]]) -> list[int]:
    """Table row of each phase's first op (row 0 is the version's)."""
    return [1 + n for n in np.cumsum([0, *(len(ops) for ops in ops_by_phase)])[:-1].tolist()]


@dataclass
class Outbox:
    """A writer's side of one reader's inbox: the pair's ops and a staged table it WRITEs from."""

    ops: list[list[TransferOp]]  # per phase
    layout: InboxLayout
    staged: torch.Tensor  # [rows, COLUMNS] int64, registered
    inbox: int  # the reader's inbox address
    first: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first = first_rows(self.ops)

    def stage(self, version: int, phase: int, table: torch.Tensor, area_at: int, *, row_of: dict[str, int],
              delta: bool) -> tuple[list[tuple[int, int, int]], list[TransferOp], int]:
        """Fill the phase's rows of the staged table from the writer's ``table`` of ``version``
        (``area_at``: address of its change area). Returns the ranges to WRITE (local, remote,
        length: the rows and, when ``delta``, each changed op's encoding), the ops to WRITE whole
        (``delta``: those ``DENSE`` or not fitting), and the bytes of the encodings."""
        first, ops = self.first[phase], self.ops[phase]
        table_bytes, used, dense = self.layout.table_bytes, 0, []
        ranges: list[tuple[int, int, int]] = []
        for j, op in enumerate(ops):
            row = table[row_of[piece_key(op)]].tolist()
            if delta and row[KIND] != Kind.DENSE and used + row[NBYTES] <= self.layout.capacity:
                ranges.append((area_at + row[OFFSET], self.inbox + table_bytes + used, row[NBYTES]))
                row[OFFSET] = used
                used = -(-(used + row[NBYTES]) // 8) * 8  # int32 indices stay aligned
            else:
                row[KIND], row[NBYTES], row[OFFSET] = int(Kind.DENSE), 0, 0
                dense.append(op)
            self.staged[first + j] = torch.tensor(row)
        base = int(table[0, BASE]) if delta else -1
        self.staged[0] = torch.tensor([version, base, used, phase, 0])
        at = self.staged.data_ptr()
        ranges[:0] = [(at, self.inbox, ROW), (at + first * ROW, self.inbox + first * ROW, len(ops) * ROW)]
        return ranges, dense, sum(n for _, _, n in ranges[2:])


@dataclass
class Inbox:
    """A reader's side: one writer's inbox and the pair's ops."""

    ops: list[list[TransferOp]]  # per phase
    layout: InboxLayout
    table: torch.Tensor
    area: torch.Tensor
    first: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first = first_rows(self.ops)

    def rows(self, version: int, phase: int, *, vouched: bool, reader: int,
             writer: int) -> tuple[bool, list[list[int]]]:
        """Whether the writer sent ``(version, phase)`` as changes, and the phase's rows; checks row 0."""
        head = self.table[0].tolist()
        if head[VERSION] != version or head[PHASE] != phase:
            raise TransportError(f"reader {reader}: writer {writer}'s staged table holds version {head[VERSION]} "
                                 f"phase {head[PHASE]}, not version {version} phase {phase}")
        delta = head[BASE] >= 0
        if delta and (not vouched or head[BASE] != version - 1):
            raise TransportError(f"reader {reader}: writer {writer} sent version {version} as changes from "
                                 f"version {head[BASE]}, which this reader did not vouch for")
        first = self.first[phase]
        rows = self.table[first: first + len(self.ops[phase])].tolist()
        for op, row in zip(self.ops[phase], rows, strict=True):
            if delta and row[KIND] != Kind.DENSE:
                check_row(row, op, self.layout.capacity, reader=reader, writer=writer)
        return delta, rows


def make_inboxes(pairs: list[list[list[TransferOp]]], writers: Sequence[int]
                 ) -> tuple[torch.Tensor, list[Inbox], dict[int, tuple[int, int]]]:
    """A push reader's inboxes, one per writer (``pairs``: each writer's ops to it, per phase),
    in one buffer it registers: (the buffer, the inboxes, writer -> (address, bytes))."""
    layouts = [InboxLayout.for_ops(pair) for pair in pairs]
    mem = torch.zeros(max(sum(b.nbytes for b in layouts), 64), dtype=torch.uint8)
    inboxes, out, at = [], {}, 0
    for w, pair, b in zip(writers, pairs, layouts, strict=True):
        inboxes.append(Inbox(pair, b, *b.views(mem[at: at + b.nbytes])))
        out[w] = (mem.data_ptr() + at, b.nbytes)
        at += b.nbytes
    return mem, inboxes, out


__all__ = ["Inbox", "InboxLayout", "Outbox", "first_rows", "make_inboxes"]
