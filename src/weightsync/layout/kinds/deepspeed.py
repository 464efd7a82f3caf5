"""``deepspeed``: ZeRO-3 flat partitions (``param.ds_tensor``).

ZeRO-3 partitions every parameter on its own: the flattened parameter is cut into
``dp`` runs of ``ceil(numel / dp)`` elements (the last run padded), and rank ``r`` keeps run
``r`` as a 1-D ``ds_tensor``. Each run becomes up to ``2 * ndim - 1`` boxes of the parameter
(see :func:`flat_range_regions`), cut again where a fused parameter changes canonical
tensor. Local names are the transformers parameter names: by default transformers >= 5's, one
``experts.gate_up_proj``/``experts.down_proj`` per MoE layer; ``per_expert=1`` gives one
parameter per expert matrix (transformers 4).
"""

from __future__ import annotations

import dataclasses
import math

from weightsync.layout.box import Box
from weightsync.layout.families import BUFFER_ROLES
from weightsync.layout.kinds.base import LayoutKind, register_kind
from weightsync.layout.model import ModelSpec
from weightsync.layout.params import hf_params
from weightsync.layout.types import Shard


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedLayout(LayoutKind):
    """``deepspeed:dp=N[,per_expert=1]``: ZeRO-3, each parameter flattened and split into ``dp`` runs."""

    kind = "deepspeed"
    dp: int = 1
    per_expert: int = 0

    @property
    def world_size(self) -> int:
        return self.dp

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        dtype = self.dtype or spec.dtype
        out: list[Shard] = []
        for name, param in hf_params(spec, fused=not self.per_expert).items():
            if param.role in BUFFER_ROLES:  # a buffer: ZeRO-3 leaves it whole, in its own dtype
                tensor = spec.canonical_tensors()[param.parts[0][0]]
                out.append(Shard(name, param.shape, tensor.dtype,
                                 tuple(param.box_regions(Box.full(param.shape), param.shape))))
                continue
            numel = math.prod(param.shape)
            per = -(-numel // self.dp)
            lo = min(rank * per, numel)
            hi = min(lo + per, numel)
            out.append(Shard(name, (per,), dtype, tuple(param.flat_regions(lo, hi))))
        return out
