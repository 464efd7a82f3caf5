"""In-band digests of every version: writers digest what they send, readers check what landed.

With ``SyncConfig(integrity=True)`` every op of a plan gets a 64-bit digest
(:mod:`weightsync.tools.codecs.digest`) of its bytes as they must land: the writer's source box,
converted to the destination dtype, in row-major order. The digests travel *in band*, as
bytes of the plan itself: each (writer, reader) pair gets one more op per phase, appended
after the pair's real ops, that moves an int64 vector from the writer's digest shard
``__weightsync_digests__/to-reader<r>`` to the reader's ``__weightsync_digests__/from-writer<w>``.
So every transport (torch, shm in both modes, NIXL pull and push, file, routed) and every
encoding it applies (FP8 sources, delta) carries them with no code of its own, in the same
epoch, slot and file as the bytes they vouch for, and a reader never compares against the
digests of another version. Both sides build the extra ops from their local plans alone:
a pair's ops, in wire order, are the same on both (:func:`weightsync.plan.build_local_plan`).

**One pass over the bytes, not two.** A transport that copies the bytes anyway digests them
in the same pass (its class lists the roles in ``fuses_digests``; the session hands it these
digests with ``use_digests``): a writer digests each piece while it packs it
(:meth:`VersionDigests.pack`) and fills a pair's digests when it reaches the pair's digest op;
a reader digests what it stores while it stores it (:meth:`VersionDigests.land`), or right
after bytes it did not copy arrived (:meth:`VersionDigests.arrived`), and :meth:`check` only
compares. What no transport digested (deltas applied in place, a transport that does not fuse)
is digested by :meth:`fill` and :meth:`check` from memory, as before. A fused reader digests
bytes as it stores them: it vouches for what arrived, not for what its memory holds later
(``weightsync verify`` compares an engine with a checkpoint).

    digests = VersionDigests(plan, phases, role="reader", rank=r, kind="xxh3", device="cpu")
    tensors = digests.attach(engine_buffers)       # + this rank's digest shards
    transport.prepare(digests.plan, tensors, phases=digests.phases, ...)
    # writer, before send(v, phase=p):   digests.before_send(p, tensors)   # fills, unless fused
    # reader, before receive(v, phase=p): digests.begin(p)
    # reader, after receive(v, phase=p): digests.check(p, tensors, version=v)   # raises IntegrityError
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import torch

from weightsync.plan.ops import OpColumns, Plan, TransferOp
from weightsync.plan.table import ShardRef
from weightsync.tools.codecs.digest import CopyHasher, DigestKind, as_signed, as_unsigned
from weightsync.tools.torch_layout import TORCH_DTYPES, strided_view
from weightsync.transport.errors import TransportError
from weightsync.transport.exposed import piece_key
from weightsync.transport.schedule import slabs
from weightsync.transport.shm.files import SHM_DIR, SharedTensors

if TYPE_CHECKING:
    from weightsync.plan.ops import Role

PREFIX = "__weightsync_digests__"
#: Bytes of one slab digested at a time when an op must be converted first.
SLAB_BYTES = 16 << 20


def is_digest_name(name: str) -> bool:
    """Whether a shard or canonical name is one of the digests' own (not a weight)."""
    return name.startswith(PREFIX + "/")


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One op whose bytes in the reader's memory differ from what its writer digested."""

    op: TransferOp
    expected: int
    got: int
    kind: DigestKind

    def describe(self) -> str:
        box = ", ".join(f"{o}:{o + s}" for o, s in zip(self.op.box.offsets, self.op.box.sizes, strict=True))
        dst = self.op
        itemsize = TORCH_DTYPES[dst.dst_dtype].itemsize
        where = (f"bytes {dst.dst_offset * itemsize}..{dst.dst_offset * itemsize + dst.nbytes} of {dst.dst_shard!r}"
                 if dst.dst_contiguous else
                 f"{dst.nbytes} bytes of {dst.dst_shard!r} at element {dst.dst_offset}, strides {dst.dst_strides}")
        return (f"{dst.canonical}[{box}] from writer {dst.src_rank} ({where}): {self.kind} "
                f"{self.got:016x}, the writer sent {self.expected:016x}")


class IntegrityError(TransportError):
    """What landed in a reader's memory is not what the writers sent (names every bad op)."""

    def __init__(self, reader: int, version: int, mismatches: Sequence[Mismatch], checked: int) -> None:
        self.reader, self.version, self.mismatches = reader, version, list(mismatches)
        shown = "; ".join(m.describe() for m in self.mismatches[:4])
        more = f" (+{len(self.mismatches) - 4} more)" if len(self.mismatches) > 4 else ""
        super().__init__(f"integrity check: {len(self.mismatches)} of {checked} pieces of version {version} differ "
                         f"from what their writers sent: {shown}{more}")


def op_digest(flats: Mapping[str, torch.Tensor], op: TransferOp, kind: DigestKind, *, side: Role) -> int:
    """The digest of ``op``'s bytes in the destination dtype, row-major: from the writer's source
    (``side="writer"``, converted as the transports convert) or the reader's destination."""
    src = side == "writer"
    flat = flats[op.src_shard if src else op.dst_shard]
    strides = op.src_strides if src else op.dst_strides
    dst_dtype = TORCH_DTYPES[op.dst_dtype]
    hasher = CopyHasher(kind, op.nbytes)
    if flat.dtype == dst_dtype or op.nbytes <= SLAB_BYTES:
        pieces: Iterator[tuple[tuple[int, ...], int]] = iter([(op.box.sizes, op.src_offset if src else op.dst_offset)])
    else:  # bounded temporaries for conversions of large boxes
        pieces = ((box.sizes, s if src else d) for box, s, d in slabs(op, SLAB_BYTES))
    for sizes, offset in pieces:
        view = strided_view(flat, sizes, strides, offset)
        hasher.update(view.to(dst_dtype) if view.dtype != dst_dtype else view)
    return hasher.value()


class _Extended(Sequence[ShardRef]):
    """A plan's shard table with this rank's digest shards after it."""

    def __init__(self, base: Sequence[ShardRef], extra: Sequence[ShardRef]) -> None:
        self.base, self.extra, self._n = base, list(extra), len(base)

    def __len__(self) -> int:
        return self._n + len(self.extra)

    @overload
    def __getitem__(self, index: int) -> ShardRef: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ShardRef]: ...

    def __getitem__(self, index: int | slice) -> ShardRef | Sequence[ShardRef]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = int(index)
        return self.base[i] if i < self._n else self.extra[i - self._n]


@dataclass(frozen=True, slots=True)
class _PairRun:
    """Where one pair's digests of one phase sit in the peer's digest shard."""

    writer: int
    reader: int
    phase: int
    offset: int  # elements into the digest shard of this pair
    ops: tuple[TransferOp, ...]


class VersionDigests:
    """One rank's digests of a plan (see module docstring): the plan and phases with the digest
    ops, this rank's digest shards, and the fill (writer) and check (reader) of each phase."""

    def __init__(self, plan: Plan, phases: Sequence[Plan] | None, *, role: Role, rank: int, kind: DigestKind,
                 device: str) -> None:
        self.role, self.rank, self.kind, self.device = role, rank, kind, device
        parts = list(phases) if phases else [plan]
        used: dict[tuple[int, int], int] = {}  # pair -> digests laid out so far (over phases)
        self.runs: list[list[_PairRun]] = []
        for p, part in enumerate(parts):
            runs = []
            for (w, r), ops in part.pairs().items():
                if (w if role == "writer" else r) != rank:
                    continue
                at = used.get((w, r), 0)
                runs.append(_PairRun(w, r, p, at, tuple(ops)))
                used[(w, r)] = at + len(ops)
            self.runs.append(runs)
        self.sizes = {self.shard_name(w, r, side=role): n for (w, r), n in used.items()}
        extra_src = [ShardRef(w, self.shard_name(w, r, side="writer"), "int64") for (w, r) in used]
        extra_dst = [ShardRef(r, self.shard_name(w, r, side="reader"), "int64") for (w, r) in used]
        pair_index = {pair: i for i, pair in enumerate(used)}
        names = [f"{PREFIX}/w{run.writer}-r{run.reader}/p{run.phase}" for runs in self.runs for run in runs]
        self._tensors = (*plan.tensors, *names)
        self._ndim = (*plan.tensor_ndim, *(1 for _ in names))
        self._src = _Extended(plan.src_shards, extra_src)
        self._dst = _Extended(plan.dst_shards, extra_dst)
        first = len(plan.tensors)
        rows: list[list[tuple[int, _PairRun, int]]] = []  # per phase: (tensor index, run, pair index)
        for runs in self.runs:
            rows.append([(first + k, run, pair_index[(run.writer, run.reader)]) for k, run in enumerate(runs)])
            first += len(runs)
        width = max(plan.columns.off.shape[1] if plan.columns.off.ndim == 2 else 1, 1)
        own = [self._columns(r, len(plan.src_shards), len(plan.dst_shards), width) for r in rows]
        self.plan = self._with(plan, OpColumns.concat([plan.columns, *own], width), "digests")
        self.phases = tuple(self._with(part, OpColumns.concat([part.columns, own[p]], width), f"digests{p}")
                            for p, part in enumerate(phases or ()))
        self.nbytes = 8 * sum(used.values())
        self._buffers: dict[str, torch.Tensor] | None = None
        self._shared: SharedTensors | None = None
        #: the transport digests while it copies (see module docstring); set by the session
        self.fused = False
        self._flats: dict[str, torch.Tensor] = {}
        self._runs_at = {(run.writer, run.reader, run.offset): run for runs in self.runs for run in runs}
        self._records: dict[tuple[Any, ...], int] = {}  # piece (writer) or op (reader) -> digest
        self._streams: dict[tuple[Any, ...], CopyHasher] = {}

    def fuses(self, roles: Iterable[str]) -> bool:
        """Whether a transport that fuses digests for ``roles`` (its ``fuses_digests``) may do it for
        this rank: its role is one of them and its tensors are in host memory. On a GPU the digest
        of a copy is queued after it on the stream, which the device port does not model yet: GPU
        ranks digest each phase once it arrived, as transports without fusion do."""
        return self.role in roles and self.device.split(":")[0] == "cpu"

    @staticmethod
    def shard_name(writer: int, reader: int, *, side: Role) -> str:
        """The digest shard of pair (writer, reader) on ``side``."""
        return f"{PREFIX}/to-reader{reader}" if side == "writer" else f"{PREFIX}/from-writer{writer}"

    def _columns(self, rows: list[tuple[int, _PairRun, int]], src_base: int, dst_base: int, width: int) -> OpColumns:
        n = len(rows)

        def col(values: list[int]) -> np.ndarray:
            return np.asarray(values, dtype=np.int64).reshape(n)

        def box(first: list[int], rest: int) -> np.ndarray:
            out = np.full((n, width), rest, dtype=np.int64)
            out[:, 0] = first
            return out

        counts = [len(run.ops) for _, run, _ in rows]
        offsets = [run.offset for _, run, _ in rows]
        return OpColumns(
            src_rank=col([run.writer for _, run, _ in rows]), src_shard=col([src_base + i for _, _, i in rows]),
            dst_rank=col([run.reader for _, run, _ in rows]), dst_shard=col([dst_base + i for _, _, i in rows]),
            tensor=col([t for t, _, _ in rows]), off=box([0] * n, 0), size=box(counts, 1),
            src_off=col(offsets), src_stride=box([1] * n, 0), dst_off=col(offsets), dst_stride=box([1] * n, 0),
            nbytes=col([8 * c for c in counts]))

    def _with(self, plan: Plan, columns: OpColumns, tag: str) -> Plan:
        return Plan(fingerprint=f"{plan.fingerprint}/{tag}", tensors=self._tensors, tensor_ndim=self._ndim,
                    src_shards=self._src, dst_shards=self._dst, columns=columns, stats=None, scope=plan.scope)

    # -- buffers --------------------------------------------------------------------------
    def attach(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` with this rank's digest shards added (allocated on first use, kept after).

        A writer whose tensors all live in ``/dev/shm`` files gets its digest shards there too,
        so the shared-memory transport stays zero-copy (it needs every source shard in a file).
        """
        if self._buffers is None:
            buffers = {name: torch.zeros(n, dtype=torch.int64, device=self.device) for name, n in self.sizes.items()}
            if self.role == "writer" and self.device == "cpu" and tensors and all(
                    (t.untyped_storage().filename or "").startswith(SHM_DIR + "/") for t in tensors.values()):
                self._shared = SharedTensors(buffers)
                buffers = dict(self._shared.tensors)
            self._buffers = buffers
        clash = set(tensors) & set(self._buffers)
        if clash:
            raise ValueError(f"tensor names {sorted(clash)[:3]} are reserved for weightsync's digests")
        attached = {**tensors, **self._buffers}
        self._flats = {name: t.detach().view(-1) for name, t in attached.items()}
        return attached

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        self._buffers = None

    # -- writer ---------------------------------------------------------------------------
    def before_send(self, phase: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Before ``send(v, phase)``: digest the phase now, or (fused) let the transport do it."""
        self.begin(phase)
        if not self.fused:
            self.fill(phase, tensors)

    def fill(self, phase: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Digest what this writer sends in ``phase`` into its digest shards (before ``send``, or
        by a transport that does not copy, once the version is exposed)."""
        assert self.role == "writer" and self._buffers is not None, "fill() is a writer's, after attach()"
        flats = {name: t.detach().view(-1) for name, t in tensors.items()}
        for run in self.runs[phase]:
            self._fill_run(run, flats)

    def _fill_run(self, run: _PairRun, flats: Mapping[str, torch.Tensor]) -> None:
        assert self._buffers is not None
        values = []
        for op in run.ops:
            key = (piece_key(op),)  # a piece sent to several readers is digested once
            value = self._records.get(key)
            if value is None:
                value = self._records[key] = op_digest(flats, op, self.kind, side="writer")
            values.append(as_signed(value))
        out = self._buffers[self.shard_name(run.writer, run.reader, side="writer")]
        out[run.offset: run.offset + len(values)] = torch.tensor(values, dtype=torch.int64)

    def pack(self, op: TransferOp, dst: torch.Tensor, src: torch.Tensor, *, copy: Copy | None = None) -> None:
        """Writer, fused: copy (the next part of) ``op``'s bytes from ``src`` into ``dst`` (a slot,
        a staging buffer) and digest what was stored. A digest op first gets its pair's digests."""
        if is_digest_name(op.canonical):
            self._fill_run(self._runs_at[(op.src_rank, op.dst_rank, op.src_offset)], self._flats)
            (copy or _copy_now)(dst, src)
            return
        self._absorb((op.dst_rank, piece_key(op)), (piece_key(op),), op, lambda h: h.copy(dst, src, copy=copy))

    def sent(self, op: TransferOp, view: torch.Tensor) -> None:
        """Writer, fused: (the next part of) ``op``'s bytes leave from ``view`` without a pack."""
        if is_digest_name(op.canonical):
            self._fill_run(self._runs_at[(op.src_rank, op.dst_rank, op.src_offset)], self._flats)
            return
        self._absorb((op.dst_rank, piece_key(op)), (piece_key(op),), op, lambda h: h.update(view))

    def _absorb(self, stream_key: tuple[Any, ...], record_key: tuple[Any, ...], op: TransferOp, feed: Any) -> None:
        hasher = self._streams.get(stream_key)
        if hasher is None:
            hasher = self._streams[stream_key] = CopyHasher(self.kind, op.nbytes)
        feed(hasher)
        if hasher.done:
            self._records[record_key] = hasher.value()
            del self._streams[stream_key]

    def begin(self, phase: int) -> None:
        """A phase's send or receive starts: what an earlier try digested no longer counts."""
        self._records.clear()
        self._streams.clear()

    # -- reader ---------------------------------------------------------------------------
    def check(self, phase: int, tensors: Mapping[str, torch.Tensor], *, version: int) -> int:
        """Compare what landed in ``phase`` with the writers' digests; returns the pieces checked.

        Raises:
            IntegrityError: naming each piece that differs (tensor, box, writer, bytes).
        """
        assert self.role == "reader" and self._buffers is not None, "check() is a reader's, after attach()"
        flats = {name: t.detach().view(-1) for name, t in tensors.items()}
        bad: list[Mismatch] = []
        checked = 0
        for run in self.runs[phase]:
            sent = self._buffers[self.shard_name(run.writer, run.reader, side="reader")]
            sent = sent[run.offset: run.offset + len(run.ops)]
            for op, expected in zip(run.ops, sent.tolist(), strict=True):
                got = self._records.get(_landed_key(op))
                if got is None:  # not digested on its way in (a delta applied in place, an unfused transport)
                    got = op_digest(flats, op, self.kind, side="reader")
                checked += 1
                if got != as_unsigned(expected):
                    bad.append(Mismatch(op, as_unsigned(expected), got, self.kind))
        if bad:
            raise IntegrityError(self.rank, version, bad, checked)
        return checked

    def checked(self, phase: int) -> list[tuple[TransferOp, int]]:
        """A reader's ops of ``phase`` with the digests the writers sent for them, once
        :meth:`check` passed (a reader keeping a peer copy stores them beside it)."""
        assert self.role == "reader" and self._buffers is not None, "checked() is a reader's, after attach()"
        out: list[tuple[TransferOp, int]] = []
        for run in self.runs[phase]:
            sent = self._buffers[self.shard_name(run.writer, run.reader, side="reader")]
            values = sent[run.offset: run.offset + len(run.ops)].tolist()
            out.extend((op, as_unsigned(v)) for op, v in zip(run.ops, values, strict=True))
        return out

    def land(self, op: TransferOp, dst: torch.Tensor, src: torch.Tensor, *, copy: Copy | None = None) -> None:
        """Reader, fused: store (the next part of) ``op``'s bytes from ``src`` into ``dst``, its
        destination, digesting them as they are stored. Digest ops are stored as they are."""
        if is_digest_name(op.canonical):
            (copy or _copy_now)(dst, src)
            return
        key = _landed_key(op)
        self._absorb(key, key, op, lambda h: h.copy(dst, src, copy=copy, nontemporal=True))

    def arrived(self, op: TransferOp, view: torch.Tensor) -> None:
        """Reader, fused: (the next part of) ``op``'s bytes arrived in ``view`` without a copy of
        this rank's (a direct receive, an RDMA READ): digest them now, while they may be in cache."""
        if not is_digest_name(op.canonical):
            key = _landed_key(op)
            self._absorb(key, key, op, lambda h: h.update(view))

    def weight_bytes(self, phase: int, moved: int) -> int:
        """Of ``moved`` bytes a transport reports for ``phase``, those of weights: less the digest
        ops' (8 bytes per piece; a delta may move fewer of them, never fewer than none)."""
        return moved - min(moved, 8 * self.pieces(phase))

    def pieces(self, phase: int) -> int:
        """The ops this rank digests in ``phase``."""
        return sum(len(run.ops) for run in self.runs[phase])


def _landed_key(op: TransferOp) -> tuple[Any, ...]:
    """An op of a reader's plan, by where it lands (ops of one reader never overlap)."""
    return (op.src_rank, op.dst_shard, op.dst_offset)


#: How a transport copies (the device port's queued copy on a GPU).
Copy = Callable[[torch.Tensor, torch.Tensor], object]


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
