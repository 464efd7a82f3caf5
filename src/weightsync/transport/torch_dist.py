"""torch.distributed point-to-point transport: gloo on CPU, NCCL on GPU.

One process group spans all writers and readers (writers ranks 0..W-1, readers W..W+R-1).
It is created with the process-group classes directly, so it never touches the training
job's default group. Rendezvous goes through the meta server: writer 0 opens a TCPStore on
a free port and publishes its address under ``transport/torch/<generation>``; everyone
else reads it from there. A new *generation* (after a peer died) means a new store and a
new group, so a failed sync never poisons the next one.

Per pair, the messages of :mod:`weightsync.transport.schedule` flow with two buffers in
flight: the sender packs message i+1 while message i is on the wire, and the receiver
posts the receive of message i+1 before scattering message i. Direct messages are
received straight into the destination parameter, and sent without packing when the
source view is already a dense run of the right dtype.

    t = TorchDistTransport(ctx)
    t.prepare(plan, tensors, generation=0, timeout=60)
    t.send(version, timeout=60)        # or t.receive(version, timeout=60)
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from weightsync.transport.base import PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.schedule import Message, build_messages, pair_order
from weightsync.transport.tensors import as_bytes, checksum, direct_source, dst_view, flat_views, pack, scatter

if TYPE_CHECKING:
    from weightsync.plan import Plan

logger = logging.getLogger(__name__)

_TAG = 0


class TorchDistTransport:
    """Two-sided p2p over a private process group (see module docstring)."""

    name: ClassVar[str] = "torch"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = torch.device(ctx.options.device)
        self.generation: int | None = None
        self._store: dist.TCPStore | None = None
        self._pg: Any = None
        self._schedule: list[tuple[int, int, list[Message]]] = []
        self._flats: dict[str, torch.Tensor] = {}
        self._buffers: list[torch.Tensor] = []

    # -- setup ----------------------------------------------------------------------------
    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, generation: int,
                timeout: float) -> None:
        if self.generation != generation or self._pg is None:
            self._teardown_group()
            self._rendezvous(generation, timeout)
        self._flats = flat_views(tensors)
        opts = self.ctx.options
        me = self.ctx.rank
        mine = [p for p in plan.pairs() if (p[0] if self.ctx.role == "writer" else p[1]) == me]
        self._schedule = []
        for src, dst in pair_order(mine, self.ctx.num_writers, self.ctx.num_readers):
            messages = build_messages(plan.ops_between(src, dst), message_bytes=opts.message_bytes,
                                      direct_min_bytes=opts.direct_min_bytes)
            peer = dst if self.ctx.role == "writer" else src
            peer_global = src if self.ctx.role == "reader" else self.ctx.num_writers + dst
            self._schedule.append((peer, peer_global, messages))

    def _rendezvous(self, generation: int, timeout: float) -> None:
        ctx = self.ctx
        key = f"transport/torch/{generation}"
        td = datetime.timedelta(seconds=timeout)
        if ctx.role == "writer" and ctx.rank == 0:
            store = dist.TCPStore(ctx.options.host, 0, ctx.world_size, True, timeout=td,
                                  wait_for_workers=False)
            ctx.meta.put_document(key, f"{ctx.options.host}:{store.port}".encode())
        else:
            addr = ctx.meta.get_document(key, wait=timeout)
            if addr is None:
                raise TransportError(
                    f"{ctx.role} {ctx.rank}: writer 0 did not publish the torch rendezvous address for "
                    f"generation {generation} within {timeout:.0f}s"
                )
            host, port = addr.decode().rsplit(":", 1)
            store = dist.TCPStore(host, int(port), ctx.world_size, False, timeout=td)
        prefix = dist.PrefixStore(f"weightsync/{generation}", store)
        pg: Any
        try:
            if self.device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = td
                pg = dist.ProcessGroupNCCL(prefix, ctx.global_rank, ctx.world_size, opts)
            else:
                pg = dist.ProcessGroupGloo(prefix, ctx.global_rank, ctx.world_size, td)
        except RuntimeError as exc:
            raise TransportError(
                f"{ctx.role} {ctx.rank}: process group of generation {generation} did not form: {exc}"
            ) from exc
        self._store, self._pg, self.generation = store, pg, generation
        logger.info("%s %d joined transport generation %d (%d ranks)", ctx.role, ctx.rank, generation,
                    ctx.world_size)

    def _buffer(self, slot: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(self.ctx.options.message_bytes, dtype=torch.uint8,
                                             device=self.device))
        return self._buffers[slot]

    # -- data movement --------------------------------------------------------------------
    def send(self, version: int, *, timeout: float) -> TransferStats:
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        deadline = time.monotonic() + timeout
        for peer, peer_global, messages in self._schedule:
            in_flight: deque[tuple[Any, Message, int]] = deque()
            sums = []
            for message in messages:
                if len(in_flight) == 2:
                    self._wait(in_flight.popleft(), deadline, peer, timer)
                payload = direct_source(message, self._flats) if message.direct else None
                if payload is None:
                    slot = _free_slot(in_flight)
                    with timer("pack"):
                        payload = pack(message, self._flats, self._buffer(slot))
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes,
                                                 len(self._buffers) * self.ctx.options.message_bytes)
                else:
                    slot = -1
                if self.ctx.options.checksum:
                    with timer("checksum"):
                        sums.append(checksum(payload))
                with timer("transfer"):
                    work = self._post("send", payload, peer_global, peer, message)
                in_flight.append((work, message, slot))
                stats.nbytes += message.nbytes
                stats.messages += 1
                stats.direct_bytes += message.nbytes if message.direct else 0
            while in_flight:
                self._wait(in_flight.popleft(), deadline, peer, timer)
            if self.ctx.options.checksum and messages:
                tail = torch.tensor(sums, dtype=torch.int64, device=self.device)
                work = self._post("send", tail, peer_global, peer, messages[-1])
                self._wait((work, messages[-1], -1), deadline, peer, timer)
        return stats

    def receive(self, version: int, *, timeout: float) -> TransferStats:
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        deadline = time.monotonic() + timeout
        for peer, peer_global, messages in self._schedule:
            in_flight: deque[tuple[Any, Message, int]] = deque()
            sums: list[int] = []
            pending = deque(messages)
            while pending or in_flight:
                while pending and len(in_flight) < 2:
                    message = pending.popleft()
                    if message.direct:
                        target, slot = as_bytes(dst_view(self._flats, message.pieces[0])), -1
                    else:
                        slot = _free_slot(in_flight)
                        target = self._buffer(slot)[: message.nbytes]
                        stats.peak_extra_bytes = max(stats.peak_extra_bytes,
                                                     len(self._buffers) * self.ctx.options.message_bytes)
                    with timer("transfer"):
                        work = self._post("recv", target, peer_global, peer, message)
                    in_flight.append((work, message, slot))
                work, message, slot = in_flight.popleft()
                self._wait((work, message, slot), deadline, peer, timer)
                payload = (as_bytes(dst_view(self._flats, message.pieces[0])) if message.direct
                           else self._buffers[slot][: message.nbytes])
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
                work = self._post("recv", tail, peer_global, peer, messages[-1])
                self._wait((work, messages[-1], -1), deadline, peer, timer)
                for expected, got, message in zip(tail.tolist(), sums, messages, strict=True):
                    if expected != got:
                        raise TransportError(
                            f"reader {self.ctx.rank}: checksum mismatch in version {version} from writer "
                            f"{peer}: {message.describe()}"
                        )
        return stats

    def _post(self, kind: str, tensor: torch.Tensor, peer_global: int, peer: int, message: Message) -> Any:
        """Post a send or receive; a broken connection surfaces here as well as in wait."""
        try:
            op = self._pg.send if kind == "send" else self._pg.recv
            return op([tensor], peer_global, _TAG)
        except RuntimeError as exc:
            self._teardown_group()
            other = "reader" if self.ctx.role == "writer" else "writer"
            raise TransportError(f"{self.ctx.role} {self.ctx.rank}: transfer with {other} {peer} failed "
                                 f"({message.describe()}): {exc}") from exc

    def _wait(self, item: tuple[Any, Message, int], deadline: float, peer: int, timer: PhaseTimer) -> None:
        work, message, _ = item
        remaining = deadline - time.monotonic()
        other = "reader" if self.ctx.role == "writer" else "writer"
        try:
            with timer("transfer"):
                if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                    raise TimeoutError(f"no progress within the timeout ({remaining:.1f}s left)")
        except (RuntimeError, TimeoutError) as exc:
            self._teardown_group()  # a broken group cannot be reused; the next generation rebuilds it
            raise TransportError(
                f"{self.ctx.role} {self.ctx.rank}: transfer with {other} {peer} failed "
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
        self.generation = None

    def close(self) -> None:
        self._teardown_group()
        self._buffers.clear()
        self._flats = {}
        self._schedule = []


def _free_slot(in_flight: deque[tuple[Any, Message, int]]) -> int:
    used = {slot for _, _, slot in in_flight}
    return 0 if 0 not in used else 1
