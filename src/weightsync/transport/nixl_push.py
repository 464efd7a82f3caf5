"""NIXL transport, push mode: writers WRITE straight into readers' registered parameters.

The protocol (ready words, notifications carrying the version) and when push is chosen:
:mod:`weightsync.transport.nixl_common`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from weightsync.deadline import Deadline
from weightsync.job_wire import WireError
from weightsync.layout.types import itemsize
from weightsync.transport.base import PhaseTimer, TransferStats, TransportError, check_phase
from weightsync.transport.exposed import piece_key
from weightsync.transport.nixl_agent import Descriptors, Xfer
from weightsync.transport.nixl_common import (
    EMPTY,
    MAX_PHASES,
    NixlBase,
    Peer,
    contiguous_runs,
    extent,
    phase_token,
    row_major,
    send_live,
)

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp
    from weightsync.transport.schedule import Message

#: How often a waiting reader checks that the writers it waits for are alive.
_PROBE_S = 0.05


class NixlPushTransport(NixlBase):
    """Push mode of the NIXL transport (see module docstring)."""

    one_sided: ClassVar[bool] = False
    publishes_before_send: ClassVar[bool] = True  # readers raise their ready words on receive
    mode: ClassVar[str] = "push"

    # -- writer -----------------------------------------------------------------------------
    def _prepare_writer(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        me = self.ctx.rank
        ops = [op for part in parts for op in part.ops if op.src_rank == me]
        self._exposed(parts, keep=lambda op: not send_live(op))
        assert self._index is not None
        self._area = self.dev.empty(max(self._index.total_bytes, 64), self.device, what=f"{self.who}'s NIXL pack area")
        readers = sorted({op.dst_rank for op in ops})
        self._ctl = torch.full((1 + len(readers),), EMPTY, dtype=torch.int64)  # own word, readers' ready words
        live = sorted({op.src_shard for op in ops if send_live(op)})
        self._register([self._area, *(self._flats[name] for name in live)], words=self._ctl)
        self._publish(epoch)
        self._peers = [self._connect(epoch, "reader", r, deadline) for r in readers]
        t0 = time.perf_counter()
        for i, peer in enumerate(self._peers):
            peer.ctl = self._word_xfer(peer, self._ctl[1 + i: 2 + i], "ready word")
            peer.phases = []
            for p, part in enumerate(parts):
                mine = part.ops_between(me, peer.rank)
                xfers: list[tuple[Xfer, Message | None]] = (
                    [(self._prepare_xfer(peer, "WRITE", self._runs(peer, mine), f"phase {p}"), None)] if mine else [])
                peer.phases.append([xfers])
        self.setup["prepare_xfers_seconds"] = time.perf_counter() - t0

    def _runs(self, peer: Peer, ops: list[TransferOp]) -> Descriptors:
        """One descriptor per run contiguous in both the source and the reader's tensor."""
        assert self._area is not None and self._index is not None
        try:
            shards = peer.endpoint.destination_shards(peer.label)
        except WireError as exc:
            raise TransportError(f"{self.who}: {exc}") from exc
        local, remote, lengths = [], [], []
        for op in ops:
            size = itemsize(op.dst_dtype)
            addr, nbytes = shards[op.dst_shard]
            if extent(op.box.sizes, op.dst_strides, op.dst_offset) * size > nbytes:
                raise TransportError(f"{self.who}: {peer.label}'s tensor {op.dst_shard} has {nbytes} bytes, too "
                                     f"few for {op.canonical} {op.box}: writer and reader disagree on layouts")
            if send_live(op):
                src, src_strides = self._flats[op.src_shard].data_ptr() + op.src_offset * size, op.src_strides
            else:
                at = self._index.entries[piece_key(op)][0]
                src, src_strides = self._area.data_ptr() + at, row_major(op.box.sizes)
            a, b, run = contiguous_runs(op.box.sizes, src_strides, op.dst_strides)
            local.append(src + a * size)
            remote.append(addr + (op.dst_offset + b) * size)
            lengths.append(np.full(len(a), run * size, dtype=np.int64))
        if not ops:
            return Descriptors.of([], [], [])
        # the reader registers the storages behind its tensors; a range that begins where one
        # storage begins begins a tensor, so never joining at a tensor's start keeps them apart
        return Descriptors.of(np.concatenate(local), np.concatenate(remote), np.concatenate(lengths),
                              local_starts=self._starts, remote_starts=[addr for addr, _ in shards.values()])

    def send(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        self._prepared_agent("send")
        check_phase(phase, self._phases, self.who)
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        deadline = Deadline.after(timeout)
        token = phase_token(version, phase)
        with timer("pack"):
            self._pack(0, phase)
        for i, peer in enumerate(self._peers):
            xfers = peer.phases[phase][0]
            if not xfers:
                continue
            with timer("wait"):
                self._wait_ready(i, peer, token, deadline)
            for xfer, _ in xfers:
                with timer("transfer"):
                    self._run(peer, xfer, deadline, notif=b"v%d" % token)
                stats.nbytes += xfer.nbytes
                stats.direct_bytes += xfer.nbytes
                stats.messages += 1
        if phase == self._phases - 1:
            self._ctl[0] = version
        stats.peak_extra_bytes = self._index.total_bytes if self._index is not None else 0
        return stats

    def _wait_ready(self, i: int, peer: Peer, token: int, deadline: Deadline) -> None:
        """Until the reader asks for exactly this (version, phase) (see :func:`phase_token`)."""
        assert self._agent is not None and peer.ctl is not None
        want = f"version {token >> 12} phase {token & (MAX_PHASES - 1)}"
        while True:
            self._run(peer, peer.ctl, deadline)
            ready = int(self._ctl[1 + i])
            if ready == token:
                return
            asked = f"version {ready >> 12} phase {ready & (MAX_PHASES - 1)}" if ready >= 0 else "nothing"
            if ready > token:
                raise TransportError(f"{self.who}: {peer.label} waits for {asked}, this writer sends {want}; "
                                     "writers and readers are out of step")
            if deadline.expired:
                raise TransportError(f"{self.who}: {peer.label} did not ask for {want} in time (its last request "
                                     f"was {asked})")
            peer.watch.check(f"{peer.label} to ask for {want}")
            time.sleep(0.001)

    # -- reader -----------------------------------------------------------------------------
    def _prepare_reader(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        writers = sorted({op.src_rank for part in parts for op in part.ops})
        self._ctl = torch.full((1 + len(writers),), EMPTY, dtype=torch.int64)  # ready word, liveness mirrors
        self._register(list(self._flats.values()), words=self._ctl)
        self._publish(epoch, shards={name: (t.data_ptr(), t.numel() * t.element_size())
                                     for name, t in self._flats.items()})
        self._peers = [self._connect(epoch, "writer", w, deadline) for w in writers]
        for i, peer in enumerate(self._peers):
            peer.ctl = self._word_xfer(peer, self._ctl[1 + i: 2 + i], "liveness word")
            peer.nbytes = [sum(op.nbytes for op in part.ops_between(peer.rank, self.ctx.rank)) for part in parts]

    def receive(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        agent = self._prepared_agent("receive")
        check_phase(phase, self._phases, self.who)
        stats = TransferStats(version)
        deadline = Deadline.after(timeout)
        token = phase_token(version, phase)
        pending = {peer.agent: peer for peer in self._peers if peer.nbytes[phase]}
        # writers poll this word before they WRITE into our tensors, outside stream order: what
        # is queued on them (the engine's last forward, the previous phase's loads) completes first
        self.dev.synchronize(self.device)
        self.dev.signal(self._ctl, 0, token, covers=list(self._flats.values()))
        next_probe = time.monotonic() + _PROBE_S
        with PhaseTimer(stats)("transfer"):
            while pending:
                for name, messages in agent.take_notifs(timeout=0.005).items():
                    if name in pending and any(_notif_token(m) >= token for m in messages):
                        peer = pending.pop(name)
                        stats.nbytes += peer.nbytes[phase]
                        stats.direct_bytes += peer.nbytes[phase]
                        stats.messages += 1
                now = time.monotonic()
                if deadline.expired:
                    names = ", ".join(p.label for p in pending.values())
                    raise TransportError(f"{self.who}: version {version} did not arrive from {names} in time")
                if now > next_probe:  # a dead writer never notifies; READing its word fails (or hangs)
                    for peer in list(pending.values()):
                        assert peer.ctl is not None
                        self._run(peer, peer.ctl, deadline)
                        peer.watch.check(f"version {version} from {peer.label}")
                    next_probe = now + _PROBE_S
        return stats


def _notif_token(message: bytes) -> int:
    try:
        return int(message[1:]) if message[:1] == b"v" else -1
    except ValueError:
        return -1
