"""NIXL transport, pull mode: readers READ versions from writers' registered slots.

The protocol and when pull is chosen: :mod:`weightsync.transport.nixl.common`.

**Deltas** (``TransportOptions(delta_anchor_every=K)``, host memory): a writer publishes,
after its version slots and in the same registration, each version's changes from the
previous one (a table and a change area per slot, :mod:`weightsync.transport.delta.published`).
A reader READs the slot's table; when it can vouch for the version's base (its memory holds
the previous version of that writer's ops) it READs only the bytes of the change area that
are used and applies them, and READs whole only the pieces the table marks ``DENSE``;
otherwise it READs the version in full, as without deltas. The sequence words are READ
after either, so a version overwritten mid-read is still reported, never applied.
``TransferStats.nbytes`` counts the change area's used bytes and the whole pieces read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from weightsync.clock.deadline import Deadline
from weightsync.job.wire import WireError
from weightsync.layout.types import itemsize
from weightsync.ports import device as device_port
from weightsync.tools.codecs.delta import Kind
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport.base import PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.delta.published import (
    BASE,
    COLUMNS,
    DIGEST,
    KIND,
    NBYTES,
    OFFSET,
    USED,
    VERSION,
    ChangeLayout,
    ChangeReader,
    SlotChanges,
    check_delta,
    check_row,
)
from weightsync.transport.endpoints import NixlEndpoint, NixlSlots
from weightsync.transport.exposed import ExposedIndex, piece_key
from weightsync.transport.nixl.agent import Descriptors, Xfer
from weightsync.transport.nixl.common import EMPTY, NixlBase, Peer, slab_offset
from weightsync.transport.schedule import Message, Piece, build_messages
from weightsync.transport.tensors import dst_view, op_dst_view, scatter

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp


@dataclass
class PeerChanges:
    """A delta reader's view of one writer's published changes."""

    layout: ChangeLayout
    area: int  # the writer's registered area (slots, then tables and change areas)
    table: torch.Tensor  # [rows, COLUMNS] int64, where the slot's table is READ into
    reads: list[Xfer]  # per slot: the READ of its table
    ops: list[list[tuple[TransferOp, int, int]]]  # per phase: (op, table row, offset in a slot)

    def change_area(self, slot: int) -> int:
        """Address of ``slot``'s change area in the writer's memory."""
        return self.area + self.layout.at + self.layout.tables_bytes + slot * self.layout.capacity


class NixlPullTransport(NixlBase):
    """Pull mode (see module docstring)."""

    one_sided: ClassVar[bool] = True
    publishes_before_send: ClassVar[bool] = False  # published once the slot is packed
    mode: ClassVar[str] = "pull"
    carries_deltas: ClassVar[bool] = True  # host memory only (delta_published.check_delta)

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        check_delta(f"{self.name} (pull)", ctx)
        delta = ctx.options.delta_anchor_every
        self._published: SlotChanges | None = None  # writer: each version's changes, after the slots
        self._changes = ChangeReader(ctx) if delta and ctx.role == "reader" else None
        self._peer_changes: list[PeerChanges] = []
        self._change_buf = torch.empty(0, dtype=torch.uint8)  # reader: a slot's used change area lands here
        self._whole_buf = torch.empty(0, dtype=torch.uint8)  # reader: a piece read whole in a delta version

    # -- pull: writer -----------------------------------------------------------------------
    def _prepare_writer(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        self._exposed(parts)
        assert self._index is not None
        self._slot_bytes = max(self._index.total_bytes, 64)
        slots_bytes = self.slots * self._slot_bytes
        layout = (ChangeLayout.for_index(self._index, self.slots, after=slots_bytes)
                  if self.ctx.options.delta_anchor_every else None)
        self._area = device_port.allocate(
            self.dev, slots_bytes if layout is None else layout.end, self.device,
            what=f"{self.who}'s NIXL version slots ({self.slots} x {device_port.gib(self._slot_bytes)})",
            fix="use fewer TransportOptions.slots, or nixl_mode='push' (which packs only what is not sent live)")
        if layout is not None:
            self._published = SlotChanges(self._index, layout, self._area, slot_bytes=self._slot_bytes,
                                          anchor_every=self.ctx.options.delta_anchor_every)
        self._ctl = torch.full((self.slots,), EMPTY, dtype=torch.int64)
        self._register([self._area], words=self._ctl)
        self._publish(epoch, slots=NixlSlots(self._area.data_ptr(), self.slots, self._slot_bytes, self._index.encode(),
                                             None if layout is None else layout.to_header()))

    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        if self._area is None:
            raise RuntimeError(f"{self.who}: send() before bind()")
        self.check_phase(phase)
        stats = TransferStats(version)
        slot = version % self.slots
        changes = self._published
        if phase == 0:
            self._ctl[slot] = EMPTY  # a reader of the old version in this slot will notice
            if changes is not None:
                changes.begin(version)
        try:
            with PhaseTimer(stats)("pack"):
                stats.nbytes = self._pack(slot * self._slot_bytes, phase, then=None if changes is None else (
                    lambda key, op, at: changes.piece(version, key, op, at)))
        except BaseException:
            if changes is not None:
                changes.abandon()
            raise
        if phase == self.phase_count - 1:  # readers read every phase once the whole slot is packed
            if changes is not None:
                changes.end(version)
            area = self._area[slot * self._slot_bytes: (slot + 1) * self._slot_bytes]
            self.dev.signal(self._ctl, slot, version, covers=[area])
        stats.messages = len(self._copies[phase])
        stats.peak_extra_bytes = self._area.numel()
        return stats

    def _follows_moves(self) -> bool:
        return self.ctx.role == "writer"  # it registers only its slots; readers re-prepare in full

    # -- pull: reader -----------------------------------------------------------------------
    def _slots_of(self, peer: Peer) -> NixlSlots:
        return self._published_slots(peer.endpoint, peer.label)

    def _published_slots(self, endpoint: NixlEndpoint, label: str) -> NixlSlots:
        try:
            return endpoint.exposed_slots(label)
        except WireError as exc:
            raise TransportError(f"{self.who}: {exc}") from exc

    def _writer_agrees(self, endpoint: NixlEndpoint, label: str) -> None:
        """The writer publishes changes when this reader takes them, and as many version slots."""
        exposed = self._published_slots(endpoint, label)
        if self._changes is not None and exposed.changes is None:
            raise TransportError(f"{self.who}: {label} publishes no changes; set the same "
                                 "TransportOptions.delta_anchor_every on every rank")
        if exposed.slots != self.slots:
            raise TransportError(f"{self.who}: {label} has {exposed.slots} version slots, this "
                                 f"reader {self.slots}; use the same TransportOptions.slots everywhere")

    def _prepare_reader(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        opts = self.ctx.options
        writers = sorted({op.src_rank for part in parts for op in part.ops})
        self._peers = [self._connect_peer(epoch, "writer", w, deadline, agree=self._writer_agrees) for w in writers]
        schedules = [[build_messages(part.ops_between(p.rank, self.ctx.rank), message_bytes=opts.message_bytes,
                                     direct_min_bytes=opts.direct_min_bytes) for part in parts] for p in self._peers]
        staged = max((m.nbytes for per_phase in schedules for ms in per_phase for m in ms if not m.direct),
                     default=0)
        self._landing = (self.dev.empty(staged, self.device, what=f"{self.who}'s NIXL landing buffer") if staged
                         else None)
        self._ctl = torch.full((len(self._peers), self.slots), EMPTY, dtype=torch.int64)
        self._peer_changes = self._changes_of(parts) if self._changes is not None else []
        buffers = [self._landing, *(c.table for c in self._peer_changes), self._change_buf, self._whole_buf]
        self._register([*self._flats.values(), *(b for b in buffers if b is not None and b.numel())], words=self._ctl)
        t0 = time.perf_counter()
        for i, (peer, messages) in enumerate(zip(self._peers, schedules, strict=True)):
            exposed = self._slots_of(peer)
            peer.ctl = self._word_xfer(peer, self._ctl[i], "version words")
            index = ExposedIndex.decode(exposed.index)
            peer.phases = [[self._pull_xfers(peer, index, phase_messages, slot) for slot in range(self.slots)]
                           for phase_messages in messages]
            if self._peer_changes:
                changes = self._peer_changes[i]
                table = changes.table
                changes.reads = [self._prepare_xfer(peer, "READ", Descriptors.of(
                    [table.data_ptr()], [changes.area + changes.layout.at + slot * table.numel() * 8],
                    [table.numel() * 8]), f"slot {slot}'s change table", data=False) for slot in range(self.slots)]
        if self._changes is not None:
            self._changes.prepared(len(parts))
        self.setup["prepare_xfers_seconds"] = time.perf_counter() - t0

    def _changes_of(self, parts: list[Plan]) -> list[PeerChanges]:
        """Per writer, where its changes are published and which of its pieces this reader takes;
        sizes the reader's own buffers (a used change area, a piece read whole)."""
        out, capacity, whole = [], 0, 0
        for peer in self._peers:
            exposed = self._slots_of(peer)
            assert exposed.changes is not None, "checked before connecting (_writer_agrees)"
            layout = ChangeLayout.from_header(exposed.changes, writer=peer.rank)
            index = ExposedIndex.decode(exposed.index)
            rows = {key: 1 + i for i, key in enumerate(index.entries)}
            ops = [[(op, rows[piece_key(op)], index.locate(op, peer.rank)[0])
                    for op in part.ops_between(peer.rank, self.ctx.rank)] for part in parts]
            out.append(PeerChanges(layout, exposed.area, torch.zeros(layout.rows, COLUMNS, dtype=torch.int64), [],
                                   ops))
            capacity = max(capacity, layout.capacity)
            whole = max([whole, *(op.nbytes for phase in ops for op, _, _ in phase)])
        self._change_buf = torch.empty(capacity, dtype=torch.uint8)
        self._whole_buf = torch.empty(whole, dtype=torch.uint8)
        return out

    def _pull_xfers(self, peer: Peer, index: ExposedIndex, messages: list[Message],
                    slot: int) -> list[tuple[Xfer, Message | None]]:
        """READs of one slot: all dense destinations in one request, then one per staged message."""
        exposed = self._slots_of(peer)
        area = exposed.area + slot * exposed.slot_bytes

        def remote(piece: Piece) -> int:
            at, nbytes = index.locate(piece.op, peer.rank)
            if nbytes != piece.op.nbytes:
                raise TransportError(f"{self.who}: {peer.label} exposes {nbytes} bytes for {piece.op.canonical} "
                                     f"{piece.op.box}, this reader expects {piece.op.nbytes}")
            return area + at + slab_offset(piece)

        out: list[tuple[Xfer, Message | None]] = []
        direct = [p for m in messages if m.direct for p in m.pieces]
        if direct:
            local = [self._flats[p.op.dst_shard].data_ptr() + p.dst_offset * itemsize(p.op.dst_dtype) for p in direct]
            descs = Descriptors.of(local, [remote(p) for p in direct], [p.nbytes for p in direct],
                                   local_starts=self._starts)
            out.append((self._prepare_xfer(peer, "READ", descs, f"slot {slot} into destination tensors"),
                        Message(tuple(direct), sum(p.nbytes for p in direct), direct=True)))
        for m in messages:
            if not m.direct:
                assert self._landing is not None
                landing = self._landing.data_ptr()
                descs = Descriptors.of([landing + p.at for p in m.pieces], [remote(p) for p in m.pieces],
                                       [p.nbytes for p in m.pieces])
                out.append((self._prepare_xfer(peer, "READ", descs, f"slot {slot} into the landing buffer"), m))
        return out

    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        self._prepared_agent("receive")
        self.check_phase(phase)
        stats, timer = self.new_stats(version)
        slot = version % self.slots
        with timer("wait"):
            for i, peer in enumerate(self._peers):
                self._wait_slot(i, peer, version, deadline)
        # the NIC writes outside stream order: kernels queued on our tensors (the engine's last
        # forward, the previous phase's loads) must be done before the first READ lands
        self.dev.synchronize(self.device)
        digests = {}
        for i, peer in enumerate(self._peers):
            if self._peer_changes and self._peer_changes[i].ops[phase]:
                digests[peer.rank] = self._read_changes(peer, self._peer_changes[i], version, phase,
                                                        deadline=deadline, stats=stats, timer=timer)
            else:
                self._read_whole(peer, phase, slot, deadline=deadline, stats=stats, timer=timer)
        with timer("verify"):
            for i, peer in enumerate(self._peers):
                assert peer.ctl is not None
                self._run(peer, peer.ctl, deadline)
                held = int(self._ctl[i, slot])
                if held != version:
                    raise TransportError(self._stale(peer, version, held) + " (overwritten while reading)")
        stats.peak_extra_bytes = 0 if self._landing is None else self._landing.numel()
        if self._changes is not None:
            for writer, received in digests.items():
                self._changes.received((phase, writer), version, received)
            stats.peak_extra_bytes += self._changes.extra_bytes() + self._change_buf.numel() + self._whole_buf.numel()
        return stats

    def _read_whole(self, peer: Peer, phase: int, slot: int, *, deadline: Deadline, stats: TransferStats,
                    timer: PhaseTimer) -> None:
        """READ the phase's ops of ``peer`` from the slot in full (the prepared transfers)."""
        for xfer, message in peer.phases[phase][slot]:
            with timer("transfer"):
                self._run(peer, xfer, deadline)
            stats.nbytes += xfer.nbytes
            stats.messages += 1
            if message is None or message.direct:  # READ straight into the destination tensors
                stats.direct_bytes += xfer.nbytes
                if self._digests is not None and message is not None:
                    with timer("digest"):  # while the bytes just arrived may still be in cache
                        for piece in message.pieces:
                            self._digests.arrived(piece.op, dst_view(self._flats, piece))
                continue
            assert self._landing is not None
            with timer("unpack"):
                scatter(message, self._flats, self._landing[: message.nbytes], copy=self.dev.copy,
                        digests=self._digests)
                self.dev.synchronize(self.device)  # the next READ reuses the landing buffer

    def _read_changes(self, peer: Peer, changes: PeerChanges, version: int, phase: int, *, deadline: Deadline,
                      stats: TransferStats, timer: PhaseTimer) -> list[int]:
        """Bring the phase's ops of ``peer`` to ``version``: only its changes when this reader
        vouches for their base, else in full. Returns the writer's digest of each op's new bytes."""
        assert self._changes is not None
        slot, ops, key = version % self.slots, changes.ops[phase], (phase, peer.rank)
        with timer("vouch"):
            base = self._changes.vouch(key, [op for op, _, _ in ops], self._flats)
        shadow = self._changes.shadow_of(key, [op for op, _, _ in ops])
        with timer("transfer"):
            self._run(peer, changes.reads[slot], deadline)
        table = changes.table
        if int(table[0, VERSION]) != version:
            raise TransportError(f"{self.who}: {peer.label}'s change table in slot {slot} holds version "
                                 f"{int(table[0, VERSION])}, not {version}")
        rows = [table[row].tolist() for _, row, _ in ops]
        if base < 0 or int(table[0, BASE]) != base:
            self._read_whole(peer, phase, slot, deadline=deadline, stats=stats, timer=timer)
            for (op, _, _), own in zip(ops, shadow or (), strict=False):  # the reader's own copy of each op
                own.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes).copy_(op_dst_view(self._flats, op))
            return [row[DIGEST] for row in rows]
        used = int(table[0, USED])
        if not 0 <= used <= min(changes.layout.capacity, self._change_buf.numel()):
            raise TransportError(f"{self.who}: {peer.label} published {used} bytes of changes in slot {slot}, "
                                 f"more than its change area holds ({changes.layout.capacity})")
        agent = self._prepared_agent("receive")
        if used:
            with timer("transfer"):
                stats.nbytes += agent.run_once("READ", peer.agent, Descriptors.of(
                    [self._change_buf.data_ptr()], [changes.change_area(slot)], [used]), "DRAM", deadline,
                    what=f"slot {slot}'s changes", alive=peer.watch.check)
        slot_at = changes.area + slot * self._slots_of(peer).slot_bytes
        for index, ((op, _, at), row) in enumerate(zip(ops, rows, strict=True)):
            kept = None if shadow is None else shadow[index]
            if row[KIND] == Kind.DENSE:  # this piece changed too much to be smaller as a delta
                whole = self._whole_buf[: op.nbytes]
                with timer("transfer"):
                    stats.nbytes += agent.run_once("READ", peer.agent, Descriptors.of(
                        [whole.data_ptr()], [slot_at + at], [op.nbytes]), "DRAM", deadline,
                        what=f"{op.canonical} {op.box} in slot {slot}", alive=peer.watch.check)
                with timer("unpack"):
                    self._changes.copy(op, whole.view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes), self._flats,
                                       shadow=kept)
            else:
                check_row(row, op, used, reader=self.ctx.rank, writer=peer.rank)
                with timer("unpack"):
                    self._changes.apply(op, row, self._change_buf[row[OFFSET]: row[OFFSET] + row[NBYTES]],
                                        self._flats, writer=peer.rank, shadow=kept)
            stats.messages += 1
        return [row[DIGEST] for row in rows]

    def forget_received(self) -> None:
        if self._changes is not None:
            self._changes.forget()

    def _wait_slot(self, i: int, peer: Peer, version: int, deadline: Deadline) -> None:
        """READ the writer's sequence words until the slot holds ``version`` (this also
        notices a dead writer: the READ fails)."""
        assert self._agent is not None and peer.ctl is not None
        while True:
            self._run(peer, peer.ctl, deadline)
            held = int(self._ctl[i, version % self.slots])
            if held == version:
                return
            if held > version or deadline.expired:
                raise TransportError(self._stale(peer, version, held))
            peer.watch.check(f"version {version} in {peer.label}'s NIXL slot")
            time.sleep(0.001)

    def _stale(self, peer: Peer, version: int, held: int) -> str:
        what = "not written yet" if held < version else f"already replaced by version {held}"
        return (f"{self.who}: version {version} in {peer.label}'s NIXL slot is {what}; "
                f"readers may fall at most {self.slots - 1} version(s) behind")


