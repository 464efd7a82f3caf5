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

verl hands the actor a generator of full (gathered) tensors, so actor rank 0 copies them
into one persistent staging buffer per tensor (the model's size, once, on the trainer's GPU
unless ``device=cpu``; refused with its figure when it does not fit,
:mod:`weightsync.integrations.actor_copy`) and writes from it;
the other actor ranks walk the generator (producing a tensor is collective over the actor
group) and send nothing. Rollout workers receive into persistent buffers of the same
layout, which they learn from the writer through the job channel on the first step, and
yield views of them to verl's server adapter. The meta server is the named Ray actor of
:mod:`weightsync.integrations.ray`, found by every worker; the weightsync job is planned once and reused
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

from weightsync.deadline import Deadline
from weightsync.integrations.verl_settings import VerlSyncSettings
from weightsync.job_wire import TensorTable
from weightsync.layout import RankLayout
from weightsync.layout.builders import replicated
from weightsync.layout.types import CanonicalTensor
from weightsync.ports import Invalid, Validity
from weightsync.torch_layout import allocate, dtype_name

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
    """verl's ``build_topology``: the master actor worker is writer 0, rollout worker i is reader i.

    Raises:
        ValueError: not exactly one actor worker is the master.
    """
    actors = metadata[:actor_world_size]
    masters = [i for i, m in enumerate(actors) if m.get("master")]
    if len(masters) != 1:
        raise ValueError(f"the weightsync backend needs exactly one master actor worker, got {len(masters)} "
                         "(verl marks actor rank 0 with is_master=True)")
    master = masters[0]
    actor_kwargs: dict[str, list[Any]] = {
        "role": ["writer" if i == master else "none" for i in range(actor_world_size)],
        "rank": [0 if i == master else -1 for i in range(actor_world_size)],
        "num_readers": [rollout_world_size] * actor_world_size}
    rollout_kwargs: dict[str, list[Any]] = {
        "role": ["reader"] * rollout_world_size, "rank": list(range(rollout_world_size)),
        "num_readers": [rollout_world_size] * rollout_world_size}
    return actor_kwargs, rollout_kwargs


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

    def init_process_group(self, role: str, rank: int, num_readers: int) -> None:
        if self.role and (self.role, self.rank, self.num_readers) != (role, rank, num_readers):
            raise ValueError(f"weightsync backend: this worker joined as {self.role} {self.rank} of a job with "
                             f"{self.num_readers} readers and is now asked to be {role} {rank} of {num_readers}: "
                             "a weightsync job keeps its ranks; rebuild the trainer to change the rollout size")
        self.role, self.rank, self.num_readers = role, rank, num_readers

    def finalize(self) -> None:
        """Nothing to free between steps: the job's connections and buffers persist."""

    def _config(self) -> Any:
        """The job's settings, placed on this worker's Ray node (see :mod:`weightsync.integrations.ray.actors`)."""
        from weightsync.integrations.ray.actors import placed_config

        return placed_config(self.settings.sync_config(num_readers=self.num_readers))

    def _meta(self) -> Any:
        from weightsync.integrations.ray import meta_server

        job = self.settings.sync_config(num_readers=1)
        return meta_server(name=self.settings.meta_name, timeout=job.timeout).client(job=job.job)

    # -- actor side -----------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
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
        return {"weightsync/bytes": result.nbytes, "weightsync/seconds": result.seconds}

    async def _start_writer(self, weights: Any) -> None:
        from weightsync.integrations.actor_copy import copy_model
        from weightsync.writer import WeightWriter

        device = self.settings.staging_device
        # one tensor at a time: verl may gather each on the fly and free it after the yield;
        # a copy that does not fit is refused with its figure before anything is sent
        buffers = await copy_model(_aiter(weights), device=device)
        table = tensor_table(buffers)
        self._staged = WholeTensorBuffers(table_layout(table, 0), buffers)
        self._writer = WeightWriter(self._staged, rank=0, config=self._config(), meta=self._meta())
        self._writer.session.channel.publish_tensor_table(table)
        logger.info("weightsync backend: writer stages %d tensors (%d bytes) on %s", len(buffers),
                    self._staged.layout().nbytes, device)

    async def _stage(self, weights: Any) -> None:
        assert self._staged is not None
        buffers, seen = self._staged.buffers, 0
        async for name, t in _aiter(weights):
            target = buffers.get(name)
            if target is None or target.shape != t.shape or target.dtype != t.dtype:
                raise ValueError(f"weightsync backend: tensor {name!r} ({tuple(t.shape)}, {t.dtype}) is not one the "
                                 "job was planned with; the model's tensors must not change between steps")
            target.copy_(t)
            seen += 1
        if seen != len(buffers):
            raise ValueError(f"weightsync backend: the actor yielded {seen} tensors, the job was planned with "
                             f"{len(buffers)}")

    # -- rollout side ---------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        if self._reader is None:
            await asyncio.to_thread(self._start_reader)
        await asyncio.to_thread(self._reader.update, global_steps)
        assert self._staged is not None
        for name, t in self._staged.buffers.items():
            yield name, t

    def _start_reader(self) -> None:
        from weightsync.job import JobChannel
        from weightsync.reader import WeightReader

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
