"""``deepspeed``: ZeRO-3 flat partitions (``param.ds_tensor``).

ZeRO-3 partitions every parameter on its own: the flattened parameter is cut into
``dp`` runs of ``ceil(numel / dp)`` elements (the last run zero-padded), and rank ``r``
keeps run ``r`` as a 1-D ``ds_tensor``. Each run becomes up to ``2 * ndim - 1`` boxes of the
canonical tensor (see :func:`flat_range_regions`). Local names are Hugging Face names
(per-expert for MoE).
"""

from __future__ import annotations

import dataclasses

from weightsync.layout.box import Box
from weightsync.layout.builders import flat_partition
from weightsync.layout.kinds.base import LayoutKind, register_kind
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import (
    Shard,
    expert_name,
    flat_range_regions,
    is_expert_stack,
)


def expert_flat_partitions(tensor_name: str, shape: tuple[int, ...], dtype: str, *,
                           world: int, rank: int) -> list[Shard]:
    """ZeRO-3 runs of each per-expert tensor of an expert stack."""
    out = []
    per_expert = shape[1:]
    numel = 1
    for s in per_expert:
        numel *= s
    per = -(-numel // world)
    lo = min(rank * per, numel)
    hi = min(lo + per, numel)
    for e in range(shape[0]):
        regions = []
        for region in flat_range_regions((tensor_name, per_expert), lo, hi):
            box = Box((e, *region.box.offsets), (1, *region.box.sizes))
            regions.append(dataclasses.replace(region, box=box, strides=(0, *region.strides)))
        out.append(Shard(expert_name(tensor_name, e), (per,), dtype, tuple(regions)))
    return out


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedLayout(LayoutKind):
    """``deepspeed:dp=N``: ZeRO-3, each parameter flattened and split into ``dp`` runs."""

    kind = "deepspeed"
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        out: list[Shard] = []
        for tensor in spec.canonical_tensors().values():
            dtype = self.local_dtype(tensor)
            if is_expert_stack(tensor.name):
                out.extend(expert_flat_partitions(tensor.name, tensor.shape, dtype,
                                                  world=self.dp, rank=rank))
            else:
                out.append(flat_partition(tensor, tensor.name, world=self.dp, rank=rank, dtype=dtype))
        return out
