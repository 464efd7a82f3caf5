"""NIXL transport, pull mode: readers READ versions from writers' registered slots.

The protocol and when pull is chosen: :mod:`weightsync.transport.nixl_common`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

import torch

from weightsync import device_port
from weightsync.deadline import Deadline
from weightsync.job_wire import WireError
from weightsync.layout.types import itemsize
from weightsync.transport.base import PhaseTimer, TransferStats, TransportError, check_phase
from weightsync.transport.endpoints import NixlSlots
from weightsync.transport.exposed import ExposedIndex
from weightsync.transport.nixl_agent import Descriptors, Xfer
from weightsync.transport.nixl_common import EMPTY, NixlBase, Peer, slab_offset
from weightsync.transport.schedule import Message, Piece, build_messages
from weightsync.transport.tensors import scatter

if TYPE_CHECKING:
    from weightsync.plan import Plan


class NixlPullTransport(NixlBase):
    """Pull mode (see module docstring)."""

    one_sided: ClassVar[bool] = True
    publishes_before_send: ClassVar[bool] = False  # published once the slot is packed
    mode: ClassVar[str] = "pull"

    # -- pull: writer -----------------------------------------------------------------------
    def _prepare_writer(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        self._exposed(parts)
        assert self._index is not None
        self._slot_bytes = max(self._index.total_bytes, 64)
        self._area = device_port.allocate(
            self.dev, self.slots * self._slot_bytes, self.device,
            what=f"{self.who}'s NIXL version slots ({self.slots} x {device_port.gib(self._slot_bytes)})",
            fix="use fewer TransportOptions.slots, or nixl_mode='push' (which packs only what is not sent live)")
        self._ctl = torch.full((self.slots,), EMPTY, dtype=torch.int64)
        self._register([self._area], words=self._ctl)
        self._publish(epoch, slots=NixlSlots(self._area.data_ptr(), self.slots, self._slot_bytes, self._index.encode()))

    def send(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        if self._area is None:
            raise RuntimeError(f"{self.who}: send() before prepare()")
        check_phase(phase, self._phases, self.who)
        stats = TransferStats(version)
        slot = version % self.slots
        if phase == 0:
            self._ctl[slot] = EMPTY  # a reader of the old version in this slot will notice
        with PhaseTimer(stats)("pack"):
            stats.nbytes = self._pack(slot * self._slot_bytes, phase)
        if phase == self._phases - 1:  # readers read every phase once the whole slot is packed
            area = self._area[slot * self._slot_bytes: (slot + 1) * self._slot_bytes]
            self.dev.signal(self._ctl, slot, version, covers=[area])
        stats.messages = len(self._copies[phase])
        stats.peak_extra_bytes = self.slots * self._slot_bytes
        return stats

    # -- pull: reader -----------------------------------------------------------------------
    def _slots_of(self, peer: Peer) -> NixlSlots:
        try:
            return peer.endpoint.exposed_slots(peer.label)
        except WireError as exc:
            raise TransportError(f"{self.who}: {exc}") from exc

    def _prepare_reader(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        opts = self.ctx.options
        writers = sorted({op.src_rank for part in parts for op in part.ops})
        self._peers = [self._connect(epoch, "writer", w, deadline) for w in writers]
        schedules = [[build_messages(part.ops_between(p.rank, self.ctx.rank), message_bytes=opts.message_bytes,
                                     direct_min_bytes=opts.direct_min_bytes) for part in parts] for p in self._peers]
        staged = max((m.nbytes for per_phase in schedules for ms in per_phase for m in ms if not m.direct),
                     default=0)
        self._landing = (self.dev.empty(staged, self.device, what=f"{self.who}'s NIXL landing buffer") if staged
                         else None)
        self._ctl = torch.full((len(self._peers), self.slots), EMPTY, dtype=torch.int64)
        self._register([*self._flats.values(), *([] if self._landing is None else [self._landing])], words=self._ctl)
        t0 = time.perf_counter()
        for i, (peer, messages) in enumerate(zip(self._peers, schedules, strict=True)):
            exposed = self._slots_of(peer)
            if exposed.slots != self.slots:
                raise TransportError(f"{self.who}: {peer.label} has {exposed.slots} version slots, this "
                                     f"reader {self.slots}; use the same TransportOptions.slots everywhere")
            peer.ctl = self._word_xfer(peer, self._ctl[i], "version words")
            index = ExposedIndex.decode(exposed.index)
            peer.phases = [[self._pull_xfers(peer, index, phase_messages, slot) for slot in range(self.slots)]
                           for phase_messages in messages]
        self.setup["prepare_xfers_seconds"] = time.perf_counter() - t0

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
            out.append((self._prepare_xfer(peer, "READ", descs, f"slot {slot} into destination tensors"), None))
        for m in messages:
            if not m.direct:
                assert self._landing is not None
                landing = self._landing.data_ptr()
                descs = Descriptors.of([landing + p.at for p in m.pieces], [remote(p) for p in m.pieces],
                                       [p.nbytes for p in m.pieces])
                out.append((self._prepare_xfer(peer, "READ", descs, f"slot {slot} into the landing buffer"), m))
        return out

    def receive(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        self._prepared_agent("receive")
        check_phase(phase, self._phases, self.who)
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        deadline = Deadline.after(timeout)
        slot = version % self.slots
        with timer("wait"):
            for i, peer in enumerate(self._peers):
                self._wait_slot(i, peer, version, deadline)
        # the NIC writes outside stream order: kernels queued on our tensors (the engine's last
        # forward, the previous phase's loads) must be done before the first READ lands
        self.dev.synchronize(self.device)
        for peer in self._peers:
            for xfer, message in peer.phases[phase][slot]:
                with timer("transfer"):
                    self._run(peer, xfer, deadline)
                stats.nbytes += xfer.nbytes
                stats.messages += 1
                if message is None:
                    stats.direct_bytes += xfer.nbytes
                    continue
                assert self._landing is not None
                with timer("unpack"):
                    scatter(message, self._flats, self._landing[: message.nbytes], copy=self.dev.copy)
                    self.dev.synchronize(self.device)  # the next READ reuses the landing buffer
        with timer("verify"):
            for i, peer in enumerate(self._peers):
                assert peer.ctl is not None
                self._run(peer, peer.ctl, deadline)
                held = int(self._ctl[i, slot])
                if held != version:
                    raise TransportError(self._stale(peer, version, held) + " (overwritten while reading)")
        stats.peak_extra_bytes = 0 if self._landing is None else self._landing.numel()
        return stats

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


