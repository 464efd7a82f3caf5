"""Per-pair routing: shared memory between a writer and a reader it reaches, torch between the others.

One job spanning several nodes often has trainers and engines side by side on some of them
(Ray places actors where resources are free). ``shm`` only reaches ranks on its own node,
and ``torch`` alone would push same-node bytes through the network stack. The routed
transport splits this rank's share of the plan by pair, using the node (and, on GPU, the GPUs)
every rank published (:func:`weightsync.tools.devices.shm_pairs`: a reader that does not see its
writer's GPU cannot map it by CUDA IPC), and drives a :class:`SharedMemoryTransport` over the
same-node ops and a torch transport (gloo on CPU, NCCL on GPU) over the rest, each exactly
as it runs alone::

    transport = create_transport("routed", ctx)      # ctx.placements: every rank's node
    transport.connect(e, deadline=deadline)          # each route it may take (deadline: the caller's)
    transport.bind(plan, tensors, deadline=deadline) # each route's part of the plan
    transport.send(version, deadline=deadline)       # writer: shm part, then torch part
    transport.receive(version, deadline=deadline)    # reader: same order
    transport.routes                                 # {"shm": [(w, r), ...], "torch": [...]}

Ordering keeps it deadlock-free: the shared-memory side of a writer never waits for a
reader (readers wait for its bytes), so every writer reaches its torch sends, and every
reader its torch receives, after a bounded shm step. ``auto`` picks this transport when
ranks span several nodes and at least one writer shares a node with a reader
(:func:`weightsync.tools.devices.choose_transport`).

Failures: a torch-side failure is a :class:`TransportError`, as alone. The shm side's
version slots are protected by the writer's staleness wait (``SyncConfig`` keeps
``slots > staleness``), and a reader whose slot was overwritten sees it by the slot's
sequence word, as with ``shm`` alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np

from weightsync.clock.deadline import Deadline
from weightsync.tools.devices import shm_pairs
from weightsync.transport.base import TransferStats, Transport, TransportBase, TransportContext

if TYPE_CHECKING:
    import torch

    from weightsync.plan import Plan
    from weightsync.transport.digests import VersionDigests

logger = logging.getLogger(__name__)

Route = Literal["shm", "torch"]
ROUTES: tuple[Route, ...] = ("shm", "torch")  # the order both sides run them in


def check_host_phases(device: str, phases: int) -> None:
    """Refuse layer phases over host memory where readers cannot take a phase as it is packed.

    Each route blocks per phase, so a shm reader must take phase ``p`` before the writer moves
    on; host-memory readers may do so only where the CPU keeps store order (x86-64:
    :mod:`weightsync.transport.shm.snapshot`), and would otherwise wait for a slot the writer
    seals only after the torch route's phases, which wait for them.
    """
    from weightsync.ports import device as device_port
    from weightsync.transport.shm import snapshot as shm_snapshot

    if phases > 1 and not device_port.current().is_gpu(device) and not shm_snapshot.host_streams():
        raise ValueError("layer_phases with the routed transport on host memory needs a CPU that keeps store order "
                         f"(x86-64), and this one is {shm_snapshot.platform.machine()}: its shared-memory readers "
                         "wait for whole slots, which the other route's phases would never let the writer finish. "
                         "Use layer_phases=False, or transport 'torch'")


class RoutedTransport(TransportBase):
    """``shm`` for same-node pairs and ``torch`` for the others (see module docstring)."""

    name: ClassVar[str] = "routed"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = False  # its torch part needs the writer
    serves_cpu: ClassVar[bool] = True
    serves_cuda: ClassVar[bool] = True
    carries_deltas: ClassVar[bool] = True  # both routes do
    publishes_before_send: ClassVar[bool] = True  # both parts: torch posts receives, shm streams
    #: Integrity digests fused where both routes fuse them (each digests its own pairs' pieces).
    fuses_digests: ClassVar[frozenset[str]] = frozenset({"writer", "reader"})

    def __init__(self, ctx: TransportContext) -> None:
        local = shm_pairs(ctx.placements)
        want = {(w, r) for w in range(ctx.num_writers) for r in range(ctx.num_readers)}
        if missing := sorted(want - set(local)):
            raise ValueError(f"{ctx.who}: the routed transport needs every rank's node (TransportContext."
                             f"placements), but writer/reader pairs {missing[:4]} have none")
        super().__init__(ctx)
        self._local = np.zeros((ctx.num_writers, ctx.num_readers), dtype=bool)
        for (w, r), together in local.items():
            self._local[w, r] = together
        self._subs: dict[Route, Transport] = {}
        self._active: list[Route] = []
        self.routes: dict[Route, list[tuple[int, int]]] = {"shm": [], "torch": []}
        #: bytes each route moved in the last send/receive (summed over its phases)
        self.last_bytes: dict[Route, int] = {"shm": 0, "torch": 0}
        self._digests: VersionDigests | None = None

    def use_digests(self, digests: VersionDigests | None) -> bool:
        """Both routes digest as they copy, or neither (torch declines with deltas)."""
        self._digests = digests if not self.ctx.options.delta_anchor_every else None
        for sub in self._subs.values():
            sub.use_digests(self._digests)  # type: ignore[attr-defined]  # both routes fuse
        return self._digests is not None

    def _sub(self, route: Route) -> Transport:
        if route not in self._subs:
            from weightsync.transport import create_transport

            sub = self._subs[route] = create_transport(route, self.ctx)
            if self._digests is not None:
                sub.use_digests(self._digests)  # type: ignore[attr-defined]  # both routes fuse
        return self._subs[route]

    def _part(self, plan: Plan, route: Route) -> Plan:
        c = plan.columns
        together = self._local[np.asarray(c.src_rank, dtype=np.int64), np.asarray(c.dst_rank, dtype=np.int64)]
        return plan.subset(np.flatnonzero(together if route == "shm" else ~together), tag=route)

    def _connect(self, epoch: int, deadline: Deadline) -> None:
        """Connect every route this rank may take: torch whenever any pair crosses nodes (group
        formation is collective), shared memory when this rank has a same-node peer."""
        mine = self._local[self.ctx.rank] if self.ctx.role == "writer" else self._local[:, self.ctx.rank]
        for route in ROUTES:
            if (route == "shm" and mine.any()) or (route == "torch" and not self._local.all()):
                self._sub(route).connect(epoch, deadline=deadline)

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        check_host_phases(self.ctx.device, len(parts))
        active: list[Route] = []
        for route in ROUTES:
            part = self._part(plan, route)
            self.routes[route] = sorted(part.pairs())
            # Every rank binds the torch route when any pair crosses nodes (it connected to the
            # group); shared memory only ranks with same-node ops.
            needed = len(part) > 0 if route == "shm" else not self._local.all()
            if not needed:
                continue
            sub_phases = [self._part(p, route) for p in parts] if len(parts) > 1 else None
            self._sub(route).bind(part, tensors, deadline=deadline, phases=sub_phases)
            active.append(route)
        self._active = active
        logger.info("%s routes %d pair(s) over shm and %d over torch", self.ctx.who, len(self.routes["shm"]),
                    len(self.routes["torch"]))

    def send(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        return self._run(version, deadline, phase, sending=True)

    def receive(self, version: int, *, deadline: Deadline, phase: int = 0) -> TransferStats:
        return self._run(version, deadline, phase, sending=False)

    def _run(self, version: int, deadline: Deadline, phase: int, *, sending: bool) -> TransferStats:
        total = TransferStats(version)
        if phase == 0:
            self.last_bytes = {"shm": 0, "torch": 0}
        for route in self._active:
            sub = self._subs[route]
            move = sub.send if sending else sub.receive
            stats = move(version, deadline=deadline, phase=phase)
            self.last_bytes[route] += stats.nbytes
            total.nbytes += stats.nbytes
            total.messages += stats.messages
            total.direct_bytes += stats.direct_bytes
            total.peak_extra_bytes = max(total.peak_extra_bytes, stats.peak_extra_bytes)
            for name, seconds in stats.phases.items():
                total.add_phase(f"{route}.{name}", seconds)
        return total

    def forget_received(self) -> None:
        for sub in self._subs.values():
            sub.forget_received()

    def abandon(self, version: int) -> None:
        for sub in self._subs.values():
            sub.abandon(version)

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
        self._active = []
        self.epoch = None
