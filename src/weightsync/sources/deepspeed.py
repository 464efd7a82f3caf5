"""DeepSpeed ZeRO-3: each rank's flat parameter partitions (``param.ds_tensor``), no gather.

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    source = ZeroSource(engine, hf_config, rank=dist.get_rank())

ZeRO-3 flattens every parameter on its own and gives rank ``r`` of the parameter's
partition group (``ds_process_group``) the flat elements ``[r*P, (r+1)*P)``, ``P =
ceil(numel / group size)``; the tail of the last run is padding (uninitialised memory,
mapped to nothing here). ``ds_tensor`` is that run, a view into the rank's flat partition
buffer which the optimizer updates in place. The source reads ``ds_tensor``, ``ds_shape``
and ``ds_numel`` only, never ``param.data`` (empty, or the whole tensor while gathered).
It imports nothing from deepspeed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.layout import Box, ModelSpec, RankLayout, Shard
from weightsync.layout.families import BUFFER_ROLES
from weightsync.layout.params import ParamParts, hf_param
from weightsync.sources.param_mapping import check_known, clean_name, matching_descriptor, read_config, uniform_dtype
from weightsync.tools.torch_layout import dtype_name, named_tensors


def partition_range(param: Any) -> tuple[int, int, int]:
    """(group size, first, last + 1) flat elements of a ZeRO-3 ``param`` this rank holds."""
    group = getattr(param, "ds_process_group", None)
    size = torch.distributed.get_world_size(group=group)
    rank = torch.distributed.get_rank(group=group)
    numel = int(param.ds_numel)
    per = param.ds_tensor.numel()
    if per != -(-numel // size):
        raise ValueError(f"ds_tensor holds {per} elements; ZeRO-3 over {size} ranks gives "
                         f"{-(-numel // size)} of {numel}")
    start = min(rank * per, numel)
    return size, start, min(start + per, numel)


def _shard(name: str, param: Any, parts: ParamParts) -> tuple[Shard, int]:
    if tuple(param.ds_shape) != parts.shape or int(param.ds_numel) != math.prod(parts.shape):
        raise ValueError(f"{name}: ds_shape {tuple(param.ds_shape)} differs from {parts.shape}, the shape "
                         "the model config gives")
    size, start, stop = partition_range(param)
    local = param.ds_tensor
    return Shard(name, (local.numel(),), dtype_name(local.dtype), tuple(parts.flat_regions(start, stop))), size


def _is_buffer(parts: ParamParts | None) -> bool:
    return parts is not None and parts.role in BUFFER_ROLES


class ZeroSource:
    """A model partitioned by DeepSpeed ZeRO stage 3, parameters named like transformers'.

    Args:
        engine_or_model: the DeepSpeed engine (its ``.module`` is read) or the module.
        config: the Hugging Face config (dict) or a ModelSpec.
        rank: this writer's rank.

    Raises:
        ValueError: listing parameter names no canonical tensor matches, parameters that
            ZeRO-3 did not partition (no ``ds_tensor``: stages 0-2 keep whole parameters,
            use ModuleSource), or shapes that disagree with the config.
    """

    def __init__(self, engine_or_model: Any, config: Mapping[str, Any] | ModelSpec, *, rank: int) -> None:
        self.module: torch.nn.Module = getattr(engine_or_model, "module", engine_or_model)
        self.spec, self.config = read_config(config)
        params = named_tensors(self.module, self.spec, clean_name)
        parts = {name: hf_param(self.spec, name) for name in params}
        check_known([name for name, p in parts.items() if p is None], self.spec, "model")
        plain = [n for n, p in params.items() if not hasattr(p, "ds_tensor") and not _is_buffer(parts[n])]
        if plain:
            raise ValueError(f"{len(plain)} parameter(s) are not ZeRO-3 partitioned (no ds_tensor), e.g. "
                             f"{plain[:3]}: ZeroSource reads stage 3 only; with stages 0-2 use ModuleSource")
        shards, sizes = [], set()
        for name, p in parts.items():
            if p is not None and _is_buffer(p):  # a buffer ZeRO-3 leaves whole
                t = params[name]
                shards.append(Shard(name, tuple(t.shape), dtype_name(t.dtype), tuple(p.box_regions(
                    Box.full(p.shape), p.shape))))
            elif p is not None:
                shard, size = _shard(name, params[name], p)
                shards.append(shard)
                sizes.add(size)
        self._params = params
        self._group_sizes = sizes
        self._layout = RankLayout(rank, tuple(shards), self.spec.canonical_tensors())

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Each parameter's live ``ds_tensor`` (padding included, contiguous, no copy)."""
        return {name: (param.ds_tensor if hasattr(param, "ds_tensor") else param).detach()
                for name, param in self._params.items()}

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        """``deepspeed:dp=N`` when this rank's shards are exactly that kind's."""
        if len(self._group_sizes) != 1:
            return None
        dp = next(iter(self._group_sizes))
        suffix = uniform_dtype(self._layout, self.spec)
        candidates = [f"deepspeed:dp={dp}{suffix}", f"deepspeed:dp={dp},per_expert=1{suffix}"]
        return matching_descriptor(self._layout, self.spec, self.config, candidates if self.spec.is_moe
                                   else candidates[:1])
