"""NIXL transport: one-sided READs (pull) or WRITEs (push) over UCX, prepared once per plan.

Both modes register memory, exchange NIXL agent metadata through the meta server and
prepare every transfer handle once per plan (``prepare``); ``send``/``receive`` only
repost those handles. All NIXL calls go through :mod:`weightsync.transport.nixl_agent`
(progress thread off, a 1 ms notification poller, ordered teardown).

**Pull** (:class:`NixlTransport`): works like the shared-memory transport, across hosts.
Each writer lays out the pieces it provides (:mod:`weightsync.transport.exposed`) in
``slots`` version slots with one sequence word per slot. ``send(V)`` packs slot
``V % slots`` (the one writer-side copy, which also converts dtypes) and never waits for
readers. ``receive(V)`` READs the writer's sequence words until the slot holds ``V``,
READs its ops straight into the destination tensors (dense destinations, one descriptor
each) or, for strided destinations, into a registered landing buffer it scatters from,
then READs the sequence words again: a version overwritten mid-read is reported, never
applied. The reader learns completion from its own handle (``check_xfer_state``); the
writer needs no notification, because WeightWriter keeps it ``slots - 1`` versions ahead
of the slowest reader at most.

**Push** (:class:`~weightsync.transport.nixl_push.NixlPushTransport`, its own module):
writers WRITE every op straight into readers'
registered parameters, from the live shards when no dtype changes (zero copies) or from
a packed area. A reader raises its *ready word* to ``V`` in ``receive(V)``; ``send(V)``
READs it before writing into live parameters, then WRITEs with a notification carrying
``V``. NIXL sends the notification after the data and a flush, so its arrival completes
the reader's ``receive``. Push is not one-sided (the writer waits for readers).

**Choosing** (``TransportOptions.nixl_mode``, the same on every rank): a push writer
performs every write itself, once per reader it feeds; a pull writer only packs once and
the readers do the rest. ``auto`` therefore picks push when there are at most as many
readers as writers (the writers' time is about one pack's worth either way, and push
copies each byte once instead of twice, needs no version slots on the writer and leaves
the reader's CPU idle) and pull when readers outnumber writers (fan-out: the writer's
time stays one pack, the reads spread over the readers, and a reader may lag ``slots - 1``
versions without holding the writers up). Figures: docs/benchmarks.md, "NIXL".

Every wait has a deadline and keeps operating on the peers it waits for, so a dead peer
is a :class:`TransportError` naming it, within the timeout.

    t = NixlTransport(ctx)   # a NixlPushTransport when the mode resolves to push
    t.prepare(plan, tensors, generation=g, timeout=60)   # register, exchange metadata, prepare
    t.send(v, timeout=60)    # or t.receive(v, timeout=60): repost the prepared handles
    t.close()

Meta documents (msgpack), one per rank and generation, under ``transport/nixl/<g>/``:
``writer<w>`` (NIXL agent metadata, address of its control words; in pull also the slot
area and the exposed index) and, in push, ``reader<r>`` (agent metadata, ready word,
destination tensor addresses). Addresses travel as plain integers; NIXL's own descriptor
serialisation is pickle, which we never load from the network.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import numpy as np
import torch

from weightsync.layout.types import itemsize
from weightsync.transport.base import PhaseTimer, TransferStats, TransportContext, TransportError
from weightsync.transport.exposed import ExposedIndex
from weightsync.transport.nixl_agent import Descriptors, NixlAgent, Xfer
from weightsync.transport.schedule import Message, Piece, build_messages
from weightsync.transport.tensors import TORCH_DTYPES, flat_views, scatter

if TYPE_CHECKING:
    from weightsync.plan import Plan, TransferOp

logger = logging.getLogger(__name__)

EMPTY = -1  # sequence word of a slot being written
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def resolve_mode(mode: str, *, num_writers: int, num_readers: int) -> str:
    """The mode ``auto`` stands for in a deployment (see module docstring, "Choosing")."""
    if mode != "auto":
        return mode
    return "push" if num_readers <= num_writers else "pull"


class NixlTransport:
    """Pull mode (see module docstring). ``NixlTransport(ctx)`` returns a
    :class:`~weightsync.transport.nixl_push.NixlPushTransport` when the mode resolves to
    push (as ``pathlib.Path()`` returns a ``PosixPath``), so the registry needs one entry
    for both modes."""

    name: ClassVar[str] = "nixl"
    writes_in_place: ClassVar[bool] = True
    one_sided: ClassVar[bool] = True
    mode: ClassVar[str] = "pull"

    def __new__(cls, ctx: TransportContext) -> NixlTransport:
        mode = resolve_mode(ctx.options.nixl_mode, num_writers=ctx.num_writers, num_readers=ctx.num_readers)
        if cls is NixlTransport and mode == "push":
            from weightsync.transport.nixl_push import NixlPushTransport

            return object.__new__(NixlPushTransport)
        return object.__new__(cls)

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = torch.device(ctx.options.device)
        self.slots = ctx.options.slots
        self.who = f"{ctx.role} {ctx.rank}"
        self.generation: int | None = None
        #: Seconds, bytes and counts of the last prepare(): registration is paid there, once.
        self.setup: dict[str, float] = {}
        self._agent: NixlAgent | None = None
        self._flats: dict[str, torch.Tensor] = {}
        self._ctl = torch.empty(0, dtype=torch.int64)  # control words peers READ (and mirrors of theirs)
        self._area: torch.Tensor | None = None  # writer: packed pieces (pull: all slots)
        self._index: ExposedIndex | None = None
        self._copies: list[tuple[str, TransferOp]] = []
        self._slot_bytes = 0
        self._landing: torch.Tensor | None = None  # pull reader: staged messages land here
        self._peers: list[Peer] = []

    # -- lifecycle --------------------------------------------------------------------------
    def prepare(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, generation: int,
                timeout: float) -> None:
        """Start over for a plan: new agent, registrations, metadata exchange, handles."""
        self.close()
        deadline = time.monotonic() + timeout
        self._flats = flat_views(tensors)
        started = time.perf_counter()
        name = f"weightsync-{self.ctx.role}{self.ctx.rank}-g{generation}-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent = NixlAgent(name, who=self.who, loopback=self.ctx.options.host in _LOOPBACK)
        self.setup = {"agent_seconds": time.perf_counter() - started}
        try:
            if self.ctx.role == "writer":
                self._prepare_writer(plan, generation, deadline)
            else:
                self._prepare_reader(plan, generation, deadline)
        except BaseException:
            self.close()
            raise
        self.generation = generation
        self.setup["prepare_seconds"] = time.perf_counter() - started
        logger.info("%s: nixl %s prepared for generation %d: %s", self.who, self.mode, generation, self.setup)

    def close(self) -> None:
        """Release handles, peers and registrations, then the agent (idempotent)."""
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()
        self._peers = []
        self._area = self._landing = None
        self._index = None
        self._copies = []
        self._flats = {}
        self.generation = None

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- setup shared by both modes ---------------------------------------------------------
    def _register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each distinct storage behind ``tensors`` once (views share storages)."""
        assert self._agent is not None
        t0 = time.perf_counter()
        by_kind: dict[tuple[str, int], dict[int, int]] = {}
        for t in tensors:
            storage = t.untyped_storage()
            kind = ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)
            by_kind.setdefault(kind, {})[storage.data_ptr()] = storage.nbytes()
        for (mem, dev), regions in by_kind.items():
            self._agent.register(sorted(regions.items()), mem, dev)
        self.setup["register_seconds"] = self.setup.get("register_seconds", 0.0) + time.perf_counter() - t0
        self.setup["registered_bytes"] = self.setup.get("registered_bytes", 0) + sum(
            n for regions in by_kind.values() for n in regions.values())

    def _publish(self, generation: int, doc: dict[str, Any]) -> None:
        assert self._agent is not None
        doc = {"mode": self.mode, "agent": self._agent.metadata(), "ctl": self._ctl.data_ptr(), **doc}
        self.ctx.meta.put_document(f"transport/nixl/{generation}/{self.ctx.role}{self.ctx.rank}",
                                   msgpack.packb(doc))

    def _connect(self, generation: int, role: str, rank: int, deadline: float) -> Peer:
        """Wait for a peer's document, check that it agrees with us, connect to its agent."""
        assert self._agent is not None
        label = f"{role} {rank}"
        raw = self.ctx.meta.get_document(f"transport/nixl/{generation}/{role}{rank}",
                                         wait=max(deadline - time.monotonic(), 0.0))
        if raw is None:
            raise TransportError(f"{self.who}: {label} did not publish its NIXL metadata for generation "
                                 f"{generation} in time (is it running with transport 'nixl'?)")
        doc = msgpack.unpackb(raw)
        if doc["mode"] != self.mode:
            raise TransportError(f"{self.who}: {label} uses nixl_mode {doc['mode']!r}, this rank "
                                 f"{self.mode!r}; set the same TransportOptions.nixl_mode everywhere")
        t0 = time.perf_counter()
        peer = Peer(rank, label, self._agent.connect(doc["agent"], label=label), doc)
        self.setup["connect_seconds"] = self.setup.get("connect_seconds", 0.0) + time.perf_counter() - t0
        return peer

    def _prepared_agent(self, call: str) -> NixlAgent:
        """The NIXL agent, or the error that ``call`` before ``prepare()`` deserves."""
        if self._agent is None:
            raise RuntimeError(f"{self.who}: {call}() before prepare()")
        return self._agent

    def _prepare_xfer(self, peer: Peer, op: str, descs: Descriptors, what: str, *, data: bool = True) -> Xfer:
        """A prepared READ/WRITE with ``peer``; data lives on ``options.device``, control words on the host."""
        assert self._agent is not None
        cuda = data and self.device.type == "cuda"
        xfer = self._agent.prepare(op, peer.agent, descs, "VRAM" if cuda else "DRAM", what=what,
                                   device=(self.device.index or 0) if cuda else 0)
        self.setup["descriptors"] = self.setup.get("descriptors", 0) + xfer.descriptors
        self.setup["handles"] = self.setup.get("handles", 0) + 1
        return xfer

    def _word_xfer(self, peer: Peer, local: torch.Tensor, what: str) -> Xfer:
        """A READ of the peer's control words (as many as ``local`` holds) into ``local``."""
        descs = Descriptors.of([local.data_ptr()], [peer.doc["ctl"]], [local.numel() * local.element_size()])
        return self._prepare_xfer(peer, "READ", descs, what, data=False)

    def _pack(self, base: int) -> int:
        """Copy (and convert) every distinct piece into the area at ``base``; returns bytes."""
        assert self._area is not None and self._index is not None
        nbytes = 0
        for key, op in self._copies:
            at, n = self._index.entries[key]
            out = self._area[base + at: base + at + n].view(TORCH_DTYPES[op.dst_dtype])
            out.view(op.box.sizes).copy_(src_view(self._flats, op))
            nbytes += n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # also orders the training stream before peers read
        return nbytes

    # -- pull: writer -----------------------------------------------------------------------
    def _prepare_writer(self, plan: Plan, generation: int, deadline: float) -> None:
        self._index, self._copies = ExposedIndex.for_writer(plan, self.ctx.rank)
        self._slot_bytes = max(self._index.total_bytes, 64)
        self._area = torch.empty(self.slots * self._slot_bytes, dtype=torch.uint8, device=self.device)
        self._ctl = torch.full((self.slots,), EMPTY, dtype=torch.int64)
        self._register([self._area, self._ctl])
        self._publish(generation, {"area": self._area.data_ptr(), "slots": self.slots,
                                   "slot_bytes": self._slot_bytes, "index": self._index.encode()})

    def send(self, version: int, *, timeout: float) -> TransferStats:
        if self._area is None:
            raise RuntimeError(f"{self.who}: send() before prepare()")
        stats = TransferStats(version)
        slot = version % self.slots
        self._ctl[slot] = EMPTY  # a reader of the old version in this slot will notice
        with PhaseTimer(stats)("pack"):
            stats.nbytes = self._pack(slot * self._slot_bytes)
        self._ctl[slot] = version
        stats.messages = len(self._copies)
        stats.peak_extra_bytes = self.slots * self._slot_bytes
        return stats

    # -- pull: reader -----------------------------------------------------------------------
    def _prepare_reader(self, plan: Plan, generation: int, deadline: float) -> None:
        opts = self.ctx.options
        writers = sorted({op.src_rank for op in plan.ops})
        self._peers = [self._connect(generation, "writer", w, deadline) for w in writers]
        schedules = [build_messages(plan.ops_between(p.rank, self.ctx.rank), message_bytes=opts.message_bytes,
                                    direct_min_bytes=opts.direct_min_bytes) for p in self._peers]
        staged = max((m.nbytes for ms in schedules for m in ms if not m.direct), default=0)
        self._landing = torch.empty(staged, dtype=torch.uint8, device=self.device) if staged else None
        self._ctl = torch.full((len(self._peers), self.slots), EMPTY, dtype=torch.int64)
        self._register([*self._flats.values(), self._ctl, *([] if self._landing is None else [self._landing])])
        t0 = time.perf_counter()
        for i, (peer, messages) in enumerate(zip(self._peers, schedules, strict=True)):
            if int(peer.doc["slots"]) != self.slots:
                raise TransportError(f"{self.who}: {peer.label} has {peer.doc['slots']} version slots, this "
                                     f"reader {self.slots}; use the same TransportOptions.slots everywhere")
            peer.ctl = self._word_xfer(peer, self._ctl[i], "version words")
            index = ExposedIndex.decode(peer.doc["index"])
            peer.slots = [self._pull_xfers(peer, index, messages, slot) for slot in range(self.slots)]
        self.setup["prepare_xfers_seconds"] = time.perf_counter() - t0

    def _pull_xfers(self, peer: Peer, index: ExposedIndex, messages: list[Message],
                    slot: int) -> list[tuple[Xfer, Message | None]]:
        """READs of one slot: all dense destinations in one request, then one per staged message."""
        area = int(peer.doc["area"]) + slot * int(peer.doc["slot_bytes"])

        def remote(piece: Piece) -> int:
            at, nbytes = index.locate(piece.op, peer.rank)
            if nbytes != piece.op.nbytes:
                raise TransportError(f"{self.who}: {peer.label} exposes {nbytes} bytes for {piece.op.canonical} "
                                     f"{piece.op.box}, this reader expects {piece.op.nbytes}")
            return area + at + _slab_offset(piece)

        out: list[tuple[Xfer, Message | None]] = []
        direct = [p for m in messages if m.direct for p in m.pieces]
        if direct:
            local = [self._flats[p.op.dst_shard].data_ptr() + p.dst_offset * itemsize(p.op.dst_dtype) for p in direct]
            descs = Descriptors.of(local, [remote(p) for p in direct], [p.nbytes for p in direct])
            out.append((self._prepare_xfer(peer, "READ", descs, f"slot {slot} into destination tensors"), None))
        for m in messages:
            if not m.direct:
                assert self._landing is not None
                landing = self._landing.data_ptr()
                descs = Descriptors.of([landing + p.at for p in m.pieces], [remote(p) for p in m.pieces],
                                       [p.nbytes for p in m.pieces])
                out.append((self._prepare_xfer(peer, "READ", descs, f"slot {slot} into the landing buffer"), m))
        return out

    def receive(self, version: int, *, timeout: float) -> TransferStats:
        agent = self._prepared_agent("receive")
        stats = TransferStats(version)
        timer = PhaseTimer(stats)
        deadline = time.monotonic() + timeout
        slot = version % self.slots
        with timer("wait"):
            for i, peer in enumerate(self._peers):
                self._wait_slot(i, peer, version, deadline)
        for peer in self._peers:
            for xfer, message in peer.slots[slot]:
                with timer("transfer"):
                    agent.run(xfer, deadline)
                stats.nbytes += xfer.nbytes
                stats.messages += 1
                if message is None:
                    stats.direct_bytes += xfer.nbytes
                    continue
                assert self._landing is not None
                with timer("unpack"):
                    scatter(message, self._flats, self._landing[: message.nbytes])
                    if self.device.type == "cuda":  # the next READ reuses the landing buffer
                        torch.cuda.synchronize(self.device)
        with timer("verify"):
            for i, peer in enumerate(self._peers):
                assert peer.ctl is not None
                agent.run(peer.ctl, deadline)
                held = int(self._ctl[i, slot])
                if held != version:
                    raise TransportError(self._stale(peer, version, held) + " (overwritten while reading)")
        stats.peak_extra_bytes = 0 if self._landing is None else self._landing.numel()
        return stats

    def _wait_slot(self, i: int, peer: Peer, version: int, deadline: float) -> None:
        """READ the writer's sequence words until the slot holds ``version`` (this also
        notices a dead writer: the READ fails)."""
        assert self._agent is not None and peer.ctl is not None
        while True:
            self._agent.run(peer.ctl, deadline)
            held = int(self._ctl[i, version % self.slots])
            if held == version:
                return
            if held > version or time.monotonic() > deadline:
                raise TransportError(self._stale(peer, version, held))
            time.sleep(0.001)

    def _stale(self, peer: Peer, version: int, held: int) -> str:
        what = "not written yet" if held < version else f"already replaced by version {held}"
        return (f"{self.who}: version {version} in {peer.label}'s NIXL slot is {what}; "
                f"readers may fall at most {self.slots - 1} version(s) behind")


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
    """A connected peer: its rank, NIXL agent name, published document and prepared transfers."""

    def __init__(self, rank: int, label: str, agent: str, doc: dict[str, Any]) -> None:
        self.rank = rank
        self.label = label
        self.agent = agent
        self.doc = doc
        #: READ of the peer's control words (sequence words, ready word, or liveness).
        self.ctl: Xfer | None = None
        #: Per version slot (push: one), the transfers to run, each with the staged message it lands.
        self.slots: list[list[tuple[Xfer, Message | None]]] = []
        self.nbytes = 0


def row_major(sizes: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major array of ``sizes``."""
    return tuple(math.prod(sizes[d + 1:]) for d in range(len(sizes)))


def src_view(flats: Mapping[str, torch.Tensor], op: TransferOp) -> torch.Tensor:
    flat = flats[op.src_shard]
    return flat.as_strided(op.box.sizes, op.src_strides, flat.storage_offset() + op.src_offset)


def _slab_offset(piece: Piece) -> int:
    """Byte offset of a slab of an op inside the op's packed (row-major) bytes."""
    rel = (p - o for p, o in zip(piece.box.offsets, piece.op.box.offsets, strict=True))
    return sum(r * s for r, s in zip(rel, row_major(piece.op.box.sizes), strict=True)) * itemsize(piece.op.dst_dtype)
