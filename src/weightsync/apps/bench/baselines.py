"""The ways users move weights today, implemented faithfully, plus weightsync itself.

Every method is a :class:`Method` with ``setup`` / ``sync(version)`` / ``close``, run by
the same worker processes on the same tensors (see :mod:`weightsync.apps.bench.worker`).
``sync`` reports the bytes that really reached this rank (a baseline's engine worker
receives whole tensors, more than the slices it keeps; weightsync's exactly its slices),
and writers send from :meth:`Method.source_tensors`, which the bench refills with new
weights before every version. A method of your own runs as ``--methods pkg.module:Class``. The
baselines follow the published code paths of the RL frameworks:

* ``safetensors-disk`` / ``safetensors-shm``: the trainer gathers the full model on rank 0
  (what ``FSDP.state_dict(FULL_STATE_DICT)`` or Megatron's HF export do), rank 0 writes one
  ``model.safetensors`` (``safetensors.torch.save_file``) to local disk or ``/dev/shm``, and
  every engine worker reloads it: ``safe_open`` + ``get_tensor`` of every tensor it needs,
  then the engine's ``load_weights`` copies the rows it holds into its (fused) parameters.
* ``per-param-broadcast`` (OpenRLHF / open-instruct): for each parameter, the training
  ranks gather it to rank 0, rank 0 broadcasts it to every engine worker in one update
  group, and each worker receives it into a fresh tensor and loads it.
* ``bucketed-broadcast`` (verl / slime): the same, but parameters are gathered into a
  flat bucket of ``bucket_bytes`` and each bucket is broadcast once, then unpacked.

The gather is point-to-point: each training rank sends exactly the boxes it owns (that a
lower rank does not) to rank 0. Frameworks use ``all_gather``, which moves more bytes, and
OpenRLHF also makes one RPC per parameter to tell the engines its name and shape; both are
left out, so if anything the baselines are flattered.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from weightsync.apps.bench.weights import CanonicalLoader, Contribution, gather_contributions, region_view
from weightsync.layout import ModelSpec, RankLayout
from weightsync.tools.torch_layout import TORCH_DTYPES

BASELINES = ("safetensors-disk", "safetensors-shm", "per-param-broadcast", "bucketed-broadcast")


@dataclass(kw_only=True)
class RankContext:
    """One benchmark process: who it is, what it holds, and its process groups."""

    role: str  # writer | reader
    rank: int
    num_writers: int
    num_readers: int
    config: dict[str, Any]
    source: str
    target: str
    spec: ModelSpec
    layout: RankLayout
    tensors: dict[str, torch.Tensor]
    writer_layouts: list[RankLayout]
    train_group: Any = None
    update_group: Any = None
    scratch: str = ""
    timeout: float = 300.0
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def global_rank(self) -> int:
        return self.rank if self.role == "writer" else self.num_writers + self.rank

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.spec.dtype]


@dataclass(slots=True)
class SyncReport:
    """What one ``sync`` did on this rank: seconds per phase and bytes that arrived here."""

    phases: dict[str, float]
    received_bytes: int = 0


class Method(Protocol):
    name: str

    def setup(self) -> None: ...

    def source_tensors(self) -> dict[str, torch.Tensor]:
        """Writers: the tensors this method sends from (the bench refills them every version)."""
        ...

    def sync(self, version: int) -> SyncReport:
        """Move one version; returns seconds per phase and the bytes received on this rank."""
        ...

    def close(self) -> None: ...


class _Gather:
    """Rank 0 of the trainer assembles full canonical tensors from every writer's boxes."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.contributions: dict[str, list[Contribution]] = gather_contributions(ctx.writer_layouts)

    def tensor(self, name: str, out: torch.Tensor | None) -> None:
        """Gather ``name`` into ``out`` (rank 0; None elsewhere). Writers only."""
        ctx = self.ctx
        for c in self.contributions[name]:
            if ctx.rank == 0:
                assert out is not None
                target = out[c.region.box.slices()]
                if c.rank == 0:
                    target.copy_(region_view(ctx.tensors[c.shard], c.region))
                elif target.is_contiguous():
                    dist.recv(target, src=c.rank, group=ctx.train_group)
                else:
                    tmp = torch.empty(c.region.box.sizes, dtype=out.dtype)
                    dist.recv(tmp, src=c.rank, group=ctx.train_group)
                    target.copy_(tmp)
            elif c.rank == ctx.rank:
                dist.send(region_view(ctx.tensors[c.shard], c.region).contiguous(), dst=0, group=ctx.train_group)


class _GatherThenLoad:
    """What every baseline starts from: trainers gather canonical tensors to rank 0, engine
    workers load canonical tensors into their own layout."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self._gather: _Gather | None = None
        self._loader: CanonicalLoader | None = None

    def setup(self) -> None:
        if self.ctx.role == "writer":
            self._gather = _Gather(self.ctx)
        else:
            self._loader = CanonicalLoader(self.ctx.layout, self.ctx.tensors)

    def source_tensors(self) -> dict[str, torch.Tensor]:
        return self.ctx.tensors

    def close(self) -> None:
        pass


class SafetensorsReload(_GatherThenLoad):
    """Gather on rank 0, ``save_file``, every engine worker reloads (see module docstring)."""

    def __init__(self, ctx: RankContext, *, where: str) -> None:
        super().__init__(ctx)
        self.name = f"safetensors-{where}"
        base = "/dev/shm" if where == "shm" else ctx.scratch
        self.path = os.path.join(base, f"weightsync-bench-{ctx.options['run_id']}-model.safetensors")

    def sync(self, version: int) -> SyncReport:
        from safetensors import safe_open
        from safetensors.torch import save_file

        ctx = self.ctx
        phases: dict[str, float] = {}
        signal = torch.zeros(1, dtype=torch.int64)
        if ctx.role == "writer":
            assert self._gather is not None
            t0 = time.perf_counter()
            full: dict[str, torch.Tensor] = {}
            for name, tensor in ctx.spec.canonical_tensors().items():
                out = torch.empty(tensor.shape, dtype=ctx.dtype) if ctx.rank == 0 else None
                self._gather.tensor(name, out)
                if out is not None:
                    full[name] = out
            phases["gather"] = time.perf_counter() - t0
            if ctx.rank == 0:
                t0 = time.perf_counter()
                save_file(full, self.path, metadata={"format": "pt", "version": str(version)})
                phases["save"] = time.perf_counter() - t0
                del full
                signal.fill_(version)
                dist.broadcast(signal, src=0, group=ctx.update_group)
            return SyncReport(phases)
        assert self._loader is not None
        t0 = time.perf_counter()
        dist.broadcast(signal, src=0, group=ctx.update_group)  # "the checkpoint is ready"
        phases["wait"] = time.perf_counter() - t0
        if int(signal) != version:
            raise RuntimeError(f"the trainer announced checkpoint version {int(signal)}, expected {version}")
        t0 = time.perf_counter()
        received = 0
        with safe_open(self.path, framework="pt") as f:
            for name in ctx.spec.canonical_tensors():
                if self._loader.needs(name):
                    loaded = f.get_tensor(name)
                    received += loaded.numel() * loaded.element_size()
                    self._loader.load(name, loaded)
        phases["load"] = time.perf_counter() - t0
        return SyncReport(phases, received)

    def close(self) -> None:
        if self.ctx.role == "writer" and self.ctx.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class PerParamBroadcast(_GatherThenLoad):
    """OpenRLHF / open-instruct: gather one parameter, broadcast it, load it; repeat."""

    name = "per-param-broadcast"

    def sync(self, version: int) -> SyncReport:
        ctx = self.ctx
        gather = broadcast = load = 0.0
        received = 0
        for name, tensor in ctx.spec.canonical_tensors().items():
            if ctx.role == "writer":
                assert self._gather is not None
                t0 = time.perf_counter()
                full = torch.empty(tensor.shape, dtype=ctx.dtype) if ctx.rank == 0 else None
                self._gather.tensor(name, full)
                gather += time.perf_counter() - t0
                if full is not None:
                    t0 = time.perf_counter()
                    dist.broadcast(full, src=0, group=ctx.update_group)
                    broadcast += time.perf_counter() - t0
            else:
                assert self._loader is not None
                t0 = time.perf_counter()
                buf = torch.empty(tensor.shape, dtype=ctx.dtype)
                dist.broadcast(buf, src=0, group=ctx.update_group)
                t1 = time.perf_counter()
                received += buf.numel() * buf.element_size()
                self._loader.load(name, buf)
                broadcast += t1 - t0
                load += time.perf_counter() - t1
        if ctx.role == "writer":
            return SyncReport({"gather": gather, "broadcast": broadcast})
        return SyncReport({"broadcast": broadcast, "load": load}, received)


def plan_buckets(spec: ModelSpec, bucket_bytes: int) -> list[list[str]]:
    """Consecutive canonical tensors grouped into buckets of at most ``bucket_bytes``.

    A tensor larger than the bucket travels alone, as slime's and verl's bucketers do.
    """
    buckets: list[list[str]] = []
    used = 0
    for name, tensor in spec.canonical_tensors().items():
        if not buckets or used + tensor.nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += tensor.nbytes
    return buckets


class BucketedBroadcast(_GatherThenLoad):
    """verl / slime: gather into a flat bucket on rank 0, broadcast each bucket, unpack."""

    name = "bucketed-broadcast"

    def __init__(self, ctx: RankContext, *, bucket_bytes: int) -> None:
        super().__init__(ctx)
        self.bucket_bytes = bucket_bytes
        self._buckets: list[list[str]] = []
        self._buffer: torch.Tensor | None = None

    def setup(self) -> None:
        ctx = self.ctx
        self._buckets = plan_buckets(ctx.spec, self.bucket_bytes)
        canon = ctx.spec.canonical_tensors()
        largest = max(sum(canon[n].nbytes for n in b) for b in self._buckets)
        super().setup()
        if ctx.role == "reader" or ctx.rank == 0:
            self._buffer = torch.empty(largest, dtype=torch.uint8)

    def _views(self, bucket: list[str]) -> tuple[list[tuple[str, torch.Tensor]], int]:
        assert self._buffer is not None
        canon = self.ctx.spec.canonical_tensors()
        views, at = [], 0
        for name in bucket:
            n = canon[name].nbytes
            views.append((name, self._buffer[at: at + n].view(self.ctx.dtype).view(canon[name].shape)))
            at += n
        return views, at

    def sync(self, version: int) -> SyncReport:
        ctx = self.ctx
        gather = broadcast = load = 0.0
        received = 0
        for bucket in self._buckets:
            if ctx.role == "writer":
                assert self._gather is not None
                t0 = time.perf_counter()
                if ctx.rank == 0:
                    views, used = self._views(bucket)
                    for name, view in views:
                        self._gather.tensor(name, view)
                else:
                    for name in bucket:
                        self._gather.tensor(name, None)
                gather += time.perf_counter() - t0
                if ctx.rank == 0:
                    assert self._buffer is not None
                    t0 = time.perf_counter()
                    dist.broadcast(self._buffer[:used], src=0, group=ctx.update_group)
                    broadcast += time.perf_counter() - t0
            else:
                assert self._loader is not None and self._buffer is not None
                views, used = self._views(bucket)
                t0 = time.perf_counter()
                dist.broadcast(self._buffer[:used], src=0, group=ctx.update_group)
                t1 = time.perf_counter()
                received += used
                for name, view in views:
                    self._loader.load(name, view)
                broadcast += t1 - t0
                load += time.perf_counter() - t1
        if ctx.role == "writer":
            return SyncReport({"gather": gather, "broadcast": broadcast})
        return SyncReport({"broadcast": broadcast, "load": load}, received)

    def close(self) -> None:
        self._buffer = None


class WeightsyncMethod:
    """weightsync over one transport: ``WeightWriter.write`` / ``WeightReader.update``."""

    def __init__(self, ctx: RankContext, *, transport: str, zero_copy: bool = False, integrity: bool = False) -> None:
        self.ctx = ctx
        self.transport = transport
        self.zero_copy = zero_copy  # shm: the trainer's weights live in /dev/shm (no snapshot copy)
        self.integrity = integrity  # SyncConfig(integrity=True): digests sent and checked in band
        self.name = (f"weightsync-{transport}" + ("-zero-copy" if zero_copy else "")
                     + (INTEGRITY_SUFFIX if integrity else ""))
        self._endpoint: Any = None
        self._shared: Any = None
        self._sources: dict[str, torch.Tensor] = ctx.tensors

    def setup(self) -> None:
        from weightsync.engines.buffers import ShardedEngine
        from weightsync.meta.client import MetaClient
        from weightsync.roles.reader import WeightReader
        from weightsync.roles.writer import WeightWriter
        from weightsync.session.sync_session import SyncConfig
        from weightsync.sources.module import ShardedSource
        from weightsync.transport import TransportOptions

        ctx = self.ctx
        opts = ctx.options
        job = f"{opts.get('job_prefix', 'bench')}-{self.name.replace('+', '-')}"  # a job name has no '+'
        config = SyncConfig(num_writers=ctx.num_writers, num_readers=ctx.num_readers, job=job,
                            transport=self.transport, timeout=ctx.timeout, integrity=self.integrity,
                            transport_options=TransportOptions(max_bucket_bytes=int(opts["max_bucket_bytes"]),
                                                               slots=int(opts.get("slots", 1))))
        meta = MetaClient.from_env(job=job)
        if ctx.role == "writer":
            tensors = ctx.tensors
            if self.zero_copy:
                from weightsync.transport.shm.files import share_tensors

                self._shared = share_tensors(ctx.tensors)
                tensors = self._shared.tensors
            self._sources = dict(tensors)
            source = ShardedSource(ctx.source, ctx.config, ctx.rank, tensors)
            self._endpoint = WeightWriter(source, rank=ctx.rank, config=config, meta=meta)
        else:
            engine = ShardedEngine(ctx.target, ctx.config, ctx.rank, ctx.tensors)
            self._endpoint = WeightReader(engine, rank=ctx.rank, config=config, meta=meta)
        self._meta = meta

    def source_tensors(self) -> dict[str, torch.Tensor]:
        return self._sources

    def sync(self, version: int) -> SyncReport:
        if self.ctx.role == "writer":
            return SyncReport(dict(self._endpoint.write(version, timeout=self.ctx.timeout).phases))
        result = self._endpoint.update(version, timeout=self.ctx.timeout)
        if result.version != version:
            raise RuntimeError(f"reader applied version {result.version}, expected {version}")
        return SyncReport(dict(result.phases), result.nbytes)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._meta.close()
            self._endpoint = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None


#: ``weightsync-<transport>+integrity``: the same method with ``SyncConfig(integrity=True)``.
INTEGRITY_SUFFIX = "+integrity"


def make_method(name: str, ctx: RankContext) -> Method:
    """``weightsync-<transport>`` (``+integrity``: with in-band digests), one of :data:`BASELINES`,
    or ``pkg.module:Class`` (your own; constructed as ``Class(ctx)``)."""
    if ":" in name:
        import importlib

        module, cls = name.split(":", 1)
        method: Method = getattr(importlib.import_module(module), cls)(ctx)
        return method
    integrity = name.endswith(INTEGRITY_SUFFIX)
    name = name.removesuffix(INTEGRITY_SUFFIX)
    if name == "weightsync-shm-zero-copy":
        return WeightsyncMethod(ctx, transport="shm", zero_copy=True, integrity=integrity)
    if name.startswith("weightsync-"):
        return WeightsyncMethod(ctx, transport=name.removeprefix("weightsync-"), integrity=integrity)
    if name in ("safetensors-disk", "safetensors-shm"):
        return SafetensorsReload(ctx, where=name.removeprefix("safetensors-"))
    if name == "per-param-broadcast":
        return PerParamBroadcast(ctx)
    if name == "bucketed-broadcast":
        return BucketedBroadcast(ctx, bucket_bytes=int(ctx.options["baseline_bucket_bytes"]))
    raise ValueError(f"unknown benchmark method {name!r}; known: weightsync-<transport>, {', '.join(BASELINES)}")


def reader_bytes(layout: RankLayout) -> int:
    """Bytes of canonical data a rank holds (padding excluded): what one sync must land there."""
    from weightsync.layout.types import itemsize

    return sum(region.box.numel * itemsize(shard.dtype) for shard, region in layout.regions())


__all__ = ["BASELINES", "Method", "RankContext", "SyncReport", "make_method", "plan_buckets", "reader_bytes"]
