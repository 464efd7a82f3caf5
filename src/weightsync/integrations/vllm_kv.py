"""The weightsync KV connector for vLLM (V1 connector API): rollouts' KV blocks to and from the store.

vLLM loads it by name when an engine is built with::

    kv_transfer_config=KVTransferConfig(
        kv_connector="WeightsyncKVConnector", kv_connector_module_path="weightsync.integrations.vllm_kv",
        kv_role="kv_both", kv_connector_extra_config={"directory": "/dev/shm/weightsync-rl-job7",
                                                       "budget_bytes": 2 << 30})

(:func:`kv_transfer_config` builds it). A request takes part when its ``kv_transfer_params``
carry ``{"weightsync_kv": {"rollout": id, "version": V}}``
(:meth:`weightsync.roles.rollouts.TurnRequest.kv_transfer_params`); others are left alone.

**Scheduler side** (vLLM's scheduler calls it while admitting and scheduling requests):
``get_num_new_matched_tokens`` counts the request's leading full blocks that the store holds
for its rollout and version, beyond what the engine's own prefix cache already has, and never
the prompt's last token (vLLM computes at least one); ``update_state_after_alloc`` notes which
engine blocks they go to; ``build_connector_meta`` lists for the worker the loads of this step
and the saves: every block that this step's forward completes (and any earlier complete block
of the request the store lacks, such as local prefix-cache hits).

**Worker side**: ``start_load_kv`` copies the listed blocks into the paged KV cache before the
forward (synchronously: a load that fails is reported through
``get_block_ids_with_load_errors`` and vLLM computes those blocks again, with
``kv_load_failure_policy="recompute"``); ``wait_for_save`` copies the listed blocks out after
the forward. Per-layer hooks do nothing: loads and saves are whole blocks of every layer.

**Metrics.** Through vLLM's own connector-metrics hooks, on the engine's Prometheus registry
(``/metrics`` of ``vllm serve``, ``LLM.get_metrics()``): per engine, the counters
``vllm:weightsync_kv_{saved,loaded}_{blocks,bytes}`` and ``vllm:weightsync_kv_missed_blocks``
(loads that failed, so the engine computed the block), which the workers report with each
step's output (:class:`WeightsyncKVStats`); and the store's host-wide ledger as gauges
``vllm:weightsync_kv_store_<field>`` (:class:`~weightsync.roles.rollouts.kv.KVMetrics`: bytes
held, blocks, evictions, drops, rejections), read again whenever the engine reports KV moves,
and ``vllm:weightsync_kv_store_budget_bytes``. Gauges, not counters, because the ledger is
kept by every process of the host, not by this engine.

**Versions.** The version in a request's params names the weights that compute and read its KV.
The engine adapter also tells the connector which version it serves (:func:`set_engine_version`,
in the process that hosts the worker); a request naming another version is neither loaded nor
saved, so a request queued across an update never mixes versions.

Why a connector of our own: vLLM 0.32's CPU worker runs the V1 connector machinery (its
``CPUModelRunner`` is the GPU runner's), and the shipped connectors that persist KV either
address blocks by prompt hash alone, with no notion of a weight version or a rollout
(``ExampleConnector``, LMCache), need CUDA streams for their host copies (``OffloadingConnector``,
``SimpleCPUOffloadConnector``) or pair one prefill engine with one decode engine live
(``NixlConnector``). docs/rl-state.md.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from weightsync.roles.rollouts.engine import KV_PARAMS_KEY
from weightsync.roles.rollouts.kv import BlockKey, KVMetrics, KVMissError, KVStore, KVStoreConfig, block_digests

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: the version the engine in this process serves (None: not told; then only the request's params count)
_ENGINE: dict[str, int | None] = {"version": None}


def set_engine_version(version: int | None) -> None:
    """Tell the connectors of this process which weight version their engine now serves."""
    _ENGINE["version"] = version


def engine_version() -> int | None:
    return _ENGINE["version"]


def kv_transfer_config(directory: str, *, budget_bytes: int = 1 << 30, namespace: str = "") -> Any:
    """vLLM's ``KVTransferConfig`` for this connector (``namespace`` keeps jobs sharing a directory apart)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="WeightsyncKVConnector", kv_connector_module_path=__name__,
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"directory": directory, "budget_bytes": budget_bytes,
                                                       "namespace": namespace})


@dataclass(frozen=True, slots=True)
class _Move:
    key: BlockKey
    block_id: int


@dataclass
class _Meta(KVConnectorMetadata):
    loads: list[_Move] = field(default_factory=list)
    saves: list[_Move] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request that takes part: its rollout, version, engine blocks and how many blocks the store has."""

    request: Request
    rollout: str
    version: int
    blocks: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)  # of its full blocks so far (hashed once each)
    stored: int = 0  # leading blocks the store holds (found, or saved since)
    local: int = 0  # tokens the engine's prefix cache had when it was admitted
    restored: int = 0  # tokens loaded from the store


#: the names of the connector's metrics on vLLM's registry begin with it
METRIC_PREFIX = "vllm:weightsync_kv_"
#: what a worker counts per step (names as in the store's ledger, :class:`KVMetrics`)
STEP_COUNTERS = ("saved_blocks", "saved_bytes", "loaded_blocks", "loaded_bytes", "missed_blocks")


@dataclass
class WeightsyncKVStats(KVConnectorStats):
    """The KV one engine's connectors moved since their last report: ``data`` maps each of
    :data:`STEP_COUNTERS` to a count (one block per block and engine shard, as files in the store).

    vLLM takes it from every worker with each step's output, sums the workers' (``aggregate``),
    and hands ``data`` to the metrics loggers of the engine's front end.
    """

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def add(self, **counts: int) -> None:
        for name, n in counts.items():
            self.data[name] = self.data.get(name, 0) + int(n)

    def aggregate(self, other: KVConnectorStats) -> WeightsyncKVStats:
        self.add(**{k: v for k, v in other.data.items() if k in STEP_COUNTERS})
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in STEP_COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in STEP_COUNTERS)


class WeightsyncKVPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (module docstring, *Metrics*), made by vLLM's stat logger
    in the engine's front end (``build_prom_metrics``) with vLLM's metric classes and labels."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = self._kv_transfer_config.kv_connector_extra_config if self._kv_transfer_config else {}
        self.directory = str(extra.get("directory", ""))

        def per_engine(cls: Any, name: str, doc: str) -> dict[int, Any]:
            return create_metric_per_engine(cls(name=name, documentation=doc, labelnames=labelnames),
                                            per_engine_labelvalues)

        self.counters = {name: per_engine(self._counter_cls, METRIC_PREFIX + name,
                                          f"weightsync KV connector: {name.replace('_', ' ')} by this engine "
                                          "(per block and engine shard; missed: loads the engine computed instead)")
                         for name in STEP_COUNTERS}
        self.store = {m.name: per_engine(self._gauge_cls, f"{METRIC_PREFIX}store_{m.name}",
                                             f"weightsync KV store {self.directory}: {m.name.replace('_', ' ')} "
                                             "(the host-wide ledger every process of the host keeps)")
                      for m in fields(KVMetrics)}
        budget = per_engine(self._gauge_cls, f"{METRIC_PREFIX}store_budget_bytes",
                            f"weightsync KV store {self.directory}: its budget in bytes")
        for gauge in budget.values():
            gauge.set(int(extra.get("budget_bytes", 1 << 30)))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in STEP_COUNTERS:
            if count := int(transfer_stats_data.get(name, 0)):
                self.counters[name][engine_idx].inc(count)
        ledger = KVStore.read_metrics(self.directory) if self.directory else None
        if ledger is not None:  # None: the store is on another host than this front end
            for name, gauges in self.store.items():
                gauges[engine_idx].set(getattr(ledger, name))


class WeightsyncKVConnector(KVConnectorBase_V1):
    """See module docstring. vLLM makes one per role: the scheduler's and each worker's."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        if "directory" not in extra:
            raise ValueError("the weightsync KV connector needs kv_connector_extra_config['directory'] (where the "
                             "rollouts' KV lives); build the config with weightsync.integrations.vllm_kv."
                             "kv_transfer_config(directory)")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(f"the weightsync KV connector handles one KV cache group (full attention); this model "
                             f"has {len(kv_cache_config.kv_cache_groups)} (sliding-window or hybrid layers)")
        self._store = KVStore(KVStoreConfig(directory=str(extra["directory"]),
                                            budget_bytes=int(extra.get("budget_bytes", 1 << 30))))
        # vLLM counts restored tokens by tier (vllm:prompt_tokens_cached_by_source): host memory or a file system
        self._cache_hit_source = (CacheHitSource.HOST if self._store.root.startswith("/dev/shm/")
                                  else CacheHitSource.DISK)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._layout = layout_fingerprint(vllm_config, kv_cache_config, str(extra.get("namespace", "")))
        parallel = vllm_config.parallel_config
        self._shards = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self._shard = _worker_shard(vllm_config) if role == KVConnectorRole.WORKER else 0
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[_Move] = []
        self._kv: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._stats = WeightsyncKVStats()

    # -- scheduler side ----------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        params = (request.kv_transfer_params or {}).get(KV_PARAMS_KEY)
        if not isinstance(params, dict):
            return
        version, served = int(params["version"]), engine_version()
        if served is not None and version != served:
            logger.warning("request %s names KV of version %d, the engine serves %d: no KV loaded or saved",
                           request.request_id, version, served)
            return
        self._tracked[request.request_id] = _Tracked(request, str(params["rollout"]), version)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return 0, False
        prompt = request.prompt_token_ids or []
        keys = self._keys(tracked, prompt, (len(prompt) - 1) // self._block_size)
        tracked.stored = self._store.lookup(keys, shards=self._shards)
        tracked.local = num_computed_tokens
        return max(0, tracked.stored * self._block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens == 0:
            return
        block_ids = blocks.get_block_ids()[0]
        first = tracked.local // self._block_size
        count = num_external_tokens // self._block_size
        keys = self._keys(tracked, request.prompt_token_ids or [], first + count)
        self._loads += [_Move(keys[i], block_ids[i]) for i in range(first, first + count)]
        tracked.restored = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = _Meta(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if (tracked := self._tracked.get(new.req_id)) is not None:
                tracked.blocks = list(new.block_ids[0])
                meta.saves += self._saves(tracked, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (tracked := self._tracked.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.blocks = list(new_ids[0]) if new_ids is not None else tracked.blocks
            elif new_ids is not None:
                tracked.blocks += new_ids[0]
            meta.saves += self._saves(tracked, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        return False, {KV_PARAMS_KEY: {"rollout": tracked.rollout, "version": tracked.version,
                                       "restored_tokens": tracked.restored}}

    def _keys(self, tracked: _Tracked, tokens: Sequence[int], count: int) -> list[BlockKey]:
        """The keys of the first ``count`` blocks of ``tokens`` (the request's own: its digests are kept)."""
        if count > len(tracked.digests):
            tracked.digests = block_digests(tokens, self._block_size, count, after=tracked.digests)
        return [BlockKey(self._layout, tracked.rollout, tracked.version, i, d)
                for i, d in enumerate(tracked.digests[:count])]

    def _saves(self, tracked: _Tracked, computed_after: int) -> list[_Move]:
        """The blocks complete after this step that the store lacks (tokens known to the scheduler only)."""
        tokens = tracked.request.all_token_ids
        full = min(computed_after, len(tokens)) // self._block_size
        if full <= tracked.stored:
            return []
        keys = self._keys(tracked, tokens, full)
        moves = [_Move(keys[i], tracked.blocks[i]) for i in range(tracked.stored, full)]
        tracked.stored = full
        return moves

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, kv in kv_caches.items():
            if kv.shape[0] != self._num_blocks:
                raise ValueError(f"layer {name}'s KV cache has shape {tuple(kv.shape)}, not vLLM's standard per-layer "
                                 f"view with its {self._num_blocks} blocks first; the weightsync KV connector "
                                 "cannot address its blocks")
        self._kv = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for move in meta.loads:
            try:
                if (served := engine_version()) is not None and move.key.version != served:
                    raise KVMissError(f"block of version {move.key.version}; the engine serves {served}")
                tensors = self._store.load(move.key.of_shard(self._shard))
                with gpu_sync_allowed():  # a deliberate host-to-device copy, before the forward that reads it
                    for name, kv in self._kv.items():
                        kv[move.block_id].copy_(_block_like(tensors, name, kv[move.block_id]))
                self._stats.add(loaded_blocks=1, loaded_bytes=sum(t.nbytes for t in tensors.values()))
            except KVMissError as exc:
                logger.info("KV block %s not loaded (%s): the engine computes it", move.key.relpath, exc)
                self._load_errors.add(move.block_id)
                self._stats.add(missed_blocks=1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for move in meta.saves:
            if (served := engine_version()) is not None and move.key.version != served:
                continue
            with gpu_sync_allowed():  # a host copy; on a GPU a synchronous device-to-host copy after the forward
                block = {name: kv[move.block_id].to("cpu", copy=True) for name, kv in self._kv.items()}
            if self._store.save(move.key.of_shard(self._shard), block):
                self._stats.add(saved_blocks=1, saved_bytes=sum(t.nbytes for t in block.values()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- metrics (module docstring, *Metrics*) -----------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, WeightsyncKVStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return WeightsyncKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return WeightsyncKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _worker_shard(vllm_config: VllmConfig) -> int:
    """This worker's shard of the engine's KV: its pipeline stage, then its tensor-parallel rank."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return get_pp_group().rank_in_group * vllm_config.parallel_config.tensor_parallel_size + \
        get_tp_group().rank_in_group


def _block_like(tensors: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    block = tensors.get(name)
    if block is None or block.shape != like.shape or block.dtype != like.dtype:
        got = None if block is None else (tuple(block.shape), block.dtype)
        raise KVMissError(f"layer {name}: stored block is {got}, the engine's is {(tuple(like.shape), like.dtype)}")
    return block


def layout_fingerprint(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, namespace: str = "") -> str:
    """What KV blocks must agree on to be exchanged: the model's architecture and the KV shapes.

    Not the checkpoint path (engines of one job load it from different places) and not the
    weights (the version in each key says which).
    """
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    hf = vllm_config.model_config.hf_config
    shape = [str(getattr(spec, attr, "")) for attr in ("block_size", "num_kv_heads", "head_size", "dtype")]
    parts = [namespace, ",".join(getattr(hf, "architectures", None) or []), *shape, ",".join(group.layer_names)]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()
