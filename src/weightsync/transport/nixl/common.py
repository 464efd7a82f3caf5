"""NIXL transport, what both modes share: one-sided READs (pull) or WRITEs (push) over UCX.

Both modes make an agent per epoch (``connect``), register memory, exchange NIXL agent
metadata as job-channel endpoints and prepare every transfer handle once per plan (``bind``); ``send``/``receive`` only
repost those handles. All NIXL calls go through :mod:`weightsync.transport.nixl.agent`
(progress thread off, a 1 ms notification poller, ordered teardown).

**Pull** (:mod:`weightsync.transport.nixl.pull`): works like the shared-memory transport,
across hosts. Each writer lays out the pieces it provides (:mod:`weightsync.transport.exposed`)
in ``slots`` version slots with one sequence word per slot. ``send(V)`` packs slot
``V % slots`` (the one writer-side copy, which also converts dtypes) and never waits for
readers. ``receive(V)`` READs the writer's sequence words until the slot holds ``V``,
READs its ops straight into the destination tensors (dense destinations, one descriptor
each) or, for strided destinations, into a registered landing buffer it scatters from,
then READs the sequence words again: a version overwritten mid-read is reported, never
applied. The reader learns completion from its own handle (``check_xfer_state``); the
writer needs no notification, because WeightWriter keeps it ``slots - 1`` versions ahead
of the slowest reader at most.

**Push** (:mod:`weightsync.transport.nixl.push`): writers WRITE every op straight into
readers' registered parameters, from the live shards when no dtype changes (zero copies)
or from a packed area. A reader raises its *ready word* to ``V`` in ``receive(V)``;
``send(V)`` READs it before writing into live parameters, then WRITEs with a notification
carrying ``V``. NIXL sends the notification after the data and a flush, so its arrival
completes the reader's ``receive``. Push is not one-sided (the writer waits for readers):
it serves each reader as soon as it asks, and under a completion policy other than ``all``
goes on without one that dies, fails or is late. Once it sent ``V`` to every reader it serves,
its own word says ``V``; a reader that asks for ``V`` later fails at once rather than at its timeout.

**Choosing** (``TransportOptions.nixl_mode``, the same on every rank; :func:`resolve_mode`,
applied by :func:`weightsync.transport.create_transport`): a push writer performs every
write itself, once per reader it feeds; a pull writer only packs once and the readers do
the rest. ``auto`` therefore picks push when there are at most as many readers as writers
(the writers' time is about one pack's worth either way, and push copies each byte once
instead of twice, needs no version slots on the writer and leaves the reader's CPU idle)
and pull when readers outnumber writers (fan-out: the writer's time stays one pack, the
reads spread over the readers, and a reader may lag ``slots - 1`` versions without holding
the writers up). Both modes carry deltas (:mod:`weightsync.transport.nixl.pull`,
:mod:`weightsync.transport.nixl.push_changes`); with ``delta_anchor_every`` ``auto`` picks pull:
a push writer with deltas packs every op into two slots (it no longer sends from the live
shards) and still waits for every reader, while a pull writer publishes each version's changes
once and never waits. Figures: docs/benchmarks.md, "NIXL" and "Delta sync".

Every wait has a deadline and keeps operating on the peers it waits for, so a dead peer
is a :class:`TransportError` naming it, within the timeout.

    t = create_transport("nixl", ctx)   # NixlPullTransport or NixlPushTransport, by mode
    t.connect(e, deadline=deadline)            # the epoch's agent
    t.bind(plan, tensors, deadline=deadline)   # register, exchange metadata, prepare the handles
    t.send(v, deadline=deadline)    # or t.receive(v, deadline=deadline): repost the prepared handles
    t.close()

**Memory that moves** within an epoch (a trainer's ``param.data = t``, an optimizer that swaps
buffers; :meth:`weightsync.session.sync_session.SyncSession.arm` then binds this rank again without
connecting it): peers connect to a rank's agent and learn its addresses once per epoch, so such a
bind keeps the agent, its registrations and its peers (:meth:`NixlBase._follow`). Memory no
peer or handle addresses (what a writer packs from) is simply taken from the new tensors;
registered memory that moved (a push writer's live shards, a push reader's destinations) stays
registered, and each version is copied through it (new -> registered before, registered -> new
after a push reader's receive) until the next epoch registers the new memory. A pull reader
binds in full again (a new agent in the same epoch): its writers never address it.

Endpoints (msgpack, through the job channel), one per rank and epoch: each writer's (NIXL
agent metadata, address of its control words; in pull also the slot area and the exposed
index) and, in push, each reader's (agent metadata, ready word, destination tensor
addresses; with deltas its inboxes, and each push writer says it sends deltas). Addresses
travel as plain integers; NIXL's own descriptor serialisation is
pickle, which we never load from the network.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from weightsync.clock.deadline import Deadline
from weightsync.layout.types import itemsize
from weightsync.ports import device as device_port
from weightsync.tools.devices import nixl_device_id
from weightsync.tools.torch_layout import TORCH_DTYPES
from weightsync.transport.base import (
    PeerWatch,
    TransportBase,
    TransportContext,
    TransportError,
)
from weightsync.transport.endpoint_wait import peer_endpoint
from weightsync.transport.endpoints import NixlEndpoint, NixlSlots
from weightsync.transport.exposed import ExposedIndex
from weightsync.transport.nixl.agent import Descriptors, NixlAgent, Xfer
from weightsync.transport.tensors import flat_views, op_src_view

if TYPE_CHECKING:
    from weightsync.job.channel import Role
    from weightsync.plan import Plan, TransferOp
    from weightsync.transport.digests import VersionDigests
    from weightsync.transport.schedule import Message, Piece

logger = logging.getLogger(__name__)

EMPTY = -1  # sequence word of a slot being written
#: Phases per plan at most: push tokens are ``version << 12 | phase``.
MAX_PHASES = 1 << 12


def phase_token(version: int, phase: int) -> int:
    """What a push reader's ready word and a writer's notification carry: version and phase."""
    return version << 12 | phase


def token_text(token: int) -> str:
    """A push reader's ready word (a :func:`phase_token`, or -1), for messages."""
    return f"version {token >> 12} phase {token & (MAX_PHASES - 1)}" if token >= 0 else "nothing"


def notif_token(message: bytes) -> int:
    """The token a push writer's notification carries (-1: not one of ours)."""
    try:
        return int(message[1:]) if message[:1] == b"v" else -1
    except ValueError:
        return -1

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def resolve_mode(mode: str, *, num_writers: int, num_readers: int | None, delta: bool = False) -> str:
    """The mode ``auto`` stands for in a deployment (see module docstring, "Choosing"); with
    deltas always pull (both carry them; a pull writer never waits for readers), and for an
    elastic set of readers (``num_readers=None``: a push writer would send to each one)."""
    if mode != "auto":
        return mode
    return "push" if num_readers is not None and num_readers <= num_writers and not delta else "pull"


class NixlBase(TransportBase):
    """Lifecycle and setup both modes share; a mode implements its four role methods."""

    name: ClassVar[str] = "nixl"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool]
    publishes_before_send: ClassVar[bool]
    serves_cpu: ClassVar[bool] = True
    serves_cuda: ClassVar[bool] = True  # GPUDirect RDMA where UCX has it
    #: Both modes carry deltas in host memory (each mode's class says so).
    carries_deltas: ClassVar[bool] = False
    mode: ClassVar[str]

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.dev = device_port.current()
        self.device = torch.device(ctx.device)
        self.slots = ctx.options.slots
        self._starts: list[int] = []  # where this rank's memory registrations begin (Descriptors.of)
        self.who = ctx.who
        #: Seconds, bytes and counts of the last connect and full bind: registration is paid there, once.
        self.setup: dict[str, float] = {}
        self._agent: NixlAgent | None = None
        self._flats: dict[str, torch.Tensor] = {}
        self._ctl = torch.empty(0, dtype=torch.int64)  # control words peers READ (and mirrors of theirs)
        self._area: torch.Tensor | None = None  # writer: packed pieces (pull: all slots)
        self._index: ExposedIndex | None = None
        self._copies: list[list[tuple[str, TransferOp]]] = []  # per phase
        self._slot_bytes = 0
        self._landing: torch.Tensor | None = None  # pull reader: staged messages land here
        self._peers: list[Peer] = []
        self._bound_to: tuple[Plan, list[Plan]] | None = None  # the plan and phases registered for
        self._pinned: set[str] = set()  # tensors whose registered storage peers or handles address
        self._moved: dict[str, torch.Tensor] = {}  # pinned tensor -> where the caller's now lives
        self._digests: VersionDigests | None = None

    #: Integrity digests in the same pass as the writer's pack; readers digest each READ's or
    #: writer's bytes as soon as they arrived (no copy of theirs to fuse with).
    fuses_digests: ClassVar[frozenset[str]] = frozenset({"writer", "reader"})

    def use_digests(self, digests: VersionDigests | None) -> bool:
        """Digest while packing, and what arrived as it arrives (see :attr:`fuses_digests`)."""
        self._digests = digests
        return True

    # -- lifecycle --------------------------------------------------------------------------
    def _connect(self, epoch: int, deadline: Deadline) -> None:
        """The epoch's agent (the old one, its registrations and peers released): peers learn
        its metadata from the endpoint the first bind publishes."""
        self.close()
        self._new_agent(epoch)

    def _new_agent(self, epoch: int) -> None:
        started = time.perf_counter()
        name = f"weightsync-{self.ctx.role}{self.ctx.rank}-e{epoch}-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent = NixlAgent(name, who=self.who, loopback=self.ctx.options.host in _LOOPBACK)
        self.setup = {"agent_seconds": time.perf_counter() - started}

    def _bind(self, plan: Plan, parts: Sequence[Plan], tensors: Mapping[str, torch.Tensor],
              deadline: Deadline) -> None:
        """Register, exchange metadata and prepare every handle for the plan; within an epoch
        already bound, follow memory that moved instead (see "Memory that moves")."""
        parts = list(parts)
        if len(parts) > MAX_PHASES:
            raise ValueError(f"{self.who}: {len(parts)} phases; NIXL tokens allow at most {MAX_PHASES}")
        epoch = self.epoch
        assert epoch is not None, "bind runs within a connected epoch"
        if self._bound_to is not None:
            if self._follow(plan, parts, tensors):
                return
            self._release()  # not a move it follows (a pull reader's): start over within the epoch
            self._new_agent(epoch)
        started = time.perf_counter()
        self._flats = flat_views(tensors)
        try:
            if self.ctx.role == "writer":
                self._prepare_writer(parts, epoch, deadline)
            else:
                self._prepare_reader(parts, epoch, deadline)
        except BaseException:
            self.close()
            raise
        self._bound_to = (plan, parts)
        self.setup["prepare_seconds"] = time.perf_counter() - started
        logger.info("%s: nixl %s bound in epoch %d: %s", self.who, self.mode, epoch, self.setup)

    def close(self) -> None:
        """Release handles, peers and registrations, then the agent (idempotent)."""
        self._release()
        self.epoch = None

    def _release(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()
        self._peers = []
        self._area = self._landing = None
        self._index = None
        self._copies = []
        self._flats = {}
        self._bound_to = None
        self._pinned, self._moved = set(), {}

    def _follows_moves(self) -> bool:
        """Whether a move of this rank's memory within an epoch keeps its agent and peers (a pull
        reader, whose writers never address it, re-binds in full instead)."""
        return True

    def _follow(self, plan: Plan, parts: list[Plan], tensors: Mapping[str, torch.Tensor]) -> bool:
        """Take tensors that moved within the bound epoch and plan without a new agent (see
        "Memory that moves"); False when this is not such a move (the caller starts over)."""
        bound = self._bound_to
        if (bound is None or bound[0] is not plan or len(bound[1]) != len(parts)
                or any(a is not b for a, b in zip(bound[1], parts, strict=True)) or not self._follows_moves()):
            return False
        flats = flat_views(tensors)
        current = {name: self._moved.get(name, t) for name, t in self._flats.items()}
        if flats.keys() != current.keys() or any(
                (t.dtype, t.numel(), t.device) != (current[n].dtype, current[n].numel(), current[n].device)
                for n, t in flats.items()):
            return False
        moved = [n for n, t in flats.items() if t.data_ptr() != current[n].data_ptr()]
        if not moved:
            return False  # bound again in place: start over
        for name in moved:
            if name not in self._pinned:
                self._flats[name] = flats[name]
            elif flats[name].data_ptr() == self._flats[name].data_ptr():
                self._moved.pop(name, None)  # back in the registered storage
            else:
                self._moved[name] = flats[name]
        logger.warning("%s: %d tensor(s) moved to new storage within epoch %s; NIXL peers address what was "
                       "registered, so %d of them are copied through it each version until the next epoch",
                       self.who, len(moved), self.epoch, len(self._moved))
        return True

    def _copy_in(self) -> None:
        """Moved tensors -> the registered storage peers and handles address."""
        for name, t in self._moved.items():
            self.dev.copy(self._flats[name], t)

    def _copy_out(self) -> None:
        """The registered storage -> where the caller's tensors now live (a push reader's receive)."""
        if self._moved:
            for name, t in self._moved.items():
                self.dev.copy(t, self._flats[name])
            self.dev.synchronize(self.device)

    def _moved_bytes(self) -> int:
        """Registered storage kept alive for tensors that moved (extra memory until the next epoch)."""
        return sum(t.numel() * t.element_size() for t in self._moved.values())

    def forget_received(self) -> None:
        """Nothing is kept between receives (a mode with deltas overrides this)."""

    def __enter__(self) -> NixlBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare_writer(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        raise NotImplementedError

    def _prepare_reader(self, parts: list[Plan], epoch: int, deadline: Deadline) -> None:
        raise NotImplementedError

    def _exposed(self, parts: list[Plan], keep: Any = None) -> None:
        """This writer's pieces laid out phase by phase (``_index``) and its copies per phase."""
        me = self.ctx.rank
        ops = [op for part in parts for op in part.ops if op.src_rank == me and (keep is None or keep(op))]
        self._index, first = ExposedIndex.for_ops(ops)
        phase_of = {t: i for i, part in enumerate(parts) for t in {op.canonical for op in part.ops}}
        self._copies = [[(k, op) for k, op in first if phase_of[op.canonical] == i] for i in range(len(parts))]

    # -- setup shared by both modes ---------------------------------------------------------
    def _register(self, tensors: Sequence[torch.Tensor], *, words: torch.Tensor) -> None:
        """Register each distinct storage behind ``tensors`` once (views share storages), and the
        control ``words`` (host memory whatever the device)."""
        assert self._agent is not None
        t0 = time.perf_counter()
        by_kind: dict[tuple[str, int], dict[int, int]] = {}
        for t in [*tensors, words]:
            storage = t.untyped_storage()
            gpu = t is not words and self.dev.is_gpu(t.device)
            kind = ("VRAM", t.device.index or 0) if gpu else ("DRAM", 0)
            by_kind.setdefault(kind, {})[storage.data_ptr()] = storage.nbytes()
        for (mem, dev), regions in by_kind.items():
            self._agent.register(sorted(regions.items()), mem, dev)
        self._starts = sorted({start for regions in by_kind.values() for start in regions})
        self.setup["register_seconds"] = self.setup.get("register_seconds", 0.0) + time.perf_counter() - t0
        self.setup["registered_bytes"] = self.setup.get("registered_bytes", 0) + sum(
            n for regions in by_kind.values() for n in regions.values())

    def _publish(self, epoch: int, *, slots: NixlSlots | None = None,
                 shards: Mapping[str, tuple[int, int]] | None = None, deltas: bool = False,
                 inboxes: Mapping[int, tuple[int, int]] | None = None) -> None:
        """This rank's endpoint of the epoch: mode, agent metadata, control words, and what its
        mode exposes (a pull writer's ``slots``; a push reader's ``shards`` and, with deltas,
        ``inboxes``; a push writer whether it sends ``deltas``)."""
        assert self._agent is not None
        self.ctx.channel.publish_endpoint(epoch, NixlEndpoint(self.mode, self._agent.metadata(), self._ctl.data_ptr(),
                                                              self.ctx.device, slots, shards, deltas, inboxes))

    def _connect_peer(self, epoch: int, role: Role, rank: int, deadline: Deadline,
                      agree: Callable[[NixlEndpoint, str], None] | None = None) -> Peer:
        """Wait for a peer's endpoint, check that it agrees with us (``agree`` adds the caller's
        checks), then connect to its agent: a setting that does not combine is named from the
        published endpoint alone, before any connection that a loaded host could refuse."""
        assert self._agent is not None
        label = f"{role} {rank}"
        endpoint = peer_endpoint(self.ctx, NixlEndpoint, epoch, role, rank, deadline=deadline)
        if endpoint is None:  # a dead peer is named: a stopped or killed one never publishes
            why = PeerWatch(self.ctx, role, [rank]).describe() or " (is it running with transport 'nixl'?)"
            raise TransportError(f"{self.who}: {label} did not publish its NIXL metadata for epoch "
                                 f"{epoch} in time{why}")
        if endpoint.mode != self.mode:
            raise TransportError(f"{self.who}: {label} uses nixl_mode {endpoint.mode!r}, this rank "
                                 f"{self.mode!r}; set the same TransportOptions.nixl_mode everywhere")
        if agree is not None:
            agree(endpoint, label)
        t0 = time.perf_counter()
        peer = Peer(rank, label, self._agent.connect(endpoint.agent, label=label, deadline=deadline), endpoint,
                    PeerWatch(self.ctx, role, [rank]))
        self.setup["connect_seconds"] = self.setup.get("connect_seconds", 0.0) + time.perf_counter() - t0
        return peer

    def _run(self, peer: Peer, xfer: Xfer, deadline: Deadline, notif: bytes = b"") -> None:
        """Run a prepared transfer with ``peer``, failing soon after its lease expires."""
        assert self._agent is not None
        self._agent.run(xfer, deadline, notif, alive=peer.watch.check)

    def _prepared_agent(self, call: str) -> NixlAgent:
        """The NIXL agent, or the error that ``call`` before ``connect()`` deserves."""
        if self._agent is None:
            raise RuntimeError(f"{self.who}: {call}() before connect() and bind()")
        return self._agent

    def _prepare_xfer(self, peer: Peer, op: str, descs: Descriptors, what: str, *, data: bool = True) -> Xfer:
        """A prepared READ/WRITE with ``peer``: data on each side's device (the peer's published
        one for the remote list), control words in host memory."""
        assert self._agent is not None
        cuda = data and self.dev.is_gpu(self.device)
        xfer = self._agent.prepare(op, peer.agent, descs, "VRAM" if cuda else "DRAM", what=what,
                                   local_device=nixl_device_id(self.ctx.device) if cuda else 0,
                                   remote_device=nixl_device_id(peer.endpoint.device) if cuda else 0)
        self.setup["descriptors"] = self.setup.get("descriptors", 0) + xfer.descriptors
        self.setup["handles"] = self.setup.get("handles", 0) + 1
        return xfer

    def _word_xfer(self, peer: Peer, local: torch.Tensor, what: str) -> Xfer:
        """A READ of the peer's control words (as many as ``local`` holds) into ``local``."""
        descs = Descriptors.of([local.data_ptr()], [peer.endpoint.ctl], [local.numel() * local.element_size()])
        return self._prepare_xfer(peer, "READ", descs, what, data=False)

    def _pack(self, base: int, phase: int, then: Callable[[str, TransferOp, int], None] | None = None) -> int:
        """Copy (and convert) the phase's distinct pieces into the area at ``base``; returns bytes.
        ``then(key, op, at)`` runs after each piece is copied (host memory: the copy is done)."""
        assert self._area is not None and self._index is not None
        nbytes = 0
        for key, op in self._copies[phase]:
            at, n = self._index.entries[key]
            out = self._area[base + at: base + at + n].view(TORCH_DTYPES[op.dst_dtype]).view(op.box.sizes)
            if self._digests is None:
                self.dev.copy(out, op_src_view(self._flats, op))
            else:  # digested in the same pass (a digest op: its pair's digests first)
                self._digests.pack(op, out, op_src_view(self._flats, op), copy=self.dev.copy)
            if then is not None:
                then(key, op, at)
            nbytes += n
        self.dev.synchronize(self.device)  # also orders the training stream before peers read
        return nbytes

# -- descriptor geometry: pure functions of an op -----------------------------------------------

def contiguous_runs(sizes: Sequence[int], a_strides: Sequence[int],
                    b_strides: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Element offsets of the runs contiguous in *both* strided views, and the run length.

    The innermost dimensions that are dense in both views merge into one run; the
    remaining (outer) dimensions enumerate the runs in row-major order of the box.
    """
    dims = [(n, sa, sb) for n, sa, sb in zip(sizes, a_strides, b_strides, strict=True) if n != 1]
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    a = np.zeros(1, dtype=np.int64)
    b = np.zeros(1, dtype=np.int64)
    for n, sa, sb in dims:
        step = np.arange(n, dtype=np.int64)
        a = (a[:, None] + step * sa).ravel()
        b = (b[:, None] + step * sb).ravel()
    return a, b, run


def extent(sizes: Sequence[int], strides: Sequence[int], offset: int) -> int:
    """One past the last element a strided view touches."""
    return offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)) + 1


def send_live(op: TransferOp) -> bool:
    """Write from the live shard when nothing is converted and the source does not split
    the destination's runs further (packing would then only add a copy)."""
    if op.converts:
        return False
    live = contiguous_runs(op.box.sizes, op.src_strides, op.dst_strides)[2]
    return live == contiguous_runs(op.box.sizes, row_major(op.box.sizes), op.dst_strides)[2]


class Peer:
    """A connected peer: its rank, NIXL agent name, published endpoint and prepared transfers."""

    def __init__(self, rank: int, label: str, agent: str, endpoint: NixlEndpoint, watch: PeerWatch) -> None:
        self.rank = rank
        self.label = label
        self.agent = agent
        self.endpoint = endpoint
        #: its lease: a stopped peer never fails a transfer, it only stops progressing it
        self.watch = watch
        #: READ of the peer's control words (sequence words, ready word, or liveness).
        self.ctl: Xfer | None = None
        #: Per phase, per version slot (push: one), the transfers to run, each with the staged
        #: message it lands (None: straight into destination tensors).
        self.phases: list[list[list[tuple[Xfer, Message | None]]]] = []
        #: Per phase, the bytes this peer moves (push reader: what each notification completes).
        self.nbytes: list[int] = []


def row_major(sizes: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major array of ``sizes``."""
    return tuple(math.prod(sizes[d + 1:]) for d in range(len(sizes)))


def slab_offset(piece: Piece) -> int:
    """Byte offset of a slab of an op inside the op's packed (row-major) bytes."""
    rel = (p - o for p, o in zip(piece.box.offsets, piece.op.box.offsets, strict=True))
    return sum(r * s for r, s in zip(rel, row_major(piece.op.box.sizes), strict=True)) * itemsize(piece.op.dst_dtype)
