"""torch.distributed point-to-point transport: gloo on CPU, NCCL on GPU.

One process group spans all writers and readers (writers ranks 0..W-1, readers W..W+R-1).
It is created with the process-group classes directly, so it never touches the training
job's default group. Rendezvous goes through the job channel: writer 0 opens a TCPStore on
a free port and publishes its address as its endpoint of the epoch (:class:`TorchRendezvous`);
everyone else reads it from there. A new *epoch* (after a peer died) means a new store and
a new group, so a failed sync never poisons the next one.

Pairs run concurrently over gloo (up to eight at once, one thread each, sharing the staging
bound) and one after another over NCCL. Per pair, the messages of
:mod:`weightsync.transport.schedule` flow with two staging buffers: the sender packs
message i+1 while message i is on the wire, and the receiver posts the receive of message
i+1 before scattering message i. Direct messages need no buffer: they are received straight
into the destination parameter, sent without packing when the source view is already a
dense run of the right dtype, and up to eight of them are in flight per pair.

    t = TorchDistTransport(ctx)
    t.prepare(plan, tensors, epoch=0, timeout=60)
    t.send(version, timeout=60)        # or t.receive(version, timeout=60)
"""

from __future__ import annotations

import datetime
import logging
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from weightsync.deadline import Deadline
from weightsync.transport.base import PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.schedule import Message, build_messages, pair_order
from weightsync.transport.tensors import as_bytes, checksum, direct_source, dst_view, flat_views, pack, scatter

if TYPE_CHECKING:
    from weightsync.plan import Plan

logger = logging.getLogger(__name__)

#: Messages in flight per pair; at most two of them use staging buffers, the rest are direct.
_MAX_IN_FLIGHT = 8
#: Pairs moved at once over gloo (one thread each); see TorchDistTransport._run_pairs.
_MAX_LANES = 8


class TorchDistTransport:
    """Two-sided p2p over a private process group (see module docstring)."""

    name: ClassVar[str] = "torch"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = False
    publishes_before_send: ClassVar[bool] = True  # receivers must post their receives

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = torch.device(ctx.options.device)
        self.epoch: int | None = None
        self._store: dist.TCPStore | None = None
        self._pg: Any = None
        self._schedule: list[_Pair] = []
        self._flats: dict[str, torch.Tensor] = {}
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._lanes = 1
        self._message_bytes = ctx.options.message_bytes

    # -- setup ----------------------------------------------------------------------------
    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, epoch: int,
                timeout: float) -> None:
        if self.epoch != epoch or self._pg is None:
            self._teardown_group()
            self._rendezvous(epoch, Deadline.after(timeout))
        self._flats = flat_views(tensors)
        opts = self.ctx.options
        me = self.ctx.rank
        mine = [p for p in plan.pairs() if (p[0] if self.ctx.role == "writer" else p[1]) == me]
        self._schedule = []
        # gloo: up to _MAX_LANES pairs at once, sharing the staging bound (two buffers per lane).
        # Both ends of a pair must cut the same messages, and a rank's plan may hold only its
        # own pairs, so the message size cannot follow the number of lanes: it assumes the most.
        self._lanes = 1 if self.device.type == "cuda" else max(1, min(len(mine), _MAX_LANES))
        message_bytes = (opts.message_bytes if self.device.type == "cuda"
                         else max(4096, opts.message_bytes // _MAX_LANES))
        if message_bytes != self._message_bytes:
            self._buffers.clear()
            self._message_bytes = message_bytes
        for src, dst in pair_order(mine, self.ctx.num_writers, self.ctx.num_readers):
            messages = build_messages(plan.ops_between(src, dst), message_bytes=message_bytes,
                                      direct_min_bytes=opts.direct_min_bytes)
            peer = dst if self.ctx.role == "writer" else src
            peer_global = src if self.ctx.role == "reader" else self.ctx.num_writers + dst
            self._schedule.append(_Pair(peer, peer_global, messages))

    def _rendezvous(self, epoch: int, deadline: Deadline) -> None:
        ctx = self.ctx
        td = datetime.timedelta(seconds=deadline.remaining())
        if ctx.role == "writer" and ctx.rank == 0:
            store = dist.TCPStore(ctx.options.host, 0, ctx.world_size, True, timeout=td,
                                  wait_for_workers=False)
            ctx.job.publish_endpoint(self.name, epoch, TorchRendezvous(ctx.options.host, store.port).to_wire())
        else:
            doc = ctx.job.wait_endpoint(self.name, epoch, "writer", 0, deadline=deadline)
            if doc is None:
                raise TransportError(f"{ctx.who}: writer 0 did not publish the torch rendezvous address for "
                                     f"epoch {epoch} in time")
            rendezvous = TorchRendezvous.from_wire(doc)
            store = dist.TCPStore(rendezvous.host, rendezvous.port, ctx.world_size, False, timeout=td)
        prefix = dist.PrefixStore(f"weightsync/{epoch}", store)
        pg: Any
        try:
            if self.device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = td
                pg = dist.ProcessGroupNCCL(prefix, ctx.global_rank, ctx.world_size, opts)
            else:
                pg = dist.ProcessGroupGloo(prefix, ctx.global_rank, ctx.world_size, td)
        except RuntimeError as exc:
            raise TransportError(f"{ctx.who}: process group of epoch {epoch} did not form: {exc}") from exc
        self._store, self._pg, self.epoch = store, pg, epoch
        logger.info("%s joined transport epoch %d (%d ranks)", ctx.who, epoch, ctx.world_size)

    def _buffer(self, lane: int, slot: int) -> torch.Tensor:
        key = (lane, slot)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self._message_bytes, dtype=torch.uint8, device=self.device)
        return self._buffers[key]

    def _extra_bytes(self) -> int:
        return len(self._buffers) * self._message_bytes

    # -- data movement --------------------------------------------------------------------
    def send(self, version: int, *, timeout: float) -> TransferStats:
        return self._run_pairs(version, timeout, self._send_pair)

    def receive(self, version: int, *, timeout: float) -> TransferStats:
        return self._run_pairs(version, timeout, self._receive_pair)

    def _run_pairs(self, version: int, timeout: float, move: Any) -> TransferStats:
        """Run ``move`` for every peer: in order on one thread (NCCL), or on ``lanes`` threads (gloo).

        gloo moves each pair's bytes on its own connection, so pairs in flight at once use the
        loopback (or NIC) in parallel instead of one after another; within a pair, messages keep
        their order, which is what matches sends with receives. NCCL calls on one communicator
        must not come from several threads, so it keeps one lane.
        """
        deadline = Deadline.after(timeout)
        pg = self._pg
        if pg is None:
            raise TransportError(f"{self.ctx.who}: no process group; call prepare() first")
        runs = [_LaneRun(i, pg, deadline, TransferStats(version), self._schedule[i::self._lanes])
                for i in range(self._lanes)]
        if len(runs) == 1:
            return self._run_lane(runs[0], move)
        with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="weightsync-torch") as pool:
            futures = [pool.submit(self._run_lane, run, move) for run in runs]
            results, errors = [], []
            for future in futures:
                try:
                    results.append(future.result())
                except TransportError as exc:  # the first lane to fail aborted the group
                    errors.append(exc)
        if errors:
            raise min(errors, key=lambda e: "abort" in str(e).lower())
        total = TransferStats(version)
        for stats in results:
            total.nbytes += stats.nbytes
            total.messages += stats.messages
            total.direct_bytes += stats.direct_bytes
            for name, seconds in stats.phases.items():  # lanes overlap: the slowest lane's time
                total.phases[name] = max(total.phases.get(name, 0.0), seconds)
        total.peak_extra_bytes = self._extra_bytes()
        return total

    def _run_lane(self, run: _LaneRun, move: Any) -> TransferStats:
        for pair in run.pairs:
            move(pair, run)
        run.stats.peak_extra_bytes = self._extra_bytes()
        return run.stats

    def _send_pair(self, pair: _Pair, run: _LaneRun) -> None:
        peer, messages, stats, timer, deadline = pair.peer, pair.messages, run.stats, run.timer, run.deadline
        in_flight: deque[tuple[Any, Message, int]] = deque()
        sums = []
        for index, message in enumerate(messages):
            payload = direct_source(message, self._flats) if message.direct else None
            while len(in_flight) >= _MAX_IN_FLIGHT or (payload is None and _buffers_in_use(in_flight) == 2):
                self._wait(in_flight.popleft(), deadline, peer, timer)
            if payload is None:
                slot = _free_slot(in_flight)
                with timer("pack"):
                    payload = pack(message, self._flats, self._buffer(run.lane, slot))
            else:
                slot = -1
            if self.ctx.options.checksum:
                with timer("checksum"):
                    sums.append(checksum(payload))
            with timer("transfer"):
                work = self._post(run.pg, "send", payload, pair, message, tag=index)
            in_flight.append((work, message, slot))
            stats.nbytes += message.nbytes
            stats.messages += 1
            stats.direct_bytes += message.nbytes if message.direct else 0
        while in_flight:
            self._wait(in_flight.popleft(), deadline, peer, timer)
        if self.ctx.options.checksum and messages:
            tail = torch.tensor(sums, dtype=torch.int64, device=self.device)
            work = self._post(run.pg, "send", tail, pair, messages[-1], tag=len(messages))
            self._wait((work, messages[-1], -1), deadline, peer, timer)

    def _receive_pair(self, pair: _Pair, run: _LaneRun) -> None:
        peer, messages, stats, timer, deadline = pair.peer, pair.messages, run.stats, run.timer, run.deadline
        version = stats.version
        in_flight: deque[tuple[Any, Message, int]] = deque()
        sums: list[int] = []
        pending = deque(enumerate(messages))
        while pending or in_flight:
            while pending and len(in_flight) < _MAX_IN_FLIGHT and (
                    pending[0][1].direct or _buffers_in_use(in_flight) < 2):
                index, message = pending.popleft()
                if message.direct:
                    target, slot = as_bytes(dst_view(self._flats, message.pieces[0])), -1
                else:
                    slot = _free_slot(in_flight)
                    target = self._buffer(run.lane, slot)[: message.nbytes]
                with timer("transfer"):
                    work = self._post(run.pg, "recv", target, pair, message, tag=index)
                in_flight.append((work, message, slot))
            work, message, slot = in_flight.popleft()
            self._wait((work, message, slot), deadline, peer, timer)
            payload = (as_bytes(dst_view(self._flats, message.pieces[0])) if message.direct
                       else self._buffer(run.lane, slot)[: message.nbytes])
            if self.ctx.options.checksum:
                with timer("checksum"):
                    sums.append(checksum(payload))
            if not message.direct:
                with timer("unpack"):
                    scatter(message, self._flats, payload)
            stats.nbytes += message.nbytes
            stats.messages += 1
            stats.direct_bytes += message.nbytes if message.direct else 0
        if self.ctx.options.checksum and messages:
            tail = torch.empty(len(messages), dtype=torch.int64, device=self.device)
            work = self._post(run.pg, "recv", tail, pair, messages[-1], tag=len(messages))
            self._wait((work, messages[-1], -1), deadline, peer, timer)
            for expected, got, message in zip(tail.tolist(), sums, messages, strict=True):
                if expected != got:
                    raise TransportError(
                        f"reader {self.ctx.rank}: checksum mismatch in version {version} from writer "
                        f"{peer}: {message.describe()}"
                    )

    def _post(self, pg: Any, kind: str, tensor: torch.Tensor, pair: _Pair, message: Message, *, tag: int) -> Any:
        """Post a send or receive; a broken connection surfaces here as well as in wait.

        Each message of a pair has its own tag (its index): with several receives in flight
        on one pair, gloo does not match same-tag messages to receives in posting order.
        """
        peer = pair.peer
        try:
            op = pg.send if kind == "send" else pg.recv
            return op([tensor], pair.peer_global, tag)
        except RuntimeError as exc:
            self._teardown_group()
            other = "reader" if self.ctx.role == "writer" else "writer"
            raise TransportError(f"{self.ctx.who}: transfer with {other} {peer} failed "
                                 f"({message.describe()}): {exc}") from exc

    def _wait(self, item: tuple[Any, Message, int], deadline: Deadline, peer: int, timer: PhaseTimer) -> None:
        work, message, _ = item
        remaining = deadline.remaining(0.0)
        other = "reader" if self.ctx.role == "writer" else "writer"
        try:
            with timer("transfer"):
                if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                    raise TimeoutError(f"no progress within the timeout ({remaining:.1f}s left)")
        except (RuntimeError, TimeoutError) as exc:
            self._teardown_group()  # a broken group cannot be reused; the next epoch rebuilds it
            raise TransportError(
                f"{self.ctx.who}: transfer with {other} {peer} failed "
                f"({message.describe()}): {exc}"
            ) from exc

    # -- teardown -------------------------------------------------------------------------
    def _teardown_group(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception as exc:  # best effort: the group may already be dead
                logger.debug("process group abort failed: %s", exc)
        self._store = None
        self.epoch = None

    def close(self) -> None:
        self._teardown_group()
        self._buffers.clear()
        self._flats = {}
        self._schedule = []


@dataclass(frozen=True, slots=True)
class TorchRendezvous:
    """Writer 0's endpoint: the TCPStore every rank of the epoch's process group joins."""

    host: str
    port: int

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host, "port": self.port}

    @classmethod
    def from_wire(cls, doc: dict[str, object]) -> TorchRendezvous:
        host, port = doc.get("host"), doc.get("port")
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            raise TransportError(f"malformed torch rendezvous endpoint {doc!r}")
        return cls(host, port)


@dataclass(frozen=True)
class _Pair:
    """One peer of this rank and the messages exchanged with it, in order."""

    peer: int  # the peer's writer or reader rank
    peer_global: int  # its rank in the transport's process group
    messages: list[Message]


@dataclass
class _LaneRun:
    """What one lane (thread) of a send or receive works with."""

    lane: int
    pg: Any
    deadline: Deadline
    stats: TransferStats
    pairs: list[_Pair]
    timer: PhaseTimer = field(init=False)

    def __post_init__(self) -> None:
        self.timer = PhaseTimer(self.stats)


def _buffers_in_use(in_flight: deque[tuple[Any, Message, int]]) -> int:
    return sum(1 for _, _, slot in in_flight if slot >= 0)


def _free_slot(in_flight: deque[tuple[Any, Message, int]]) -> int:
    used = {slot for _, _, slot in in_flight}
    return 0 if 0 not in used else 1
