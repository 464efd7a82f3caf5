"""torch.distributed transport over NCCL (CUDA memory): grouped rounds, one event, a watchdog.

Written to be right by construction, since no GPU has run it yet; ``weightsync doctor``
checks it on the first machine that has one. What it does, and the torch/NCCL facts it rests
on (torch 2.13, ``torch/distributed/distributed_c10d.py``):

* **One communicator, made eagerly.** The group is built the way ``new_group`` builds one
  (a ``ProcessGroup`` with a ``ProcessGroupNCCL`` backend registered for CUDA, bound to this
  rank's device) and ``eager_connect_single_device`` creates its NCCL communicator during
  ``prepare``. Ungrouped NCCL send/recv would instead create a two-rank communicator per
  pair, lazily, inside the first sync.
* **Pairs concurrently, each pair's messages grouped.** Every pair's messages are cut into
  windows (at most one staged message and :data:`WINDOW` messages each); round ``k`` is
  window ``k`` of *every* pair of this rank, posted as one coalesced group
  (``_start_coalescing``/``_end_coalescing``, what ``batch_isend_irecv`` does for NCCL).
  A peer holds window ``k`` of the pair in its own round ``k``, so every rank's round ``k``
  completes once its peers reach round ``k``: no deadlock whatever the fan-in or fan-out.
* **No CPU polling.** Each round's work only makes the current stream wait for it
  (``work.block_current_stream()``), so packing the next round and scattering the last
  run on the GPU in order; the CPU blocks once, on a blocking-sync CUDA event recorded after
  the last round.
* **Timeouts abort, they never kill.** A :class:`Watchdog` thread aborts the communicator if
  the sync (posting included: the end of a coalesced group connects a pair on first use)
  has not completed by the deadline, or as soon as the job channel reports a peer dead (NCCL
  has no peer watch of its own); aborted NCCL kernels end, the event completes, and the sync
  raises :class:`TransportError` naming the peers and why. The eager connect of ``prepare``
  runs under one too. The next version runs in a new epoch with a new communicator.
* **A dead peer never kills this process** (a dead rollout worker must not kill the trainer),
  so the group is built with ``TORCH_NCCL_BLOCKING_WAIT=1``, which makes torch start no
  watchdog thread for it (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, which only that watchdog acts
  on, is left alone).
  torch's watchdog would otherwise see the NCCL error a dead peer across the network causes
  (possibly before our peer watch does), raise the process-wide dump signal that the heartbeat
  monitor of the process's first NCCL group answers with ``terminateProcess``, and rethrow the
  error on its own thread (``std::terminate``) under the default error handling; even our own
  ``abort()`` can race its error check. torch 2.13 reads the setting in the constructor, from
  the environment only: ``ProcessGroupNCCL.Options`` has no field for blocking wait (docs/gpu.md,
  "NCCL: what weightsync does", cites the source). So :func:`construct_backend` writes
  :func:`settings_to_write` (nothing when the process was launched with it) for the
  constructor only, one construction at a time, and restores what was there. This still writes
  the process environment (issue 23, defect 10, open): no per-group alternative exists in torch
  2.13; weightsync never waits on a work from the CPU, so blocking wait costs nothing here.

Staging: one buffer of ``max_bucket_bytes / 16`` per pair (a window holds at most one staged
message), so peak extra memory is within ``max_bucket_bytes`` up to 16 peers per rank.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from weightsync.deadline import Deadline
from weightsync.transport.base import PeerWatch, PhaseTimer, TransferStats, TransportError
from weightsync.transport.nccl_delta import check_delta_memory, delta_sync, move_pairs
from weightsync.transport.schedule import Message
from weightsync.transport.tensors import as_bytes, checksum, direct_source, dst_view, pack, scatter
from weightsync.transport.torch_dist import Pair, TorchDistBase

if TYPE_CHECKING:
    from weightsync.plan import Plan
    from weightsync.transport.base import TransportContext

logger = logging.getLogger(__name__)

#: Messages of one pair in one round (at most one of them staged).
WINDOW = 8
#: torch's process-group timeout; weightsync's own deadline (the watchdog) always fires first.
_GROUP_TIMEOUT = datetime.timedelta(hours=24)


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


class Watchdog:
    """Calls ``abort`` once if the guarded block is still running at the deadline, or as soon as
    ``watch`` reports a peer dead (NCCL itself never notices a dead peer: its kernels wait).

        with Watchdog(deadline, abort, watch) as dog:
            event.synchronize()        # returns early if dog aborted the communicator
        if dog.fired: raise ...        # dog.dead: the dead peers, if that is why
    """

    def __init__(self, deadline: Deadline, abort: Callable[[], None], watch: PeerWatch | None = None) -> None:
        self.deadline = deadline
        self.abort = abort
        self.watch = watch
        self.fired = False
        self.dead: dict[int, str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="weightsync-nccl-watchdog", daemon=True)

    def _watch(self) -> None:
        step = self.watch.every if self.watch is not None else None
        while not self._done.wait(self.deadline.remaining(0.0) if step is None
                                  else min(step, self.deadline.remaining(0.0))):
            if self.deadline.expired:
                break
            try:
                self.dead = self.watch.dead() if self.watch is not None else {}
            except Exception as exc:  # the meta server is away: the deadline still holds
                logger.debug("peer liveness unavailable: %s", exc)
            if self.dead:
                break
        else:
            return
        self.fired = True
        try:
            self.abort()
        except Exception as exc:  # the sync reports the timeout either way
            logger.warning("aborting the NCCL communicator failed: %s", exc)

    def reason(self) -> str:
        """Why it fired, for the error: the dead peers, or the deadline."""
        if self.dead:
            role = self.watch.role if self.watch is not None else "peer"
            return "; ".join(f"{role} {r} is dead ({why})" for r, why in sorted(self.dead.items()))
        return "it did not complete in time"

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def nccl_group_env() -> dict[str, str]:
    """The torch setting weightsync's own NCCL group is constructed with (module docstring).
    Blocking wait alone: with it torch starts no watchdog, the only part of torch that acts on
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, so writing that one too changed nothing for our group
    and only showed one more altered variable to whatever read the environment meanwhile."""
    return {"TORCH_NCCL_BLOCKING_WAIT": "1"}


def settings_to_write(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings of :func:`nccl_group_env` that ``environ`` does not hold already: what a
    construction must write (nothing in a process launched with it)."""
    return {key: value for key, value in nccl_group_env().items() if environ.get(key) != value}


#: Held while a weightsync NCCL group is constructed. Two constructions that overlapped, each
#: saving and restoring the environment around its own, restored in the wrong order and left
#: ``TORCH_NCCL_BLOCKING_WAIT=1`` in the process for good (every later group of the user's
#: built without a torch watchdog).
_CONSTRUCTING = threading.Lock()


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the duration, then exactly what was there before.
    Not reentrant across threads by itself: :func:`construct_backend` serialises its users."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def construct_backend(store: dist.Store, rank: int, size: int, options: Any) -> Any:
    """``ProcessGroupNCCL(store, rank, size, options)`` constructed under :func:`nccl_group_env`
    (module docstring: torch 2.13 takes these settings from the environment only).

    One weightsync construction at a time in this process; the environment is written only
    where it does not already hold the value, and restored before the lock is released.
    """
    with _CONSTRUCTING:
        missing = settings_to_write(os.environ)
        if not missing:
            return dist.ProcessGroupNCCL(store, rank, size, options)
        with scoped_env(missing):
            return dist.ProcessGroupNCCL(store, rank, size, options)


def nccl_group(store: dist.Store, rank: int, size: int, device: torch.device, *, name: str,
               deadline: Deadline) -> Any:
    """A NCCL process group of our own, with its communicator created now (module docstring)."""
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = _GROUP_TIMEOUT
    backend = construct_backend(dist.PrefixStore("cuda/", store), rank, size, options)
    backend._set_sequence_number_for_group()
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg.bound_device_id = device  # before the backend is registered, which hands it on
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    pg._set_group_name(name)  # type: ignore[arg-type]  # GroupName is a str at run time
    connect_eagerly(backend, device, deadline)
    return pg


def connect_eagerly(backend: Any, device: torch.device, deadline: Deadline) -> None:
    """Create the communicator now (``eager_connect_single_device``), under a watchdog: NCCL's
    bootstrap waits for every rank with no deadline of its own.

    Raises:
        TransportError: the deadline passed first (the backend was aborted).
    """
    with Watchdog(deadline, backend.abort) as dog:
        backend.eager_connect_single_device(device)
    if dog.fired:
        raise TransportError(f"the NCCL communicator did not connect on {device} in time (every rank of the "
                             "job must reach prepare); it was aborted")


def block_on(work: Any) -> None:
    """Make the current stream wait for a coalesced group's work. ``ProcessGroupNCCL::endCoalescing``
    returns no work (None) when nothing was posted in the group."""
    if work is not None:
        work.block_current_stream()


class NcclTransport(TorchDistBase):
    """Two-sided p2p over a private NCCL group (see module docstring)."""

    serves_cpu: ClassVar[bool] = False
    serves_cuda: ClassVar[bool] = True
    carries_deltas: ClassVar[bool] = True  # transport/nccl_delta.py

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.delta = delta_sync(self) if ctx.options.delta_anchor_every else None

    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, epoch: int, timeout: float,
                phases: Sequence[Plan] | None = None) -> None:
        super().prepare(plan, tensors, epoch=epoch, timeout=timeout, phases=phases)
        if self.delta is not None:
            self.delta.prepared(tensors, phases=len(self._schedules))
            check_delta_memory(self, self.delta)

    def _form_group(self, epoch: int, deadline: Deadline) -> Any:
        prefix = self._store_for(epoch, deadline)
        try:
            with self.dev.scope(self.device):
                return nccl_group(prefix, self.ctx.global_rank, self.ctx.world_size, self.device,
                                  name=f"weightsync-e{epoch}", deadline=deadline)
        except TransportError as exc:
            raise TransportError(f"{self.ctx.who}: epoch {epoch}: {exc}") from exc
        except (RuntimeError, dist.DistError) as exc:
            raise TransportError(f"{self.ctx.who}: NCCL group of epoch {epoch} did not form on {self.device}: "
                                 f"{exc}") from exc

    def send(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        return self._move(version, Deadline.after(timeout), self._phase_schedule(phase), sending=True, phase=phase)

    def receive(self, version: int, *, timeout: float, phase: int = 0) -> TransferStats:
        return self._move(version, Deadline.after(timeout), self._phase_schedule(phase), sending=False, phase=phase)

    def _move(self, version: int, deadline: Deadline, schedule: list[Pair], *, sending: bool,
              phase: int = 0) -> TransferStats:
        pg = self._pg
        if pg is None:
            raise TransportError(f"{self.ctx.who}: no process group; call prepare() first")
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        rounds = rounds_of([pair.messages for pair in schedule])
        sums: dict[int, dict[int, int]] = {i: {} for i in range(len(schedule))}
        other = "reader" if self.ctx.role == "writer" else "writer"
        watch = PeerWatch(self.ctx, other, [p.peer for p in schedule])  # type: ignore[arg-type]
        # posting blocks too: the end of a coalesced group connects a pair on its first use
        dog = Watchdog(deadline, pg.abort, watch)
        try:
            with self.dev.scope(self.device), dog:
                if self.delta is not None:  # pair by pair, only what changed (transport/nccl_delta.py)
                    move_pairs(self, self.delta, pg, schedule, dog, sending=sending, phase=phase, stats=stats,
                               timer=timer, block_on=block_on)
                else:
                    with timer("post"):
                        for windows in rounds:
                            self._round(pg, schedule, windows, sending=sending, stats=stats, sums=sums)
                        if self.ctx.options.checksum:
                            self._checksums(pg, schedule, sending, sums)
                        done = self.dev.record(self.device)
                    with timer("transfer"):
                        self.dev.wait(done)
        except Exception as exc:  # whatever failed, the group may be mid-operation: never reuse it
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

    def _round(self, pg: Any, schedule: list[Pair], windows: list[Window], *, sending: bool, stats: TransferStats,
               sums: dict[int, dict[int, int]]) -> None:
        """Post one round as one NCCL group; scatter its staged message on the stream after it.

        Each send or receive makes the NCCL stream wait for the current stream first, so a
        pack enqueued just before its send is complete when NCCL reads the buffer, and a
        buffer is only refilled after the previous round's ``work.block_current_stream()``.
        """
        landed: list[tuple[Message, torch.Tensor, int, int]] = []
        pg._start_coalescing(self.device)
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
                (pg.send if sending else pg.recv)([payload], pair.peer_global, tag)
                stats.nbytes += message.nbytes
                stats.messages += 1
                stats.direct_bytes += message.nbytes if message.direct else 0
        block_on(pg._end_coalescing(self.device))  # the current stream waits for the round; the CPU does not
        if sending:
            return
        for message, payload, index, tag in landed:
            if self.ctx.options.checksum:  # debugging option: synchronises every round
                sums[index][tag] = checksum(payload)
            if not message.direct:
                scatter(message, self._flats, payload, copy=self.dev.copy)

    def _checksums(self, pg: Any, schedule: list[Pair], sending: bool, sums: dict[int, dict[int, int]]) -> None:
        """One more round: each pair's CRC32s in message order, compared by the receiver."""
        tails = []
        pg._start_coalescing(self.device)
        for i, pair in enumerate(schedule):
            if not pair.messages:
                continue
            ordered = [sums[i].get(tag, -1) for tag in range(len(pair.messages))]
            tail = (torch.tensor(ordered, dtype=torch.int64, device=self.device) if sending
                    else torch.empty(len(pair.messages), dtype=torch.int64, device=self.device))
            (pg.send if sending else pg.recv)([tail], pair.peer_global, len(pair.messages))
            tails.append((pair, tail, ordered))
        if not tails:
            return  # no message with any peer this phase: nothing to compare
        block_on(pg._end_coalescing(self.device))  # tolist() below waits for the stream
        if sending:
            return
        for pair, tail, ordered in tails:
            for tag, (want, got) in enumerate(zip(tail.tolist(), ordered, strict=True)):
                if want != got:
                    raise TransportError(f"{self.ctx.who}: checksum mismatch with {self._peer_label(pair.peer)}: "
                                         f"{pair.messages[tag].describe()}")


__all__ = ["WINDOW", "NcclTransport", "Pair", "Watchdog", "Window", "construct_backend", "nccl_group", "rounds_of",
           "settings_to_write", "windows_of"]
