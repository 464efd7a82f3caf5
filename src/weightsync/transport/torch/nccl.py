"""The torch transport between GPUs: p2p over a NCCL communicator of its own, grouped rounds, one event, a watchdog.

Written to be right by construction, since no GPU has run it yet; ``weightsync doctor``
checks it on the first machine that has one. What it does, and the facts it rests on:

* **One communicator of our own, made eagerly, no torch process group.** The rendezvous is
  torch's (the epoch's TCPStore, :class:`~weightsync.transport.torch.common.TorchDistBase`), the
  communicator is NCCL's, driven through nccl4py (:mod:`weightsync.transport.torch.nccl_comm`, which
  cites the calls): rank 0's ``ncclUniqueId`` goes through the store as raw bytes and every
  rank joins at the first ``bind`` of an epoch (``connect`` opens the rendezvous's epoch; the
  plan, which bind brings, says how many peers NCCL's buffers serve), bound to its device,
  under a deadline.
  Not torch's ``ProcessGroupNCCL``: torch 2.13 starts a watchdog thread for each one, which on
  an asynchronous NCCL error of the group (a dead peer across the network: ``ncclRemoteError``;
  or the error our own abort of a hung round leaves) raises the process-wide dump signal and
  rethrows on its own thread under the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``
  (``std::terminate``): a dead rollout worker would kill the trainer. The only switch is
  ``TORCH_NCCL_BLOCKING_WAIT``, which the constructor reads with ``getenv``;
  ``ProcessGroupNCCL::Options`` holds ``is_high_priority_stream``, ``config``, ``split_from``
  and ``split_color`` and nothing for it (``ProcessGroupNCCL.hpp``). Writing the environment
  around the constructor raced every native thread that reads it and every group built
  meanwhile on another thread (issue 23, defect 10). Our communicator has no watchdog but ours,
  and nothing here reads or writes ``os.environ`` (docs/gpu.md, "NCCL: what weightsync does").
* **Pairs concurrently, each pair's messages grouped.** Every pair's messages are cut into
  windows (at most one staged message and :data:`WINDOW` messages each); round ``k`` is
  window ``k`` of *every* pair of this rank, posted as one NCCL group
  (``ncclGroupStart``/``ncclGroupEnd``). A peer holds window ``k`` of the pair in its own round
  ``k``, so every rank's round ``k`` completes once its peers reach round ``k``: no deadlock
  whatever the fan-in or fan-out. NCCL matches a pair's sends and receives in posting order
  (it has no tags), and both ends post a pair's messages in the same order.
* **No CPU polling.** Every send and receive goes on torch's current stream, so packing the
  next round and scattering the last run on the GPU in order; the CPU blocks once, on a
  blocking-sync CUDA event recorded after the last round.
* **Timeouts abort, they never kill.** A :class:`~weightsync.transport.torch.nccl_comm.Watchdog`
  thread aborts the communicator (``ncclCommAbort``) if the sync (posting included: a
  non-blocking group end connects a pair on first use) has not completed by the deadline, as
  soon as the job channel reports a peer dead (NCCL has no peer watch of its own), or as soon
  as NCCL reports an asynchronous error; aborted NCCL kernels end, the event completes, and
  the sync raises :class:`TransportError` naming the peers and why. The communicator's connect
  runs under one too. The next version runs in a new epoch with a new communicator.

Staging: one buffer of ``max_bucket_bytes / 16`` per pair (a window holds at most one staged
message), so peak extra memory is within ``max_bucket_bytes`` up to 16 peers per rank. It is
laid out at ``bind``, and NCCL's own connection buffers (:func:`nccl_device_bytes`) are
checked against the device's free memory before the communicator forms: a shortfall is
refused there with its figure, never an out-of-memory error inside a version.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from weightsync.clock.deadline import Deadline
from weightsync.ports import device as device_port
from weightsync.transport.base import TransferStats, TransportError
from weightsync.transport.schedule import Message
from weightsync.transport.tensors import as_bytes, checksum, direct_source, dst_view, pack, scatter
from weightsync.transport.torch.common import Pair, TorchDistBase
from weightsync.transport.torch.nccl_comm import P2P, Communicator, Watchdog, connect
from weightsync.transport.torch.nccl_delta import check_delta_memory, delta_sync, move_pairs

if TYPE_CHECKING:
    from weightsync.plan import Plan
    from weightsync.transport.base import TransportContext
    from weightsync.transport.digests import VersionDigests

logger = logging.getLogger(__name__)

#: Messages of one pair in one round (at most one of them staged).
WINDOW = 8

#: NCCL's device memory for one p2p connection (one channel, one direction) at its defaults
#: (NCCL ``src/init.cc``): the Simple protocol's ``DEFAULT_BUFFSIZE`` (4 MiB), LL's
#: 8 lines x 512 threads x 8 steps x 16 bytes, LL128's 120 x 640 threads x 8 steps x 8 bytes.
NCCL_CONNECTION_BYTES = (4 << 20) + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8
#: Channels NCCL opens per p2p peer (its ``NCHANNELS_PER_NET_PEER`` default).
NCCL_CHANNELS_PER_PEER = 2
#: A communicator's device memory besides its connections (channel structures, work queues): an
#: upper estimate, not measured on this project's machines (``weightsync doctor`` reports it).
NCCL_COMM_BYTES = 64 << 20


def nccl_device_bytes(peers: int) -> int:
    """Device memory NCCL allocates, outside torch's allocator, for a communicator of ours with
    ``peers`` p2p peers once it connects them: accounted before it forms (:meth:`NcclTransport._bind`)."""
    return NCCL_COMM_BYTES + peers * NCCL_CHANNELS_PER_PEER * NCCL_CONNECTION_BYTES


@dataclass(frozen=True, slots=True)
class Window:
    """Consecutive messages of one pair that travel in one round."""

    pair: int  # index into the rank's schedule
    first: int  # index of the first message in the pair's list
    messages: tuple[Message, ...]


def needs_buffer(message: Message) -> bool:
    """Whether the sender stages ``message``: a packed message, or a direct one whose source is
    strided or converted. Both ends can tell from the plan's ops alone."""
    if not message.direct:
        return True
    (piece,) = message.pieces
    return piece.op.converts or not piece.src_contiguous


def windows_of(messages: Sequence[Message], pair: int, *, window: int = WINDOW) -> list[Window]:
    """Cut a pair's messages into windows of at most ``window`` messages, one staged at most.

    Both ends of a pair compute the same windows from the same messages.
    """
    out: list[Window] = []
    current: list[Message] = []
    first = 0
    staged = 0
    for i, message in enumerate(messages):
        if current and (len(current) == window or (needs_buffer(message) and staged)):
            out.append(Window(pair, first, tuple(current)))
            current, first, staged = [], i, 0
        current.append(message)
        staged += 1 if needs_buffer(message) else 0
    if current:
        out.append(Window(pair, first, tuple(current)))
    return out


def rounds_of(schedule: Sequence[Sequence[Message]], *, window: int = WINDOW) -> list[list[Window]]:
    """Round ``k`` = window ``k`` of every pair (see module docstring: why this cannot deadlock)."""
    per_pair = [windows_of(messages, i, window=window) for i, messages in enumerate(schedule)]
    depth = max((len(w) for w in per_pair), default=0)
    return [[w[k] for w in per_pair if k < len(w)] for k in range(depth)]


class NcclTransport(TorchDistBase):
    """Two-sided p2p over a NCCL communicator of its own (see module docstring)."""

    serves_cpu: ClassVar[bool] = False
    serves_cuda: ClassVar[bool] = True
    carries_deltas: ClassVar[bool] = True  # transport/torch/nccl_delta.py
    #: a digest of GPU memory is queued on the copy's stream, which the device port does not model
    fuses_digests: ClassVar[frozenset[str]] = frozenset()

    def use_digests(self, digests: VersionDigests | None) -> bool:
        return False

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.delta = delta_sync(self) if ctx.options.delta_anchor_every else None

    def _connect(self, epoch: int, deadline: Deadline) -> None:
        """Drop the old communicator; the epoch's forms at its first bind (:meth:`_bind`), once
        the plan says how many peers NCCL's buffers will serve and they were found to fit."""
        self._teardown_group()

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        if self._pg is None:  # connected, the communicator not formed yet: NCCL's buffers must fit first
            me, mine = self.ctx.rank, 0 if self.ctx.role == "writer" else 1
            peers = len({p for p in plan.pairs() if p[mine] == me})
            device_port.check_fits(
                self.dev, nccl_device_bytes(peers), self.device,
                what=f"{self.ctx.who}'s NCCL communicator (connection buffers for {peers} peer(s), allocated by "
                     "NCCL outside torch)",
                fix="leave it free on this GPU (an engine's: a lower gpu_memory_utilization), or give this rank "
                    "fewer peers")
            assert self.epoch is not None, "bind runs within a connected epoch"
            self._pg = self._form_group(self.epoch, deadline)
            logger.info("%s joined transport epoch %d (%d ranks, NCCL)", self.ctx.who, self.epoch,
                        self.ctx.world_size)
        super()._bind(plan, parts, tensors, deadline)
        if self.delta is not None:
            self.delta.prepared(tensors, phases=len(self._schedules))
            check_delta_memory(self, self.delta)
        else:
            self._lay_out_staging()

    def _lay_out_staging(self) -> None:
        """Allocate now, within the device's free memory, the staging buffer of every lane whose
        messages need one, rather than lazily in the middle of a version."""
        lanes = sorted({i for schedule in self._schedules for i, pair in enumerate(schedule)
                        if any(needs_buffer(m) for m in pair.messages)} - {lane for lane, _ in self._buffers})
        device_port.check_fits(
            self.dev, len(lanes) * self._message_bytes, self.device,
            what=f"{self.ctx.who}'s NCCL staging ({len(lanes)} x {device_port.gib(self._message_bytes)})",
            fix="a smaller max_bucket_bytes, or free device memory")
        for lane in lanes:
            self._buffer(lane, 0)

    def _form_group(self, epoch: int, deadline: Deadline) -> Communicator:
        store = self._store_for(epoch, deadline)
        try:
            with self.dev.scope(self.device):  # NCCL binds the communicator to the current device
                return connect(store, rank=self.ctx.global_rank, size=self.ctx.world_size, device=self.device,
                               deadline=deadline)
        except TransportError as exc:
            raise TransportError(f"{self.ctx.who}: epoch {epoch}: {exc}") from exc
        except (RuntimeError, dist.DistError) as exc:
            raise TransportError(f"{self.ctx.who}: NCCL communicator of epoch {epoch} did not form on {self.device}: "
                                 f"{exc}") from exc

    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        return self._move(version, deadline, self._phase_schedule(phase), sending=True, phase=phase)

    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        return self._move(version, deadline, self._phase_schedule(phase), sending=False, phase=phase)

    def _move(self, version: int, deadline: Deadline, schedule: list[Pair], *, sending: bool,
              phase: int = 0) -> TransferStats:
        comm: Communicator | None = self._pg
        if comm is None:
            raise TransportError(f"{self.ctx.who}: no NCCL communicator; call connect() and bind() first")
        stats, timer = self.new_stats(version)
        rounds = rounds_of([pair.messages for pair in schedule])
        sums: dict[int, dict[int, int]] = {i: {} for i in range(len(schedule))}
        other = "reader" if self.ctx.role == "writer" else "writer"
        watch = self.peer_watch(other, [p.peer for p in schedule])  # type: ignore[arg-type]
        # posting waits too: the end of a group connects a pair on its first use
        dog = Watchdog(deadline, comm.abort, watch, health=comm.error)
        try:
            with self.dev.scope(self.device), dog:
                if self.delta is not None:  # pair by pair, only what changed (transport/torch/nccl_delta.py)
                    move_pairs(self, self.delta, comm, schedule, dog, sending=sending, phase=phase, stats=stats,
                               timer=timer)
                else:
                    with timer("post"):
                        for windows in rounds:
                            self._round(comm, schedule, windows, sending=sending, stats=stats, sums=sums)
                        if self.ctx.options.checksum:
                            self._checksums(comm, schedule, sending, sums)
                        done = self.dev.record(self.device)
                    with timer("transfer"):
                        self.dev.wait(done)
        except Exception as exc:  # whatever failed, the communicator may be mid-operation: never reuse it
            self._teardown_group()
            if isinstance(exc, TransportError) and exc.__cause__ is None:
                raise
            peers = ", ".join(self._peer_label(p.peer) for p in schedule)
            # an aborted communicator fails what it was doing: then say why it was aborted
            why = f"{dog.reason()}; the NCCL communicator was aborted" if dog.fired else str(exc)
            raise TransportError(f"{self.ctx.who}: version {version} failed with {peers}: {why}") from exc
        if dog.fired:
            self._teardown_group()  # aborted: the next epoch forms a new communicator
            raise TransportError(f"{self.ctx.who}: version {version} failed with "
                                 f"{', '.join(self._peer_label(p.peer) for p in schedule)}: {dog.reason()}; "
                                 "the NCCL communicator was aborted")
        stats.peak_extra_bytes = self._extra_bytes()
        return stats

    def _round(self, comm: Communicator, schedule: list[Pair], windows: list[Window], *, sending: bool,
               stats: TransferStats, sums: dict[int, dict[int, int]]) -> None:
        """Post one round as one NCCL group; scatter its staged message on the stream after it.

        The round's sends and receives go on the current stream, so a pack enqueued just before
        its send is complete when NCCL reads the buffer, and a buffer is refilled (by the next
        round's pack, on the same stream) only after NCCL is done with it.
        """
        landed: list[tuple[Message, torch.Tensor, int, int]] = []
        ops: list[P2P] = []
        for window in windows:
            pair = schedule[window.pair]
            for offset, message in enumerate(window.messages):
                tag = window.first + offset
                if sending:
                    payload = None if needs_buffer(message) else direct_source(message, self._flats)
                    if payload is None:
                        payload = pack(message, self._flats, self._buffer(window.pair, 0), copy=self.dev.copy)
                    if self.ctx.options.checksum:
                        sums[window.pair][tag] = checksum(payload)
                elif message.direct:
                    payload = as_bytes(dst_view(self._flats, message.pieces[0]))
                else:
                    payload = self._buffer(window.pair, 0)[: message.nbytes]
                landed.append((message, payload, window.pair, tag))
                ops.append(P2P("send" if sending else "recv", payload, pair.peer_global))
                stats.nbytes += message.nbytes
                stats.messages += 1
                stats.direct_bytes += message.nbytes if message.direct else 0
        comm.post(ops)  # enqueued on the current stream: the CPU does not wait for it
        if sending:
            return
        for message, payload, index, tag in landed:
            if self.ctx.options.checksum:  # debugging option: synchronises every round
                sums[index][tag] = checksum(payload)
            if not message.direct:
                scatter(message, self._flats, payload, copy=self.dev.copy)

    def _checksums(self, comm: Communicator, schedule: list[Pair], sending: bool,
                   sums: dict[int, dict[int, int]]) -> None:
        """One more round: each pair's CRC32s in message order, compared by the receiver."""
        tails = []
        for i, pair in enumerate(schedule):
            if not pair.messages:
                continue
            ordered = [sums[i].get(tag, -1) for tag in range(len(pair.messages))]
            tail = (torch.tensor(ordered, dtype=torch.int64, device=self.device) if sending
                    else torch.empty(len(pair.messages), dtype=torch.int64, device=self.device))
            tails.append((pair, tail, ordered))
        if not tails:
            return  # no message with any peer this phase: nothing to compare
        comm.post([P2P("send" if sending else "recv", tail, pair.peer_global) for pair, tail, _ in tails])
        # tolist() below waits for the stream
        if sending:
            return
        for pair, tail, ordered in tails:
            for tag, (want, got) in enumerate(zip(tail.tolist(), ordered, strict=True)):
                if want != got:
                    raise TransportError(f"{self.ctx.who}: checksum mismatch with {self._peer_label(pair.peer)}: "
                                         f"{pair.messages[tag].describe()}")


__all__ = ["WINDOW", "NcclTransport", "Pair", "Watchdog", "Window", "rounds_of", "windows_of"]
