"""verl checkpoint-engine backend ``weightsync``: verl's actor -> rollout sync over weightsync.

The one configuration change a verl user makes (the ``checkpoint_engine`` section of the
rollout config; ``custom_backend_module`` makes every verl worker import this module, which
registers the backend)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync \\
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl

Optional ``engine_kwargs.weightsync`` (:mod:`weightsync.integrations.verl_settings`): ``device``
(of the staging buffers; default ``cuda`` when available) and any job setting of ``SyncConfig``
(``job``, default ``"verl"``; ``transport``, default ``"auto"``: shared memory between workers on
one Ray node, torch between nodes, per pair; ``timeout``, default 600 s; ``max_bucket_bytes``, ...).

How verl drives it, every training step (``CheckpointEngineManager.update_weights``)::

    meta = engine.prepare()                       # every worker: its Ray node
    actor_kw, rollout_kw = build_topology(...)    # actor rank 0 = writer 0; rollout worker i = reader i
    engine.init_process_group(**kw)               # first call joins the job; later calls check it
    await engine.send_weights(weights, step)      # actor: stage the full tensors, write version `step`
    async for name, t in engine.receive_weights(step): ...   # rollout: receive, then yield
    engine.finalize()                             # nothing to free: connections stay up

verl hands every actor worker a generator of full (gathered) tensors, in one order; every
actor worker is a writer of a share of them (:class:`Shares`: each tensor goes to the
least-loaded writer by bytes, which every worker computes alike), copied into one persistent
staging buffer per tensor of its share (``1/N`` of the model on each of ``N`` workers, on the
trainer's GPU unless ``device=cpu``; refused with its figure when it does not fit,
:mod:`weightsync.integrations.actor_copy`) and written from it: no worker keeps or sends the
whole model. (The gather itself is verl's: its generator yields whole tensors.) Rollout
workers receive into persistent buffers of the same
layout, which they learn from the writer through the job channel on the first step, and
yield views of them to verl's server adapter. The coordinator is the named Ray actor of
:mod:`weightsync.integrations.ray`, found by every worker, unless ``meta_address`` names one (an
etcd cluster for a job that must survive the loss of the Ray head); the weightsync job is planned once and reused
by every step, so verl's per-step ``prepare``/``finalize`` cost nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any, ClassVar

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from weightsync.clock.deadline import Deadline
from weightsync.integrations.verl_settings import VerlSyncSettings
from weightsync.job.wire import TensorTable
from weightsync.layout import RankLayout
from weightsync.layout.builders import replicated
from weightsync.layout.types import CanonicalTensor
from weightsync.ports.engine import Invalid, Validity
from weightsync.tools.torch_layout import allocate, dtype_name

logger = logging.getLogger(__name__)

BACKEND = "weightsync"


def tensor_table(tensors: Mapping[str, torch.Tensor]) -> TensorTable:
    """Names, shapes and dtypes: what a reader needs to lay out the same buffers."""
    return TensorTable.from_tensors((name, t.shape, dtype_name(t.dtype)) for name, t in tensors.items())


def table_layout(table: TensorTable, rank: int) -> RankLayout:
    """One whole tensor per name: the explicit layout of a rank holding every tensor in ``table``."""
    canonical = {e.name: CanonicalTensor(e.name, e.shape, e.dtype) for e in table.entries}
    return RankLayout(rank, tuple(replicated(t, t.name) for t in canonical.values()), canonical)


class WholeTensorBuffers:
    """Whole tensors in persistent buffers: a training source (writer) and an engine (reader)."""

    stages_in_phases: ClassVar[bool] = False
    keeps_received_bytes: ClassVar[bool] = True
    in_place_names: tuple[str, ...] | None = None  # see InferenceEngine.in_place_names

    def __init__(self, layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> None:
        self._layout = layout
        self.buffers = dict(buffers)
        self.validity = Validity()

    def layout(self) -> RankLayout:
        return self._layout

    def descriptor(self) -> None:
        return None

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self.buffers

    def receive_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.buffers

    def receiving(self, version: int) -> None:
        self.validity.touch(version)  # the buffers are what the rollout reads

    def apply(self, version: int) -> None:
        self.validity.applied(version)

    def abort(self, version: int, error: BaseException) -> None:
        self.validity.failed(version, error)

    @property
    def weight_version(self) -> int | None:
        return self.validity.version

    @property
    def invalid(self) -> Invalid | None:
        return self.validity.invalid


def topology(actor_world_size: int, rollout_world_size: int,
             metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """verl's ``build_topology``: every actor worker is a writer (the master is writer 0, the
    others follow in order), rollout worker i is reader i.

    Raises:
        ValueError: not exactly one actor worker is the master.
    """
    actors = metadata[:actor_world_size]
    masters = [i for i, m in enumerate(actors) if m.get("master")]
    if len(masters) != 1:
        raise ValueError(f"the weightsync backend needs exactly one master actor worker, got {len(masters)} "
                         "(verl marks actor rank 0 with is_master=True)")
    order = masters + [i for i in range(actor_world_size) if i != masters[0]]
    sizes = {"num_readers": rollout_world_size, "num_writers": actor_world_size}
    actor_kwargs: dict[str, list[Any]] = {
        "role": ["writer"] * actor_world_size, "rank": [order.index(i) for i in range(actor_world_size)],
        **{k: [v] * actor_world_size for k, v in sizes.items()}}
    rollout_kwargs: dict[str, list[Any]] = {
        "role": ["reader"] * rollout_world_size, "rank": list(range(rollout_world_size)),
        **{k: [v] * rollout_world_size for k, v in sizes.items()}}
    return actor_kwargs, rollout_kwargs


class Shares:
    """Which writer sends each tensor: verl yields every tensor whole on every actor worker, in one
    order, so each worker assigns the next tensor to the least-loaded writer (by bytes, the lowest
    rank on a tie) and all agree without talking. Each writer stages and sends its share only."""

    def __init__(self, writers: int) -> None:
        self.load = [0] * writers
        self.owner: dict[str, int] = {}

    def assign(self, name: str, t: torch.Tensor) -> int:
        if name not in self.owner:
            rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
            self.owner[name] = rank
            self.load[rank] += t.numel() * t.element_size()
        return self.owner[name]


@CheckpointEngineRegistry.register(BACKEND)
class WeightSyncCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl's checkpoint-engine interface over a weightsync job (see module docstring)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **settings: Any) -> None:
        self.bucket_size = bucket_size  # verl's bucket: weightsync sizes its own messages
        self.is_master = is_master
        self.settings = VerlSyncSettings.from_engine_kwargs(settings)
        self.role = ""
        self.rank = -1
        self.num_readers = 0
        self.num_writers = 1
        self._shares: Shares | None = None
        self._writer: Any = None
        self._reader: Any = None
        self._staged: WholeTensorBuffers | None = None
        self._versions = itertools.count(1)

    # -- verl's per-step setup ------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        from weightsync.integrations.ray import node_identity

        return {"master": self.is_master, "node": node_identity()[0]}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, role: str, rank: int, num_readers: int, num_writers: int = 1) -> None:
        if self.role and (self.role, self.rank, self.num_readers, self.num_writers) != (role, rank, num_readers,
                                                                                       num_writers):
            raise ValueError(f"weightsync backend: this worker joined as {self.role} {self.rank} of a job with "
                             f"{self.num_writers} writers and {self.num_readers} readers and is now asked to be "
                             f"{role} {rank} of {num_writers} and {num_readers}: a weightsync job keeps its ranks; "
                             "rebuild the trainer to change the actor or rollout size")
        self.role, self.rank, self.num_readers, self.num_writers = role, rank, num_readers, num_writers

    def finalize(self) -> None:
        """Nothing to free between steps: the job's connections and buffers persist."""

    def _config(self) -> Any:
        """The job's settings, placed on this worker's Ray node (see :mod:`weightsync.integrations.ray.actors`)."""
        from weightsync.integrations.ray.actors import placed_config

        return placed_config(self.settings.sync_config(num_readers=self.num_readers, num_writers=self.num_writers))

    def _meta(self) -> Any:
        """The job's coordinator: the one ``meta_address`` names (an etcd cluster, or a meta server
        with ``WEIGHTSYNC_META_TOKEN`` in the workers' environment), else the named Ray actor."""
        from weightsync.integrations.ray import meta_server
        from weightsync.integrations.ray.meta import DEFAULT_NAME
        from weightsync.meta.client import open_meta

        job = self.settings.sync_config(num_readers=1)
        if job.meta_address:
            return open_meta(job.meta_address, job=job.job, timeout=job.timeout)
        return meta_server(name=self.settings.meta_name or DEFAULT_NAME, timeout=job.timeout).client(job=job.job)

    # -- actor side -----------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Stage this actor worker's share of ``weights`` and write it as version ``global_steps``.

        Returns:
            verl's sync metrics (merged over the actor workers by verl, the last one's wins):
            ``weightsync/sync_seconds``, ``weightsync/bytes`` (this worker's share) and
            ``weightsync/version_lag`` (versions the slowest rollout worker is behind after it).
        """
        if self.role != "writer":  # producing each tensor is collective: walk the generator
            async for _ in _aiter(weights):
                pass
            return {}
        with torch.no_grad():
            if self._staged is None:
                await self._start_writer(weights)
            else:
                await self._stage(weights)
        version = global_steps if global_steps is not None else next(self._versions)
        result = await asyncio.to_thread(self._writer.write, version)
        lag = await asyncio.to_thread(self._writer.session.channel.reader_lag, version, self.num_readers)
        return {"weightsync/bytes": result.nbytes, "weightsync/sync_seconds": result.seconds,
                "weightsync/version_lag": lag}

    async def _start_writer(self, weights: Any) -> None:
        from weightsync.integrations.actor_copy import copy_model
        from weightsync.roles.writer import WeightWriter

        device = self.settings.staging_device
        shares = self._shares = Shares(self.num_writers)
        every: dict[str, torch.Tensor] = {}

        def mine(name: str, t: torch.Tensor) -> bool:
            every[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            return shares.assign(name, t) == self.rank

        # one tensor at a time: verl may gather each on the fly and free it after the yield;
        # a copy that does not fit is refused with its figure before anything is sent
        buffers = await copy_model(_aiter(weights), device=device, keep=mine)
        self._staged = WholeTensorBuffers(table_layout(tensor_table(buffers), self.rank), buffers)
        self._writer = WeightWriter(self._staged, rank=self.rank, config=self._config(), meta=self._meta())
        if self.rank == 0:  # what the readers lay out: every tensor, whoever sends it
            self._writer.session.channel.publish_tensor_table(tensor_table(every))
        logger.info("weightsync backend: writer %d of %d stages its share, %d of %d tensors (%d bytes) on %s",
                    self.rank, self.num_writers, len(buffers), len(every), self._staged.layout().nbytes, device)

    async def _stage(self, weights: Any) -> None:
        assert self._staged is not None and self._shares is not None
        buffers, owner, seen = self._staged.buffers, self._shares.owner, 0
        async for name, t in _aiter(weights):
            seen += 1
            if owner.get(name) != self.rank:
                if name not in owner:
                    raise ValueError(f"weightsync backend: tensor {name!r} is not one the job was planned with; the "
                                     "model's tensors must not change between steps")
                continue  # another writer's share
            target = buffers[name]
            if target.shape != t.shape or target.dtype != t.dtype:
                raise ValueError(f"weightsync backend: tensor {name!r} ({tuple(t.shape)}, {t.dtype}) is not one the "
                                 "job was planned with; the model's tensors must not change between steps")
            target.copy_(t)
        if seen != len(owner):
            raise ValueError(f"weightsync backend: the actor yielded {seen} tensors, the job was planned with "
                             f"{len(owner)}")

    # -- rollout side ---------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        if self._reader is None:
            await asyncio.to_thread(self._start_reader)
        await asyncio.to_thread(self._reader.update, global_steps)
        assert self._staged is not None
        for name, t in self._staged.buffers.items():
            yield name, t

    def _start_reader(self) -> None:
        from weightsync.job.channel import JobChannel
        from weightsync.roles.reader import WeightReader

        meta = self._meta()
        channel = JobChannel(meta, role="reader", rank=self.rank)
        timeout = self.settings.sync_config(num_readers=1).timeout
        table = channel.wait_tensor_table(deadline=Deadline.after(timeout))
        if table is None:
            raise TimeoutError(f"weightsync backend: reader {self.rank} waited {timeout} s for the "
                               "actor's tensor list (does the actor use the weightsync backend too?)")
        layout = table_layout(table, self.rank)
        self._staged = WholeTensorBuffers(layout, allocate(layout, device=self.settings.staging_device))
        self._reader = WeightReader(self._staged, rank=self.rank, config=self._config(), meta=meta)


async def _aiter(weights: Any) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    """verl's weights: a generator or an async generator of (name, tensor)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
