"""``fsdp``: FSDP2 ``fully_shard`` (``Shard(0)``), optionally 2-D with DTensor TP.

Local names are the transformers parameter names: by default those of transformers >= 5,
whose MoE layers keep their experts fused (``experts.gate_up_proj``/``experts.down_proj``);
``per_expert=1`` gives one parameter per expert matrix, as in transformers 4. With ``tp=1`` every parameter is cut
into ``dp`` ``torch.chunk``-style chunks of dim 0 (trailing ranks may hold fewer rows, or
none). With ``tp>1`` the TP plan is the usual one for Llama-like models (torchtitan's):
q/k/v, gate/up, lm_head and per-expert gate/up column-wise (``Shard(0)``); o, down and
per-expert down row-wise (``Shard(1)``); the embedding row-wise over the vocabulary
(``Shard(0)``); norms and the router replicated; fused experts as transformers shards them
(``gate_up_proj`` packed column-wise, ``_StridedShard(1, split_factor=2)``: ``[gate_t; up_t]``;
``down_proj`` ``Shard(2)``). FSDP then chunks dim 0 of each TP-local tensor, which for
``Shard(0)`` parameters is DTensor's ``_StridedShard(0, split_factor=tp)``: rank ``(d, t)``
holds chunk ``d`` of chunk ``t``. Mesh order is ``(dp, tp)``: global rank ``= d * tp + t``.
"""

from __future__ import annotations

import dataclasses

from weightsync.layout.box import Box
from weightsync.layout.families import BUFFER_ROLES
from weightsync.layout.kinds.base import LayoutKind, register_kind
from weightsync.layout.model import ModelSpec
from weightsync.layout.params import Runs, chunk_runs, hf_params, run_boxes, runs_length, strided_runs
from weightsync.layout.types import Shard

#: TP placement per role: (dim, split factor) or None for replicated. A split factor of 2
#: is a packed ``[gate; up]`` parameter (``_StridedShard``); per-expert roles are the dims
#: of each per-expert matrix.
TP_PLAN: dict[str, tuple[int, int] | None] = {
    "embed": (0, 1), "lm_head": (0, 1), "final_norm": None,
    "input_norm": None, "post_attn_norm": None, "q_norm": None, "k_norm": None, "router": None,
    "q": (0, 1), "k": (0, 1), "v": (0, 1), "q_bias": (0, 1), "k_bias": (0, 1), "v_bias": (0, 1),
    "gate": (0, 1), "up": (0, 1), "o": (1, 1), "down": (1, 1),
    "expert_gate": (0, 1), "expert_up": (0, 1), "expert_down": (1, 1),
    "experts_gate_up": (1, 2), "experts_down": (2, 1),
}


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDPLayout(LayoutKind):
    """``fsdp:dp=N[,tp=M][,per_expert=1]``: FSDP2 row chunks, optionally over TP shards (2-D)."""

    kind = "fsdp"
    dp: int = 1
    tp: int = 1
    per_expert: int = 0

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def validate(self, spec: ModelSpec) -> None:
        if self.tp > 1:
            roles = {p.role for p in hf_params(spec, fused=not self.per_expert).values()}
            unplanned = sorted(roles - set(TP_PLAN) - BUFFER_ROLES)
            if unplanned:
                raise ValueError(f"fsdp: tp={self.tp} is modelled for Llama-style attention and MLPs; the "
                                 f"{spec.family} model has {unplanned[:4]}, which no TP plan here places (use tp=1)")
            for what, n in (("num_attention_heads", spec.num_heads),
                            ("num_key_value_heads", spec.num_kv_heads)):
                if n % self.tp:
                    raise ValueError(f"fsdp: {what}={n} is not divisible by tp={self.tp}")

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        d, t = divmod(rank, self.tp)
        dtype = self.dtype or spec.dtype
        out: list[Shard] = []
        for name, param in hf_params(spec, fused=not self.per_expert).items():
            runs: list[Runs] = [((0, n),) for n in param.shape]
            if param.role in BUFFER_ROLES:  # a buffer: FSDP2 leaves it whole, in its own dtype
                out.append(Shard(name, param.shape, spec.canonical_tensors()[param.parts[0][0]].dtype,
                                 tuple(param.box_regions(Box.full(param.shape), param.shape))))
                continue
            plan = TP_PLAN[param.role] if self.tp > 1 else None
            if plan is not None:
                dim, split = plan
                runs[dim] = strided_runs(runs[dim], self.tp, t, split)
            if runs:
                runs[0] = chunk_runs(runs[0], self.dp, d)
            local_shape = tuple(runs_length(r) for r in runs)
            regions = [region for local, box in run_boxes(runs)
                       for region in param.box_regions(box, local_shape, local.offsets)]
            out.append(Shard(name, local_shape, dtype, tuple(regions)))
        return out
