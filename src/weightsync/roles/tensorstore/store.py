"""``TensorStore``: versioned, one-sided put / get of any named tensors, resharded on get.

Writers put tensors without waiting for anyone; a version becomes visible once every
writer completed it; readers get whatever slice they want of the newest complete version
(or of one they name), whenever they choose. Weights, a value head, rollout batches,
statistics, a tokenizer table: anything with a name, a shape and a dtype.

    # on each of W writer processes
    store = TensorStore(StoreConfig(job="rl", num_writers=W), rank=r)
    store.put("value_head.weight", shard, where=TensorSlice.part(shape, index=r, count=W))
    store.multi_put({"stats/reward_mean": mean, "rollout/tokens": tokens})
    store.complete(step)                       # snapshot taken at put; returns at once

    # on any reader process
    store = TensorStore(StoreConfig(job="rl"))
    head = store.get("value_head.weight")                                  # whole, newest version
    mine = store.get("value_head.weight", where=TensorSlice.part(shape, index=i, count=3))
    store.version                                                          # the version just read

**How.** ``put`` copies the tensor into an append-only memory-mapped *arena* file of the
writer (``/dev/shm`` by default: the copy *is* the snapshot, so training may change the
tensor right away). ``complete(V)`` publishes each writer's arena index and the layout of
what it put, described with the layout types (a :class:`~weightsync.layout.Shard` per put,
holding a box of the canonical tensor ``name``), then reports ``V`` to the meta server.
A reader plans its request against the writers' layouts with the ordinary planner (any
slicing on either side: 2 shards in, 3 out) and copies each op straight out of the
writers' mapped arenas into its output views.

**Versions and memory.** Arena files are immutable once completed. Each writer keeps its
last ``slots`` completed versions (plus the one being put): at most ``slots + 1`` copies of
what it puts per version, in the arena directory. An older version is retired (its files
unlinked, its index blanked); a get of a retired version raises :class:`SupersededError`
naming the newest, and a get of "the newest" that loses that race simply retries with the
new newest. A reader that mapped a version before it was retired reads it to the end
safely (unlinking never invalidates a mapping). Crashed writers' arenas in ``/dev/shm`` are
swept like the shared-memory transport's segments.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.clock.deadline import Deadline
from weightsync.job.channel import JobChannel
from weightsync.layout import CanonicalTensor, RankLayout, Region, Shard
from weightsync.layout.box import contiguous_strides
from weightsync.plan import PlanOptions, build_plan
from weightsync.roles.tensorstore.arena import Arena, GoneError, OpenVersion, StoreIndex
from weightsync.roles.tensorstore.slices import TensorSlice
from weightsync.tools.torch_layout import TORCH_DTYPES, dtype_name
from weightsync.transport.shm.files import SHM_DIR, segment_name, sweep_stale_segments

if TYPE_CHECKING:
    from weightsync.meta.client import MetaClient
    from weightsync.plan import Plan

logger = logging.getLogger(__name__)


class SupersededError(LookupError):
    """The version asked for was retired by its writers (they keep the last ``slots``)."""


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Settings of one store namespace; writers and readers use the same ``job``.

    Attributes:
        job: the meta-server job the store's versions live in (keep it apart from a
            ``WeightWriter`` job: both number their versions).
        num_writers: processes that ``complete`` each version.
        slots: completed versions each writer keeps readable; older ones are retired.
        directory: where writers' arena files live; readers must see the same files
            (``/dev/shm``: the writers' host).
        chunk_bytes: arena files grow in chunks of at least this size (sparse until written).
        timeout: default bound, in seconds, on waiting for a version.
    """

    job: str = "tensors"
    num_writers: int = 1
    slots: int = 2
    directory: str = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    chunk_bytes: int = 16 << 20
    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.num_writers < 1:
            raise ValueError(f"num_writers must be >= 1, got {self.num_writers}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")


# -- reader side ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _VersionView:
    """One complete version, opened for reading: writers' layouts and their mapped shards."""

    version: int
    layouts: tuple[RankLayout, ...]
    digest: bytes
    sources: Mapping[tuple[int, str], torch.Tensor]  # (writer, shard) -> flat tensor in the shard's dtype

    @property
    def canonical(self) -> dict[str, CanonicalTensor]:
        out: dict[str, CanonicalTensor] = {}
        for layout in self.layouts:
            out.update(layout.canonical)
        return out


@dataclass(frozen=True, slots=True)
class _Request:
    name: str
    out: torch.Tensor
    where: TensorSlice


# -- the store -------------------------------------------------------------------------------------

class TensorStore:
    """A handle on one store namespace (see module docstring).

    ``rank`` makes this handle writer ``rank`` of ``config.num_writers`` (``put``/``complete``);
    every handle can ``get``. Thread-compatible: use one handle per thread.
    """

    def __init__(self, config: StoreConfig | None = None, *, rank: int | None = None,
                 meta: MetaClient | None = None) -> None:
        from weightsync.meta.client import MetaClient

        self.config = config if config is not None else StoreConfig()
        if rank is not None and not 0 <= rank < self.config.num_writers:
            raise ValueError(f"writer rank {rank} is outside 0..{self.config.num_writers - 1}")
        self.rank = rank
        self._own_meta = meta is None
        self.meta = meta if meta is not None else MetaClient.from_env(job=self.config.job)
        self.channel = JobChannel(self.meta, role="writer" if rank is not None else "reader", rank=rank or 0)
        #: Writer: the last completed version. Reader: the version the last get read.
        self.version: int | None = None
        self._prefix = segment_name(f"store{rank}", token_bytes=4)
        self._open: OpenVersion | None = None
        self._completed: list[tuple[int, Arena]] = []
        self._view: _VersionView | None = None
        self._plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        if rank is not None and self.config.directory == SHM_DIR:
            sweep_stale_segments()

    # -- writer ------------------------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, *, where: TensorSlice | None = None) -> None:
        """Copy ``tensor`` (or, with ``where``, this slice of a global tensor) into the open version.

        The copy is the snapshot: the caller may change ``tensor`` as soon as ``put`` returns.

        Raises:
            ValueError: this handle is not a writer, the name was already put for this version,
                the tensor's shape differs from ``where``'s box, or its dtype is unsupported.
        """
        if self.rank is None:
            raise ValueError("this TensorStore handle is read-only: pass rank= (and num_writers in the config) "
                             "to put tensors")
        if self._open is None:
            seq = (self.version if self.version is not None else -1) + 1
            self._open = OpenVersion(Arena(self.config.directory, f"{self._prefix}-v{seq}-{secrets.token_hex(2)}",
                                             self.config.chunk_bytes))
        self._open.add(name, tensor, where if where is not None else TensorSlice.whole(tensor.shape))

    def multi_put(self, tensors: Mapping[str, torch.Tensor | tuple[torch.Tensor, TensorSlice]]) -> None:
        """``put`` each ``name -> tensor`` or ``name -> (tensor, where)``."""
        for name, item in tensors.items():
            tensor, where = item if isinstance(item, tuple) else (item, None)
            self.put(name, tensor, where=where)

    def complete(self, version: int) -> None:
        """Seal what this writer put as ``version``; visible to readers once every writer completed it.

        Never waits for readers. A writer that put nothing completes an empty part.

        Raises:
            ValueError: the version does not increase, or writers disagree (the meta server says which).
        """
        if self.rank is None:
            raise ValueError("this TensorStore handle is read-only: pass rank= to complete versions")
        if self.version is not None and version <= self.version:
            raise ValueError(f"store writer {self.rank}: version {version} does not increase past {self.version}")
        part = self._open or OpenVersion(Arena(self.config.directory, f"{self._prefix}-empty", 0))
        index = part.index(self.rank, self.config.num_writers, self.config.directory)
        self.channel.publish_store_index(version, index.encode())
        self.channel.publish_store_version(version, num_writers=self.config.num_writers)
        self.version = version
        self._open = None
        self._completed.append((version, part.arena))
        while len(self._completed) > self.config.slots:
            self._retire(*self._completed.pop(0))

    def _retire(self, version: int, arena: Arena) -> None:
        self.channel.publish_store_index(version, b"")  # readers: superseded
        arena.unlink()

    # -- reader ------------------------------------------------------------------------------------
    def get(self, name: str, out: torch.Tensor | None = None, *, where: TensorSlice | None = None,
            version: int | None = None, timeout: float | None = None) -> torch.Tensor:
        """Read tensor ``name`` (or the slice ``where`` of it) from a complete version.

        Args:
            out: where to read into (contiguous, shape = the slice's sizes; its dtype may differ
                from the writers', values are converted). Allocated when None.
            where: the slice to read (default: the whole tensor), however the writers sharded it.
            version: read exactly this version (waiting for it up to ``timeout``); None: the
                newest complete version. ``self.version`` says which version was read.

        Raises:
            SupersededError: ``version`` was retired; the message names the newest.
            KeyError: the version has no tensor ``name`` (the message lists what it has).
            TimeoutError: no (such) version was completed within ``timeout``.
            weightsync.plan.PlanError: the writers' slices do not cover ``where``.
        """
        return self.multi_get({name: (out, where)}, version=version, timeout=timeout)[name]

    def multi_get(self, requests: Mapping[str, torch.Tensor | TensorSlice | tuple[torch.Tensor | None,
                                                                                   TensorSlice | None] | None],
                  *, version: int | None = None, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """``get`` several tensors from one version: ``name -> out | where | (out, where) | None``."""
        deadline = Deadline.after(timeout if timeout is not None else self.config.timeout)
        view = self._open_version(version, deadline)  # mapped: stays readable even if retired now
        result = self._read(view, requests)
        self.version = view.version
        return result

    def names(self, *, version: int | None = None, timeout: float | None = None) -> dict[str, CanonicalTensor]:
        """The tensors (global shape, dtype) of a complete version (the newest by default)."""
        deadline = Deadline.after(timeout if timeout is not None else self.config.timeout)
        return self._open_version(version, deadline).canonical

    def _open_version(self, version: int | None, deadline: Deadline) -> _VersionView:
        target = version if version is not None else self._newest(deadline)
        if self._view is not None and self._view.version == target:
            if version is None or self.channel.store_index(version, 0):
                return self._view
            self._view = None  # retired since: say so, like any reader that had not mapped it
            raise self._superseded(version)
        if version is not None:
            latest = self.channel.latest_store_version()
            if (latest is None or latest < version) and self.channel.wait_store_version(
                    after=version - 1, deadline=deadline) is None:
                    raise TimeoutError(f"store {self.config.job!r}: version {version} was not completed in time")
        try:
            self._view = self._load(target)
        except GoneError:
            if version is not None:
                raise self._superseded(version) from None
            return self._open_version(None, deadline)
        return self._view

    def _newest(self, deadline: Deadline) -> int:
        newest = self.channel.latest_store_version()
        if newest is None:
            newest = self.channel.wait_store_version(after=-1, deadline=deadline)
        if newest is None:
            raise TimeoutError(f"store {self.config.job!r}: no version was completed in time")
        return newest

    def _load(self, version: int) -> _VersionView:
        first = self.channel.store_index(version, 0)
        if first is None:
            raise KeyError(f"store {self.config.job!r} has no version {version}; the newest is "
                           f"{self.channel.latest_store_version()}")
        blobs = [first]
        if blobs[0]:
            writers = StoreIndex.decode(blobs[0], 0).num_writers
            blobs += [self.channel.store_index(version, w) or b"" for w in range(1, writers)]
        if not all(blobs):
            raise GoneError(f"version {version} was retired")
        layouts, sources, digest = [], {}, b""
        for writer, blob in enumerate(blobs):
            index = StoreIndex.decode(blob, writer)
            layout = index.rank_layout(writer)
            sources.update(index.map_sources(layout, writer))
            layouts.append(layout)
            digest += index.layout
        return _VersionView(version, tuple(layouts), digest, sources)

    def _read(self, view: _VersionView, requests: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        canonical = view.canonical
        wanted = [self._request(name, item, canonical, view.version) for name, item in requests.items()]
        plan = self._plan(view, wanted)
        outs = {r.name: r.out.view(-1) for r in wanted}
        for op in plan.ops:
            src = view.sources[(op.src_rank, op.src_shard)]
            dst = outs[op.dst_shard]
            dst.as_strided(op.box.sizes, op.dst_strides, dst.storage_offset() + op.dst_offset).copy_(
                src.as_strided(op.box.sizes, op.src_strides, src.storage_offset() + op.src_offset))
        return {r.name: r.out for r in wanted}

    @staticmethod
    def _request(name: str, item: Any, canonical: Mapping[str, CanonicalTensor], version: int) -> _Request:
        if name not in canonical:
            have = sorted(canonical)
            raise KeyError(f"version {version} has no tensor {name!r}; it has {have[:10]}"
                           + (f" (+{len(have) - 10} more)" if len(have) > 10 else ""))
        out, where = item if isinstance(item, tuple) else (
            (item, None) if isinstance(item, torch.Tensor) else (None, item))
        tensor = canonical[name]
        where = where if where is not None else TensorSlice.whole(tensor.shape)
        if where.shape != tensor.shape:
            raise ValueError(f"{name!r} has global shape {tensor.shape}, the slice asked for assumes {where.shape}")
        if out is None:
            out = torch.empty(where.box.sizes, dtype=TORCH_DTYPES[tensor.dtype])
        if tuple(out.shape) != where.box.sizes or not out.is_contiguous():
            raise ValueError(f"out for {name!r} must be contiguous with shape {where.box.sizes}, got "
                             f"{tuple(out.shape)} (contiguous: {out.is_contiguous()})")
        return _Request(name, out, where)

    def _plan(self, view: _VersionView, wanted: list[_Request]) -> Plan:
        key = (view.digest, tuple((r.name, r.where, dtype_name(r.out.dtype)) for r in wanted))
        plan = self._plans.get(key)
        if plan is None:
            names = {r.name for r in wanted}
            sources = [_only(layout, names) for layout in view.layouts]
            shards = tuple(Shard(r.name, r.where.box.sizes, dtype_name(r.out.dtype),
                                 (Region(r.name, r.where.box, 0, contiguous_strides(r.where.box.sizes)),))
                           for r in wanted)
            dest = RankLayout(0, shards, {n: view.canonical[n] for n in names})
            plan = build_plan([s for s in sources if s.shards], [dest],
                              options=PlanOptions(allow_unneeded_sources=True))
            self._plans[key] = plan
            if len(self._plans) > 64:
                self._plans.popitem(last=False)
        return plan

    def _superseded(self, version: int) -> SupersededError:
        return SupersededError(f"store {self.config.job!r}: version {version} was superseded and retired (writers "
                               f"keep the last {self.config.slots}); the newest complete version is "
                               f"{self.channel.latest_store_version()}")

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Writers unlink their arenas (readers that mapped a version keep reading it)."""
        if self._open is not None:
            self._open.arena.unlink()
            self._open = None
        for _, arena in self._completed:
            arena.unlink()
        self._completed.clear()
        self._view = None
        if self._own_meta:
            self.meta.close()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _only(layout: RankLayout, names: set[str]) -> RankLayout:
    """A writer's layout restricted to the shards holding ``names`` (planning stays proportional)."""
    shards = tuple(s for s in layout.shards if any(r.canonical in names for r in s.regions))
    return RankLayout(layout.rank, shards, {n: t for n, t in layout.canonical.items() if n in names})


