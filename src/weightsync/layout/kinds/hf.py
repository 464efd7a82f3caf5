"""``hf``: whole Hugging Face models, one per rank (``replicas=`` copies).

Local names are the checkpoint names; MoE experts are separate per-expert tensors
(``...experts.3.gate_proj.weight``), each holding one slice of the canonical expert stack.
"""

from __future__ import annotations

import dataclasses

from weightsync.layout.box import Box
from weightsync.layout.families import FLOAT32_ROLES
from weightsync.layout.kinds.base import LayoutKind, register_kind
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import CanonicalTensor, Shard, box_region, expert_name, is_expert_stack


def expert_slices(tensor: CanonicalTensor, dtype: str, experts: range | None = None) -> list[Shard]:
    """One local ``[...]`` tensor per expert of a stack, named with the HF expert name."""
    out = []
    local_shape = tensor.shape[1:]
    for e in experts if experts is not None else range(tensor.shape[0]):
        box = Box((e,) + (0,) * len(local_shape), (1, *local_shape))
        region = box_region(tensor.name, box, local_shape, drop_leading=1)
        out.append(Shard(expert_name(tensor.name, e), local_shape, dtype, (region,)))
    return out


def whole_model_shards(spec: ModelSpec, dtype: str | None) -> list[Shard]:
    """Every canonical tensor as a whole local tensor under its checkpoint name, in ``dtype``
    (default: the checkpoint's), but for the tensors every holder keeps in float32 whatever the
    model's dtype (:data:`FLOAT32_ROLES`: vLLM creates DeepSeek-V3's router correction bias in
    float32, transformers keeps it so): staged in a bf16 engine's dtype, it was rounded on
    every sync, and the engine routed with biases a fresh engine does not have."""
    shards: list[Shard] = []
    roles = spec.roles()
    for tensor in spec.canonical_tensors().values():
        local_dtype = tensor.dtype if roles[tensor.name][0] in FLOAT32_ROLES else dtype or tensor.dtype
        if is_expert_stack(tensor.name):
            shards.extend(expert_slices(tensor, local_dtype))
        else:
            box = Box.full(tensor.shape)
            shards.append(Shard(tensor.name, tensor.shape, local_dtype,
                                (box_region(tensor.name, box, tensor.shape),)))
    return shards


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class HFLayout(LayoutKind):
    """``hf[:replicas=N]``: each rank holds the whole model under checkpoint names."""

    kind = "hf"
    replicas: int = 1
    supports_quant = True

    @property
    def world_size(self) -> int:
        return self.replicas

    def shard_key(self, rank: int) -> int:
        return 0

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        return whole_model_shards(spec, self.dtype)
