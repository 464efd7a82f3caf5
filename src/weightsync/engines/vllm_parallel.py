"""Which slices of the checkpoint a vLLM worker of a sharded engine reads, and its reader rank.

A vLLM engine with tensor parallelism ``T`` runs ``T`` workers (times its data-parallel replicas);
each loads the whole checkpoint tensors its loaders are given, but keeps only its slice of each
sharded one. A weightsync reader per worker therefore stages checkpoint-shaped tensors (vLLM's
loader is handed them as at start-up) into which only the slices that worker's loaders read
arrive: vLLM's own loaders say which, recorded on the meta device
(:func:`weightsync.engines.vllm_layout.record_rank`), so each worker receives ``1/T`` of every
sharded tensor and the whole of the replicated ones (norms)::

    reads = worker_reads(vllm_config)              # None for a single worker: the whole model
    rank = first_reader + worker_index(vllm_config)

Pipeline parallelism is refused (a stage would stage layers it never loads; not built).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from weightsync.layout.box import Box
from weightsync.tools.torch_layout import dtype_name


def check_parallel(vllm_config: Any) -> None:
    """Refuse the parallel layouts the readers are not built for (pipeline stages)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(f"weightsync's vLLM adapter serves tensor and data parallel engines, not pipeline parallel "
                         f"ones (PP={parallel.pipeline_parallel_size}): a stage would receive layers it never loads; "
                         "run PP=1 (TP and DP of any size), or one engine per stage is not supported")


def tensor_rank(vllm_config: Any) -> tuple[int, int]:
    """(TP size, this worker's TP rank), in the worker's process."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp == 1:
        return 1, 0
    from vllm.distributed import get_tensor_model_parallel_rank

    return tp, int(get_tensor_model_parallel_rank())


def worker_index(vllm_config: Any) -> int:
    """This worker's place among its engine's readers: ``d * T + t`` for TP rank ``t`` of DP
    replica ``d`` (each DP replica's workers follow the previous replica's)."""
    tp, t = tensor_rank(vllm_config)
    return int(vllm_config.parallel_config.data_parallel_rank) * tp + t


def workers_per_engine(vllm_config: Any) -> int:
    """How many weightsync readers an engine of this configuration is: one per worker."""
    parallel = vllm_config.parallel_config
    return int(parallel.tensor_parallel_size) * int(parallel.data_parallel_size)


def worker_reads(vllm_config: Any, *, mtp: bool = False) -> dict[str, list[Box]] | None:
    """The boxes of each canonical tensor this worker's loaders read; None when it reads the whole
    model (one TP rank, no expert parallelism)."""
    parallel = vllm_config.parallel_config
    ep = bool(getattr(parallel, "enable_expert_parallel", False))
    tp, t = tensor_rank(vllm_config)
    if tp == 1 and not ep:
        return None
    from weightsync.engines.vllm_layout import record_rank

    dp, d = (int(parallel.data_parallel_size), int(parallel.data_parallel_rank)) if ep else (1, 0)
    config = vllm_config.model_config.hf_config.to_dict()
    shards = record_rank(config, tp=tp, dp=dp, ep=ep, rank=d * tp + t, mtp=mtp,
                         dtype=dtype_name(vllm_config.model_config.dtype))
    reads: dict[str, list[Box]] = defaultdict(list)
    for shard in shards:
        for region in shard.regions:
            reads[region.canonical].append(region.box)
    return dict(reads)
