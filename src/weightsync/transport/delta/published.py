"""Delta sync for one-sided transports: each writer publishes what changed since its last version.

A one-sided writer never hears from its readers (shared memory, NIXL pull), so it cannot
send each reader what changed since the version that reader holds, as two-sided peers do
(:mod:`weightsync.transport.delta.pairs`). Instead, with ``TransportOptions(delta_anchor_every=K)``,
it publishes next to every version ``V`` the changes from ``V - 1``: per exposed piece (the
pieces of :mod:`weightsync.transport.exposed`), a row of a *table* and its encoding in an
*area*. A reader that holds ``V - 1`` of a writer's pieces, and can vouch for it, copies only
each piece's encoding (an index list or a bitmap, and the changed values) and applies it;
every other reader copies the version in full, as without deltas::

    changes = ChangeWriter(index, anchor_every=K, capacity=area_capacity(index.total_bytes))
    base = changes.begin(version, table, area)         # -1: this version is full (no base)
    changes.piece(key, op, new_bytes, old_bytes, table=table, area=area, update_old=False)  # per piece
    changes.end(version)                                # once the version is out

    held = ChangeReader(ctx)                            # reader: one per transport
    base = held.vouch(key, ops, flats)                 # V - 1 if its memory holds it, else -1
    held.apply(op, row, encoded_bytes, flats)           # or copy the piece in full
    held.received(key, version, digests)                # once every op landed

Table rows (int64): row 0 is ``[version, base, area bytes used, 0, 0]`` (``base`` -1: no
deltas in this version); row ``1 + i`` is piece ``i``'s ``[kind, changed, nbytes, offset in
the area, digest of the new bytes]``, kind ``DENSE`` meaning "copy the piece from the version
itself" (the first version, an anchor every K versions, a piece whose encoding would be no
smaller, or an area already full: it holds at most a quarter of the exposed bytes).

**Vouching.** A reader asks nothing of the writer, so it checks by itself that its memory
holds the base: it remembers the writer's digest of every op it received
(:func:`weightsync.transport.delta.pairs.base_digest`), and before using a version's changes it digests
its destination and compares. Memory changed since (a reset, a flipped bit, buffers used as
scratch), a missed version, a failed receive or :meth:`ChangeReader.forget` (a version
change it did not make) make it copy the version in full. A reader whose destination does
not keep what it received (several phases sharing one staging arena) keeps its own host
copy of each op (the *shadow*) and writes each op in full from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weightsync.tools.codecs.delta import Kind, apply, diff, element_unit, warm_up
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport.base import TransportError
from weightsync.transport.delta.pairs import base_digest
from weightsync.transport.exposed import ALIGN, ExposedIndex
from weightsync.transport.tensors import as_bytes, op_dst_view

if TYPE_CHECKING:
    from weightsync.plan import TransferOp
    from weightsync.transport.base import TransportContext

logger = logging.getLogger(__name__)

#: Columns of a table row.
COLUMNS = 5
#: Row 0's columns: the version, its base (-1: full) and the area bytes used.
VERSION, BASE, USED = 0, 1, 2
#: A piece row's columns.
KIND, CHANGED, NBYTES, OFFSET, DIGEST = 0, 1, 2, 3, 4


def table_rows(index: ExposedIndex) -> int:
    """Rows of a writer's table: the version row and one per exposed piece."""
    return 1 + len(index.entries)


def area_capacity(exposed_bytes: int) -> int:
    """Bytes of a version's change area: a quarter of the exposed bytes (deltas of RL steps take
    about 6% of bf16 weights), at least one page."""
    return max(4096, -(-exposed_bytes // 4 // ALIGN) * ALIGN)


def piece_unit(op: TransferOp) -> int:
    """The element size a piece's changes are found in: its dtype's (pieces start aligned)."""
    return element_unit([TORCH_DTYPES[op.dst_dtype].itemsize])


@dataclass(frozen=True, slots=True)
class ChangeLayout:
    """Where a writer's tables and change areas live in memory it shares: ``slots`` tables of
    ``rows`` rows, then ``slots`` areas of ``capacity`` bytes, from byte ``at`` of its data."""

    rows: int
    capacity: int
    slots: int
    at: int

    @classmethod
    def for_index(cls, index: ExposedIndex, slots: int, *, after: int,
                  header: dict[str, object] | None = None) -> ChangeLayout:
        """The layout after byte ``after``; also written into a segment's ``header`` when given."""
        layout = cls(table_rows(index), area_capacity(index.total_bytes), slots, -(-after // ALIGN) * ALIGN)
        if header is not None:
            header["changes"] = layout.to_header()
        return layout

    @property
    def tables_bytes(self) -> int:
        return -(-self.slots * self.rows * COLUMNS * 8 // ALIGN) * ALIGN

    @property
    def end(self) -> int:
        """One past the last byte of the areas."""
        return self.at + self.tables_bytes + self.slots * self.capacity

    @property
    def nbytes(self) -> int:
        return self.tables_bytes + self.slots * self.capacity

    def views(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tables [slots, rows, COLUMNS] int64, areas [slots, capacity] uint8)`` within ``data``."""
        size = self.slots * self.rows * COLUMNS * 8
        tables = data[self.at: self.at + size].view(torch.int64).view(self.slots, self.rows, COLUMNS)
        start = self.at + self.tables_bytes
        return tables, data[start: start + self.slots * self.capacity].view(self.slots, self.capacity)

    def to_header(self) -> dict[str, int]:
        return {"rows": self.rows, "capacity": self.capacity, "slots": self.slots, "at": self.at}

    @classmethod
    def from_header(cls, doc: object, *, writer: int) -> ChangeLayout:
        try:
            if isinstance(doc, dict):
                return cls(int(doc["rows"]), int(doc["capacity"]), int(doc["slots"]), int(doc["at"]))
        except (KeyError, TypeError, ValueError):
            pass
        raise TransportError(f"writer {writer}'s change layout is malformed: {doc!r:.80}")


class ChangeWriter:
    """A writer's changes per version: which base, and each piece's row and encoding."""

    def __init__(self, index: ExposedIndex, *, anchor_every: int) -> None:
        self.row_of = {key: 1 + i for i, key in enumerate(index.entries)}
        self.anchor_every = anchor_every
        self._last: int | None = None  # the last version whose every piece was published
        self._deltas = 0  # versions published with a base since the last full one
        self._base = -1
        self._used = 0
        warm_up()

    def begin(self, version: int, table: torch.Tensor, area: torch.Tensor) -> int:
        """Start ``version``'s table; returns its base (``version - 1``, or -1: full)."""
        whole = self._last != version - 1 or self._deltas + 1 >= self.anchor_every
        self._base = -1 if whole else version - 1
        self._used = 0
        table[1:].fill_(-1)
        table[0] = torch.tensor([version, self._base, 0, 0, 0])
        return self._base

    @property
    def base(self) -> int:
        return self._base

    def piece(self, key: str, op: TransferOp, new: torch.Tensor, old: torch.Tensor | None, *, table: torch.Tensor,
              area: torch.Tensor, update_old: bool) -> None:
        """Row and encoding of one piece: ``new`` (its bytes now) against ``old`` (at the base;
        None: none). ``update_old``: ``old`` is the writer's own copy, which then takes ``new``."""
        row = self.row_of[key]
        if self._base < 0 or old is None:
            if update_old and old is not None:
                old.copy_(new)
            table[row] = torch.tensor([int(Kind.DENSE), 0, 0, 0, base_digest(new)])
            return
        changes = diff(new, old, unit=piece_unit(op), update_old=update_old)
        new_digest = base_digest(new)
        enc = changes.encode()
        if enc.kind == Kind.DENSE or self._used + enc.nbytes > area.numel():
            table[row] = torch.tensor([int(Kind.DENSE), changes.changed, 0, 0, new_digest])
            return
        at = self._used
        for part in enc.parts:
            area[self._used: self._used + part.numel()].copy_(part)
            self._used += part.numel()
        self._used = -(-self._used // 8) * 8  # the next encoding's int32 indices stay aligned
        table[row] = torch.tensor([int(enc.kind), enc.changed, enc.nbytes, at, new_digest])
        table[0, USED] = self._used

    def end(self, version: int) -> None:
        """Every piece of ``version`` is published (the next version may build on it)."""
        self._deltas = 0 if self._base < 0 else self._deltas + 1
        self._last = version

    def abandon(self) -> None:
        """The version was not published whole (a failure): the next one is full."""
        self._last = None


class SlotChanges:
    """A snapshot writer's changes (shm snapshot, NIXL pull): its memory ``data`` holds ``slots``
    version slots of ``slot_bytes``, then ``layout``'s tables and areas; each piece of version
    ``V`` is compared with its bytes of ``V - 1`` in the previous slot (no copy of its own)::

        changes.begin(version)                    # phase 0, before readers may look at the slot
        changes.piece(version, key, op, at)       # once the piece is packed at ``at`` in its slot
        changes.end(version)                      # the version is sealed (or .abandon() on failure)
    """

    def __init__(self, index: ExposedIndex, layout: ChangeLayout, data: torch.Tensor, *, slot_bytes: int,
                 anchor_every: int) -> None:
        self.book = ChangeWriter(index, anchor_every=anchor_every)
        self.tables, self.areas = layout.views(data)
        self.data, self.slots, self.slot_bytes = data, layout.slots, slot_bytes

    def begin(self, version: int) -> None:
        slot = version % self.slots
        self.book.begin(version, self.tables[slot], self.areas[slot])

    def piece(self, version: int, key: str, op: TransferOp, at: int) -> None:
        slot, previous = version % self.slots * self.slot_bytes, (version - 1) % self.slots * self.slot_bytes
        new = self.data[slot + at: slot + at + op.nbytes]
        old = self.data[previous + at: previous + at + op.nbytes] if self.book.base >= 0 else None
        self.book.piece(key, op, new, old, table=self.tables[version % self.slots],
                        area=self.areas[version % self.slots], update_old=False)

    def end(self, version: int) -> None:
        self.book.end(version)

    def abandon(self) -> None:
        self.book.abandon()


@dataclass
class HeldOps:
    """What a reader received from one writer (per phase): the version and, per op, the
    writer's digest of the bytes it should hold now."""

    version: int
    digests: list[int]


@dataclass
class Taking:
    """A reader's receive of one writer's ops in one version: the base it vouches for (-1:
    none), its own copy of each op (None: the destination keeps what arrived), and the
    writer's digest of each op's new bytes, collected as the ops land."""

    base: int
    shadow: list[torch.Tensor] | None
    digests: list[int] = field(default_factory=list)


class ChangeReader:
    """A reader's side of published changes (module docstring), for one transport."""

    def __init__(self, ctx: TransportContext) -> None:
        self.rank = ctx.rank
        self.keeps_received_bytes = ctx.keeps_received_bytes
        self.held: dict[tuple[int, int], HeldOps] = {}  # (phase, writer) -> held
        self.shadow: dict[tuple[int, int], list[torch.Tensor]] = {}  # the reader's own copy, per op
        self._one_phase = True
        warm_up()

    def prepared(self, phases: int) -> None:
        """The transport was (re)prepared: other memory or other ops, nothing to build on."""
        self.held.clear()
        self.shadow.clear()
        self._one_phase = phases == 1

    def forget(self) -> None:
        """The destination may no longer hold what arrived: the next version of every writer is full."""
        self.held.clear()

    @property
    def shadowed(self) -> bool:
        """Whether this reader keeps its own copy (its destination does not keep the bytes)."""
        return not (self.keeps_received_bytes and self._one_phase)

    def extra_bytes(self) -> int:
        return sum(int(t.numel()) for ops in self.shadow.values() for t in ops)

    def vouch(self, key: tuple[int, int], ops: Sequence[TransferOp], flats: Mapping[str, torch.Tensor]) -> int:
        """The version this reader's memory holds for ``ops`` of writer ``key[1]``, checked, or -1."""
        held = self.held.pop(key, None)  # dropped until the next version landed whole
        if held is None or len(held.digests) != len(ops):
            return -1
        shadow = self.shadow.get(key)
        for i, op in enumerate(ops):
            data = shadow[i] if shadow is not None else _dst_bytes(flats, op)[0]
            if base_digest(data) != held.digests[i]:
                logger.info("reader %d: %s %s no longer holds what writer %d published as version %d (it was "
                            "written since); this version comes in full", self.rank, op.canonical, op.box,
                            key[1], held.version)
                return -1
        return held.version

    def shadow_of(self, key: tuple[int, int], ops: Sequence[TransferOp]) -> list[torch.Tensor] | None:
        """The reader's copy of each op (None when the destination keeps what arrived)."""
        if not self.shadowed:
            return None
        shadow = self.shadow.get(key)
        if shadow is None or [int(t.numel()) for t in shadow] != [op.nbytes for op in ops]:
            shadow = self.shadow[key] = [torch.empty(op.nbytes, dtype=torch.uint8) for op in ops]
        return shadow

    def apply(self, op: TransferOp, row: Sequence[int], encoded: torch.Tensor, flats: Mapping[str, torch.Tensor],
              *, writer: int, shadow: torch.Tensor | None) -> None:
        """Bring ``op``'s destination (or its shadow, then the destination) from the base to the new bytes."""
        kind, changed = Kind(row[KIND]), row[CHANGED]
        if shadow is not None:
            _apply(kind, encoded, shadow, op, changed=changed, reader=self.rank, writer=writer)
            op_dst_view(flats, op).copy_(shadow.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes))
            return
        data, dense = _dst_bytes(flats, op)
        _apply(kind, encoded, data, op, changed=changed, reader=self.rank, writer=writer)
        if not dense:  # a strided destination: its bytes were a copy
            op_dst_view(flats, op).copy_(data.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes))

    def copy(self, op: TransferOp, source: torch.Tensor, flats: Mapping[str, torch.Tensor], *,
             shadow: torch.Tensor | None) -> None:
        """Copy ``op`` in full from ``source`` (through the shadow, when the reader keeps one)."""
        dst = op_dst_view(flats, op)
        if shadow is None:
            dst.copy_(source)
            return
        kept = shadow.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes)
        kept.copy_(source)
        dst.copy_(kept)

    def begin(self, key: tuple[int, int], ops: Sequence[TransferOp], flats: Mapping[str, torch.Tensor], *,
              publishes: bool) -> Taking:
        """Start receiving ``ops`` of writer ``key[1]`` in phase ``key[0]`` (vouch for the base);
        ``publishes``: whether that writer publishes changes at all."""
        if not publishes:
            raise TransportError(f"reader {self.rank}: writer {key[1]} publishes no changes; set the same "
                                 "TransportOptions.delta_anchor_every on every rank")
        return Taking(self.vouch(key, ops, flats), self.shadow_of(key, ops))

    def begin_writers(self, phase: int, ops_of: Mapping[int, list[TransferOp]], flats: Mapping[str, torch.Tensor],
                      *, publishes: Callable[[int], bool]) -> dict[int, Taking]:
        """:meth:`begin` for each writer of ``ops_of`` (writer -> its ops this phase, in order)."""
        return {w: self.begin((phase, w), ops, flats, publishes=publishes(w)) for w, ops in ops_of.items()}

    def take(self, op: TransferOp, published: tuple[torch.Tensor, torch.Tensor] | None, *, version: int, row: int,
             source: torch.Tensor, flats: Mapping[str, torch.Tensor], taking: Taking, writer: int) -> int:
        """Bring the next op of ``taking`` to ``version``: its change from the ``published`` table
        and area when this reader holds the version's base, else in full from ``source`` (the
        op's view in the version). Returns the bytes taken from the writer's memory."""
        assert published is not None, "begin() checked that the writer publishes changes"
        table, area = published
        if int(table[0, VERSION]) != version:
            raise TransportError(f"reader {self.rank}: writer {writer}'s change table holds version "
                                 f"{int(table[0, VERSION])}, not {version}")
        values = table[row].tolist()
        kept = None if taking.shadow is None else taking.shadow[len(taking.digests)]
        taking.digests.append(values[DIGEST])
        if taking.base < 0 or int(table[0, BASE]) != taking.base or values[KIND] == Kind.DENSE:
            self.copy(op, source, flats, shadow=kept)
            return op.nbytes
        check_row(values, op, area.numel(), reader=self.rank, writer=writer)
        self.apply(op, values, area[values[OFFSET]: values[OFFSET] + values[NBYTES]], flats, writer=writer,
                   shadow=kept)
        return int(values[NBYTES])

    def received(self, key: tuple[int, int], version: int, digests: list[int]) -> None:
        """Every op of writer ``key[1]`` landed at ``version`` (``digests``: the table's, per op)."""
        self.held[key] = HeldOps(version, digests)

    def close(self) -> None:
        self.held.clear()
        self.shadow.clear()


def check_delta(transport: str, ctx: TransportContext, *, slots: bool = True) -> None:
    """Refuse, when a transport that publishes changes is created, delta settings it cannot
    honour (a setting is never ignored): its changes are found and applied in host memory, and
    a snapshot writer (``slots``: one that keeps versions in ``TransportOptions.slots``)
    compares each version with the previous one in its other slot."""
    if not ctx.options.delta_anchor_every:
        return
    if ctx.device != "cpu":
        raise ValueError(f"{ctx.who}: delta_anchor_every={ctx.options.delta_anchor_every} over the {transport} "
                         f"transport needs host memory, but the tensors live on {ctx.device} (deltas between GPUs "
                         "run over the torch transport, NCCL); use transport='torch', or delta_anchor_every=0")
    if slots and ctx.options.slots < 2:
        raise ValueError(f"{ctx.who}: delta_anchor_every over the {transport} transport needs slots >= 2 (a "
                         f"version is compared with the previous one in its own slot); got slots="
                         f"{ctx.options.slots}")


def published_views(header: Mapping[str, object], data: torch.Tensor, *,
                    writer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A writer's ``(tables, areas)`` per slot in ``data`` (its shared memory after the control
    page), as its segment ``header`` lays them out; None when it publishes no changes."""
    if "changes" not in header:
        return None
    return ChangeLayout.from_header(header["changes"], writer=writer).views(data)


def check_row(row: Sequence[int], op: TransferOp, capacity: int, *, reader: int, writer: int) -> None:
    """A piece row that can be applied to ``op`` (never trust another process's memory blindly)."""
    kind, nbytes, at = row[KIND], row[NBYTES], row[OFFSET]
    if kind not in (Kind.DENSE, Kind.SPARSE, Kind.BITMAP) or not 0 <= nbytes <= op.nbytes or not (
            at >= 0 and at + nbytes <= capacity):
        raise TransportError(f"reader {reader}: writer {writer} published a malformed change row {list(row)} for "
                             f"{op.canonical} {op.box}")


def _dst_bytes(flats: Mapping[str, torch.Tensor], op: TransferOp) -> tuple[torch.Tensor, bool]:
    """An op's destination as 1-d bytes: a view when it is one dense run (True), else a copy (False)."""
    view = op_dst_view(flats, op)
    if view.is_contiguous():
        return as_bytes(view), True
    return as_bytes(view.contiguous()), False


def _apply(kind: Kind, encoded: torch.Tensor, dest: torch.Tensor, op: TransferOp, *, changed: int, reader: int,
           writer: int) -> None:
    try:
        apply(kind, encoded, dest, unit=piece_unit(op), changed=changed)
    except ValueError as exc:
        raise TransportError(f"reader {reader}: malformed change of {op.canonical} {op.box} from writer {writer}: "
                             f"{exc}") from exc
