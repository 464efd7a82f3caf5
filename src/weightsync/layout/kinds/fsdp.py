"""``fsdp``: FSDP2 ``fully_shard`` (``Shard(0)``), optionally 2-D with DTensor TP.

Local names are the Hugging Face names. With ``tp=1`` every parameter is cut into ``dp``
``torch.chunk``-style row chunks (trailing ranks may hold fewer rows, or none). With
``tp>1`` the TP plan is the usual one for Llama-like models (torchtitan's): q/k/v, gate/up,
lm_head and per-expert gate/up column-wise (``Shard(0)``); o, down and per-expert down
row-wise (``Shard(1)``); the embedding row-wise over the vocabulary (``Shard(0)``); norms and
the router replicated. FSDP then shards dim 0 of each TP-local tensor, which for
``Shard(0)`` parameters is DTensor's ``_StridedShard(0, split_factor=tp)``: rank ``(d, t)``
holds chunk ``d`` of chunk ``t``. Either way each rank holds one box per parameter.
Mesh order is ``(dp, tp)``: global rank ``= d * tp + t``.
"""

from __future__ import annotations

import dataclasses

from weightsync.layout.box import Box, chunk_bounds
from weightsync.layout.kinds.base import LayoutKind, register_kind
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import CanonicalTensor, Shard, box_region, expert_name, is_expert_stack

#: TP placement per role: the dim TP shards, or None for replicated.
TP_DIM: dict[str, int | None] = {
    "embed": 0, "lm_head": 0, "final_norm": None,
    "input_norm": None, "post_attn_norm": None, "q_norm": None, "k_norm": None, "router": None,
    "q": 0, "k": 0, "v": 0, "q_bias": 0, "k_bias": 0, "v_bias": 0, "gate": 0, "up": 0,
    "o": 1, "down": 1,
    "expert_gate": 0, "expert_up": 0, "expert_down": 1,  # dims of each per-expert tensor
}


def dtensor_box(
    shape: tuple[int, ...], *, tp_dim: int | None, tp: int, t: int, dp: int, d: int
) -> Box:
    """The box rank ``(d, t)`` holds: TP chunk ``t`` along ``tp_dim``, then FSDP row chunk ``d``."""
    offs = [0] * len(shape)
    sizes = list(shape)
    if tp_dim is not None and tp > 1:
        lo, hi = chunk_bounds(shape[tp_dim], tp)[t]
        offs[tp_dim], sizes[tp_dim] = lo, hi - lo
    if shape:
        lo, hi = chunk_bounds(sizes[0], dp)[d]
        offs[0], sizes[0] = offs[0] + lo, hi - lo
    return Box(tuple(offs), tuple(sizes))


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDPLayout(LayoutKind):
    """``fsdp:dp=N[,tp=M]``: FSDP2 row chunks, optionally over TP shards (2-D)."""

    kind = "fsdp"
    dp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def validate(self, spec: ModelSpec) -> None:
        if self.tp > 1:
            for what, n in (("num_attention_heads", spec.num_heads),
                            ("num_key_value_heads", spec.num_kv_heads)):
                if n % self.tp:
                    raise ValueError(f"fsdp: {what}={n} is not divisible by tp={self.tp}")

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        d, t = divmod(rank, self.tp)
        roles = spec.roles()
        out: list[Shard] = []
        for tensor in spec.canonical_tensors().values():
            role = roles[tensor.name][0]
            dtype = self.local_dtype(tensor)
            tp_dim = TP_DIM[role]
            if is_expert_stack(tensor.name):
                out.extend(self._expert_shards(tensor, tp_dim, d, t, dtype))
                continue
            box = dtensor_box(tensor.shape, tp_dim=tp_dim, tp=self.tp, t=t, dp=self.dp, d=d)
            regions = (box_region(tensor.name, box, box.sizes),) if not box.empty else ()
            out.append(Shard(tensor.name, box.sizes, dtype, regions))
        return out

    def _expert_shards(
        self, tensor: CanonicalTensor, tp_dim: int | None, d: int, t: int, dtype: str
    ) -> list[Shard]:
        out = []
        for e in range(tensor.shape[0]):
            local = dtensor_box(tensor.shape[1:], tp_dim=tp_dim, tp=self.tp, t=t, dp=self.dp, d=d)
            box = Box((e, *local.offsets), (1, *local.sizes))
            regions = () if box.empty else (box_region(tensor.name, box, local.sizes, drop_leading=1),)
            out.append(Shard(expert_name(tensor.name, e), local.sizes, dtype, regions))
        return out

