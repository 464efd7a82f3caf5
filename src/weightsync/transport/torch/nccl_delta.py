"""Delta sync over the NCCL transport: :class:`weightsync.transport.delta.pairs.DeltaSync` on GPU memory.

The exchange is gloo's (:mod:`weightsync.transport.delta.pairs`); what changes on a GPU is where the
bytes are and when they may be touched:

* **Codec on the device.** The writer's copy of what it sent (one per writer-reader pair:
  the bytes of every message sent to that reader, so the writer's exposed bytes times the
  readers each byte goes to, as gloo keeps in host memory) lives on the writer's GPU, as do
  the reader's shadows when its destination does not keep what it received. Encode and apply
  are torch kernels (:mod:`weightsync.tools.codecs.delta_device`), and the vouch digest is sum64
  (:mod:`weightsync.tools.codecs.digest`: elementwise kernels and one reduction). :func:`check_fits`
  refuses the copies at ``prepare`` when they do not fit the device's free memory, with the
  figure and the setting to change, so a sync never fails with an out-of-memory error.
* **Headers read on the CPU.** A batch's payload size is only known from its header, so each
  header is its own receive (into device memory, as NCCL requires), then a device-to-host
  copy, an event and a CPU wait on it, through the device port: the CPU reads the header only
  after the stream finished writing it (the device model checks that the host copy has no
  pending writes when the CPU reads it). The int64 tensors of the exchange (the base version,
  header rows) are these control words; uint8 tensors are payloads and stay on the device.
* **One operation per NCCL group, waited for before its memory is reused.** Each post is a
  group of one operation on the transport's own communicator, on the current stream (as every
  round of the full path); ``wait`` blocks the CPU on an event recorded after it, so a staging
  buffer is refilled only once NCCL is done with it (the device model checks each buffer
  handed out has no pending reads or writes). Every CPU wait is under the transport's
  :class:`~weightsync.transport.torch.nccl_comm.Watchdog`: a dead peer, NCCL's error or the deadline
  aborts the communicator, the wait returns, and the sync fails naming why.

Pairs run one after another in the schedule's global order (:func:`weightsync.transport.schedule.pair_order`),
which every rank follows, so no rank waits on a pair its peer has not reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from weightsync.ports.device import check_fits
from weightsync.transport.delta.pairs import LINK_BUFFERS, DeltaSync
from weightsync.transport.torch.common import TorchPairLink
from weightsync.transport.torch.nccl_comm import P2P, Communicator

if TYPE_CHECKING:
    from weightsync.transport.base import PhaseTimer, TransferStats
    from weightsync.transport.schedule import Message
    from weightsync.transport.torch.common import Pair, TorchDistBase


class Watchdog(Protocol):
    """What the link asks of :class:`weightsync.transport.torch.nccl_comm.Watchdog`."""

    @property
    def fired(self) -> bool:
        """Whether it aborted the communicator."""
        ...


def delta_sync(transport: TorchDistBase) -> DeltaSync:
    """The transport's delta state, its copies and shadows allocated on its device."""
    dev, device = transport.dev, transport.device
    return DeltaSync(transport.ctx, allocate=lambda nbytes, what: dev.empty(nbytes, device, what=what))


def check_delta_memory(transport: TorchDistBase, delta: DeltaSync) -> None:
    """Refuse at ``prepare`` what the delta state will keep on the device if it does not fit.

    The writer keeps a copy of the bytes it sends to each reader; a reader whose destination
    does not keep what it received keeps a shadow of its share (module docstring). Both are
    counted here for every phase, plus the link's staging buffers.

    Raises:
        DeviceMemoryError: naming the figure, what is free, and the setting to change.
    """
    messages = sum(m.nbytes for schedule in transport._schedules for pair in schedule for m in pair.messages)
    staging = LINK_BUFFERS * transport._message_bytes
    role = transport.ctx.role
    if role == "writer":
        what = f"{transport.ctx.who}'s delta copies of the bytes it sends (one per reader it sends to) and staging"
    elif not delta.holds_versions:
        what = f"{transport.ctx.who}'s delta shadow of the bytes it receives (its destination does not keep them)"
    else:
        messages = 0
        what = f"{transport.ctx.who}'s delta staging"
    held = delta.extra_bytes() + sum(int(b.numel()) for b in transport._buffers.values())
    check_fits(transport.dev, max(0, messages + staging - held), transport.device, what=what,
               fix="set delta_anchor_every=0 (full versions need none of it), or free device memory")


def move_pairs(transport: TorchDistBase, delta: DeltaSync, comm: Communicator, schedule: list[Pair], dog: Watchdog,
               *, sending: bool, phase: int, stats: TransferStats, timer: PhaseTimer) -> None:
    """Run every pair's delta exchange, in schedule order (module docstring)."""
    for pair in schedule:
        link = NcclLink(transport, comm, pair, dog, timer)
        exchange = delta.send_pair if sending else delta.receive_pair
        exchange(link, pair.messages, transport._flats, phase=phase, stats=stats, timer=timer)


@dataclass
class _Posted:
    op: Literal["send", "recv"]
    tensor: torch.Tensor  # what the exchange posted (a host control word, or device payload)
    staged: torch.Tensor  # what NCCL moves (the device copy of a control word, else ``tensor``)
    message: Message


@dataclass(frozen=True)
class NcclLink(TorchPairLink):
    """One pair as :class:`weightsync.transport.delta.pairs.PairLink` on the transport's communicator."""

    transport: TorchDistBase
    comm: Communicator
    pair: Pair
    dog: Watchdog
    timer: PhaseTimer

    def post(self, op: Literal["send", "recv"], tensor: torch.Tensor, message: Message, *, tag: int) -> _Posted:
        t = self.transport
        staged = tensor
        if tensor.dtype == torch.int64:  # a control word: the CPU writes or reads it (module docstring)
            staged = t.dev.empty(tensor.numel() * 8, t.device, what="a delta header").view(torch.int64)
            if op == "send":
                t.dev.copy(staged, tensor.reshape(-1))  # on the stream the send goes on, before it
        else:
            t.dev.touch(staged, write=op == "recv")  # no other stream's work may still use it
        self.comm.post([P2P(op, staged, self.pair.peer_global)])  # NCCL has no tags: posting order matches
        return _Posted(op, tensor, staged, message)

    def wait(self, posted: _Posted) -> None:
        """The operation completed and, for a received control word, its bytes are in host memory."""
        t = self.transport
        control = posted.staged is not posted.tensor
        if control and posted.op == "recv":
            t.dev.copy(posted.tensor.reshape(-1), posted.staged)
        with self.timer("transfer"):
            t.dev.wait(t.dev.record(t.device))
        if self.dog.fired:  # aborted: the wait returned without the bytes (torch_nccl._move says why)
            raise RuntimeError(f"the NCCL communicator was aborted during {posted.message.describe()}")
        if control and posted.op == "recv":
            t.dev.touch(posted.tensor, write=False)  # the CPU reads the header next

    def buffer(self, slot: int) -> torch.Tensor:
        buffer = self.transport._buffer(0, slot)
        self.transport.dev.touch(buffer, write=True)  # refilled only once NCCL is done with it
        return buffer
