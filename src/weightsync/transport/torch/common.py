"""The torch transport's point-to-point setup: what its two backends (gloo, NCCL) share.

One group spans all writers and readers (writers ranks 0..W-1, readers W..W+R-1): on host
memory a gloo process group created with the process-group classes directly, on GPU memory a
NCCL communicator of our own driven through nccl4py (no torch process group: see
:mod:`weightsync.transport.torch.nccl`), so it never touches the training job's groups.
Rendezvous goes through the job channel: writer 0 opens a TCPStore on a free port and
publishes its address as its endpoint of the epoch (:class:`TorchRendezvous`); everyone else
reads it from there. A new *epoch* (after a peer died) means a new store and
a new group, so a failed sync never poisons the next one.

Per pair, the messages of :mod:`weightsync.transport.schedule` flow in the same order on
both ends (no header ever crosses the wire): direct messages straight between the source
view and the destination parameter, staged ones through staging buffers whose total stays
within ``TransportOptions.max_bucket_bytes``. The backend is a property of the device
(:func:`weightsync.tools.devices.torch_backend`), so each has its own class:

* :class:`~weightsync.transport.torch.gloo.GlooTransport` (host memory): up to eight pairs at
  once, one thread each, a few messages in flight per pair;
* :class:`~weightsync.transport.torch.nccl.NcclTransport` (CUDA memory): every pair's
  messages of a round in one NCCL group, on the current stream, the CPU
  waiting on one CUDA event per version under a watchdog that aborts the communicator at
  the deadline (a dead peer never hangs or kills the process).

    t = create_transport("torch", ctx)        # GlooTransport or NcclTransport, by ctx.device
    t.connect(epoch=0, deadline=deadline)     # the epoch's group (deadline: the caller's Deadline)
    t.bind(plan, tensors, deadline=deadline)  # schedules (again alone when only the memory moved)
    t.send(version, deadline=deadline)        # or t.receive(version, deadline=deadline)
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from weightsync.clock.deadline import Deadline
from weightsync.ports import device as device_port
from weightsync.transport.base import (
    PeerWatch,
    TransportBase,
    TransportContext,
    TransportError,
)
from weightsync.transport.endpoint_wait import every_endpoint, peer_endpoint
from weightsync.transport.endpoints import TorchArrival, TorchRendezvous
from weightsync.transport.schedule import Message, build_messages, pair_order
from weightsync.transport.tensors import flat_views

if TYPE_CHECKING:
    from weightsync.job.channel import Holder
    from weightsync.plan import Plan
    from weightsync.transport.delta.pairs import DeltaSync

logger = logging.getLogger(__name__)

#: Pairs moved at once (gloo: one thread each; NCCL: one group call); the staging bound is
#: shared by all of them, so a message is at most ``message_bytes / MAX_LANES``.
MAX_LANES = 8


class TorchDistBase(TransportBase):
    """Setup both backends share: rendezvous (connect), message schedules (bind), staging buffers."""

    name: ClassVar[str] = "torch"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = False
    publishes_before_send: ClassVar[bool] = True  # receivers must post their receives
    serves_cpu: ClassVar[bool]
    serves_cuda: ClassVar[bool]
    carries_deltas: ClassVar[bool] = False  # both backends do: gloo (transport/delta/pairs.py), NCCL (nccl_delta.py)
    #: The pairs' delta state, set by a backend when ``delta_anchor_every`` is on.
    delta: DeltaSync | None = None

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.dev = device_port.current()
        self.device = torch.device(ctx.device)
        self._store: dist.TCPStore | None = None
        #: who held each lease when the group formed (:meth:`_lease_holders`)
        self._holders: dict[tuple[str, int], Holder] | None = None
        self._pg: Any = None
        self._schedules: list[list[Pair]] = []  # per phase: this rank's pairs and their messages
        self._flats: dict[str, torch.Tensor] = {}
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        # Both ends of a pair must cut the same messages, and a rank's plan may hold only its
        # own pairs, so the message size cannot follow the number of pairs: it assumes the most.
        self._message_bytes = max(4096, ctx.options.message_bytes // MAX_LANES)

    # -- setup ----------------------------------------------------------------------------
    def _connect(self, epoch: int, deadline: Deadline) -> None:
        """A new group for the epoch: the old one's pairs may be mid-message or lead to the dead."""
        self._teardown_group()
        self._pg = self._form_group(epoch, deadline)
        logger.info("%s joined transport epoch %d (%d ranks, %s)", self.ctx.who, epoch, self.ctx.world_size,
                    type(self).__name__)

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        self._flats = flat_views(tensors)
        self._schedules = [self._schedule_of(part) for part in parts]

    def _schedule_of(self, plan: Plan) -> list[Pair]:
        me = self.ctx.rank
        mine = [p for p in plan.pairs() if (p[0] if self.ctx.role == "writer" else p[1]) == me]
        schedule = []
        for src, dst in pair_order(mine, self.ctx.num_writers, self.ctx.num_readers):
            messages = build_messages(plan.ops_between(src, dst), message_bytes=self._message_bytes,
                                      direct_min_bytes=self.ctx.options.direct_min_bytes)
            peer = dst if self.ctx.role == "writer" else src
            peer_global = src if self.ctx.role == "reader" else self.ctx.num_writers + dst
            schedule.append(Pair(peer, peer_global, messages))
        return schedule

    def _phase_schedule(self, phase: int) -> list[Pair]:
        self.check_phase(phase)
        return self._schedules[phase]

    def _store_for(self, epoch: int, deadline: Deadline) -> dist.Store:
        """The epoch's TCPStore, once every rank of the group arrived at it: writer 0 opens it,
        everyone else finds it through the job channel and says it arrived there (:meth:`_arrive`)."""
        ctx = self.ctx
        td = datetime.timedelta(seconds=deadline.remaining())
        if ctx.role == "writer" and ctx.rank == 0:
            store = dist.TCPStore(ctx.options.host, 0, ctx.world_size, True, timeout=td, wait_for_workers=False)
            ctx.channel.publish_endpoint(epoch, TorchRendezvous(ctx.options.host, store.port))
        else:
            rendezvous = peer_endpoint(ctx, TorchRendezvous, epoch, "writer", 0, deadline=deadline)
            if rendezvous is None:
                raise TransportError(f"{ctx.who}: writer 0 did not publish the torch rendezvous address for "
                                     f"epoch {epoch} in time{PeerWatch(ctx, 'writer', [0]).describe()}")
            where = f"writer 0's rendezvous of epoch {epoch} at {rendezvous.host}:{rendezvous.port}"
            _reach(ctx, rendezvous, where, deadline)
            try:
                store = dist.TCPStore(rendezvous.host, rendezvous.port, ctx.world_size, False,
                                      timeout=datetime.timedelta(seconds=deadline.remaining()))
            except RuntimeError as exc:  # DistNetworkError and friends: writer 0's store of this epoch is gone
                dead = PeerWatch(ctx, "writer", [0]).describe()
                raise TransportError(f"{ctx.who}: cannot join {where}{dead}: {exc}") from exc
        self._store = store
        prefix = dist.PrefixStore(f"weightsync/{epoch}", store)
        self._arrive(epoch, deadline)
        self._holders = self._lease_holders()
        return prefix

    def _lease_holders(self) -> dict[tuple[str, int], Holder] | None:
        """The processes holding the group's leases as it forms: a peer that restarts later is
        one this group is no longer connected to, dead to it even once its lease is renewed."""
        try:
            return self.ctx.channel.lease_holders(max_age=0.0)
        except Exception as exc:  # the meta server is away: only expired leases will tell
            logger.debug("%s: cannot read leases: %s", self.ctx.who, exc)
            return None

    def _arrive(self, epoch: int, deadline: Deadline) -> None:
        """Say this rank is at the epoch's store, and wait until every rank of the group is, failing
        as soon as one of them is dead or will not come, naming it.

        A process group's constructor blocks until every rank arrived, with no way to ask why
        one does not: a dead rank costs the whole timeout there. Once everyone is here it
        completes at once (a rank that dies in between is :meth:`_form_group`'s to name).

        Arrivals go through the job channel, as every transport's endpoints do
        (:class:`TorchArrival`), and are awaited by the rule every transport waits by
        (:func:`~weightsync.transport.endpoint_wait.every_endpoint`): a dead reader is named at
        once, arrived or not; a dead writer that arrived is named at once too, and one that did
        not once it is out of the epoch (its restart then joins a later one), while a restart that
        took its seat first is waited for. The transport keeps no membership of its own.

        Each rank arrives once per epoch. A restarted process that finds its predecessor's arrival
        comes to an epoch whose group formed (or is forming) with that process: the peers will
        never connect to it, and gloo's constructor would retry every pair until several times its
        timeout. It fails here at once instead, and the caller waits for the next epoch, which the
        peers open when they notice the death.
        """
        ctx = self.ctx
        earlier = ctx.channel.wait_endpoint(TorchArrival, epoch, ctx.role, ctx.rank, deadline=Deadline.after(0.0))
        if earlier is not None:
            raise TransportError(f"{ctx.who}: the process group of epoch {epoch} already counts an earlier "
                                 f"{ctx.role} {ctx.rank} (process {earlier.incarnation}; this one started after it "
                                 "joined): this rank takes part from the next epoch")
        ctx.channel.publish_endpoint(epoch, TorchArrival(ctx.channel.incarnation))
        every_endpoint(ctx, TorchArrival, epoch, deadline=deadline, what=f"the process group of epoch {epoch}")

    def _form_group(self, epoch: int, deadline: Deadline) -> Any:
        raise NotImplementedError

    def _buffer(self, lane: int, slot: int) -> torch.Tensor:
        key = (lane, slot)
        if key not in self._buffers:
            self._buffers[key] = self.dev.empty(self._message_bytes, self.device, what=f"{self.ctx.who}'s staging")
        return self._buffers[key]

    def _extra_bytes(self) -> int:
        extra = self.delta.extra_bytes() if self.delta is not None else 0
        return len(self._buffers) * self._message_bytes + extra

    def _peer_label(self, peer: int) -> str:
        return f"{'reader' if self.ctx.role == 'writer' else 'writer'} {peer}"

    def forget_received(self) -> None:
        """Something else wrote this reader's memory: with deltas, the next version comes in full."""
        if self.delta is not None:
            self.delta.forget_received()

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
        self._schedules = []
        if self.delta is not None:
            self.delta.close()


def _reach(ctx: TransportContext, rendezvous: TorchRendezvous, where: str, deadline: Deadline) -> None:
    """Until ``rendezvous`` accepts a connection: a refused one means its store is gone for good
    (writer 0 opens it before publishing its address, and closes it when it leaves the epoch).

    torch's TCPStore client instead retries a refused connection until its timeout and then,
    after a random backoff, once more: up to twice its timeout and more.

    Raises:
        TransportError: refused (naming writer 0 and, if it is dead, why), writer 0 died, or the deadline.
    """
    watch = PeerWatch(ctx, "writer", [0])
    while True:
        try:
            with socket.create_connection((rendezvous.host, rendezvous.port), timeout=min(1.0, deadline.remaining())):
                return
        except ConnectionRefusedError:
            raise TransportError(f"{ctx.who}: {where} refuses connections: writer 0 left that epoch (it failed "
                                 f"or finished it){watch.describe()}") from None
        except OSError as exc:  # unreachable for now: a slow network, or a host that went away
            watch.check(where)
            if deadline.expired:
                raise TransportError(f"{ctx.who}: cannot reach {where} in time: {exc}{watch.describe()}") from exc
            time.sleep(0.05)


@dataclass(frozen=True)
class Pair:
    """One peer of this rank and the messages exchanged with it, in order."""

    peer: int  # the peer's writer or reader rank
    peer_global: int  # its rank in the transport's process group
    messages: list[Message]


class TorchPairLink:
    """What both backends' :class:`~weightsync.transport.delta.pairs.PairLink` share: the peer is the
    pair's, and staging buffers hold one message of the transport's. Each backend's link (a
    dataclass) declares ``transport`` and ``pair`` and adds how it posts and waits."""

    transport: TorchDistBase
    pair: Pair

    @property
    def peer(self) -> int:
        return self.pair.peer

    @property
    def capacity(self) -> int:
        return self.transport._message_bytes
