"""``vllm``: vLLM model runners under TP, DP and EP, ``replicas`` independent engines.

Global rank ``= replica * dp * tp + d * tp + t``. Parameter names and fusions follow vLLM's
model code:

* ``qkv_proj`` = ``[q_t; k_t; v_t]``; with fewer KV heads than ``tp`` each KV head is
  replicated over ``tp // num_key_value_heads`` consecutive ranks;
* ``gate_up_proj`` = ``[gate_t; up_t]``; ``o_proj`` and ``down_proj`` split column-wise;
* ``embed_tokens`` / ``lm_head`` pad the vocabulary to a multiple of 64 and split the
  padded rows evenly (padding maps to nothing); tied embeddings have no ``lm_head``;
* MoE experts are stacked per rank: ``experts.w13_weight [E_local, 2*I/etp, H]`` holding
  ``[gate; up]`` along dim 1, ``experts.w2_weight [E_local, H, I/etp]``.

Expert parallelism is modelled as vLLM runs it (``enable_expert_parallel``, vLLM 0.32
``FusedMoEParallelConfig``): the EP group is every TP rank of every DP rank, ``ep = tp * dp``,
each expert whole on one rank (expert TP 1), rank ``d * tp + t`` holding experts
``[i*E/ep, (i+1)*E/ep)``. Without EP (``ep=1``) every rank holds every expert, its
intermediate dimension split over ``tp`` (and replicated over ``dp``). Other values of ``ep``
describe nothing vLLM can run and are refused. Data-parallel ranks (``dp``) otherwise hold
the same attention and dense weights (each DP rank a full TP group of them).
"""

from __future__ import annotations

import dataclasses

from weightsync.layout.box import Box, even_bounds
from weightsync.layout.builders import (
    Part,
    concat_shard,
    kv_head_range,
    padded_size,
    replicated,
    rows,
    split,
    vocab_parallel,
)
from weightsync.layout.kinds.base import LayoutKind, register_kind
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import Shard

VOCAB_PADDING = 64

#: vLLM's prefix of the MoE block, per family (the HF module name).
_MOE_PREFIX = {"mixtral": "block_sparse_moe"}


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMLayout(LayoutKind):
    """``vllm:tp=N[,dp=D][,ep=1|N*D][,replicas=R]``."""

    kind = "vllm"
    tp: int = 1
    dp: int = 1
    ep: int = 1
    replicas: int = 1
    supports_quant = True

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.replicas

    @property
    def expert_tp(self) -> int:
        """Ranks each expert is split over: ``tp`` without EP, 1 with it (vLLM's FusedMoE)."""
        return 1 if self.ep > 1 else self.tp

    def validate(self, spec: ModelSpec) -> None:
        if spec.num_heads % self.tp:
            raise ValueError(f"vllm: num_attention_heads={spec.num_heads} is not divisible by tp={self.tp}")
        kv_head_range(spec.num_kv_heads, self.tp, 0)
        if spec.intermediate_size % self.tp and not spec.is_moe:
            raise ValueError(f"vllm: intermediate_size={spec.intermediate_size} is not divisible by tp={self.tp}")
        if padded_size(spec.vocab_size, VOCAB_PADDING) % self.tp:
            raise ValueError(
                f"vllm: vocabulary padded to {padded_size(spec.vocab_size, VOCAB_PADDING)} rows "
                f"is not divisible by tp={self.tp}"
            )
        if self.ep not in (1, self.tp * self.dp):
            raise ValueError(f"vllm: ep={self.ep} is not a parallelism vLLM runs: with expert parallelism its EP "
                             f"group is every TP rank of every DP rank (ep = tp x dp = {self.tp * self.dp}, each "
                             "expert whole on one rank); use ep=1 (experts split over tp) or "
                             f"ep={self.tp * self.dp}")
        if spec.is_moe:
            if spec.num_experts % self.ep:
                raise ValueError(f"vllm: num_experts={spec.num_experts} is not divisible by ep={self.ep}")
            if spec.moe_intermediate_size % self.expert_tp:
                raise ValueError(
                    f"vllm: moe_intermediate_size={spec.moe_intermediate_size} is not divisible "
                    f"by tp={self.expert_tp}"
                )
        elif self.ep > 1:
            raise ValueError(f"vllm: ep={self.ep} needs an MoE model, {spec.family} has no experts")

    def shard_key(self, rank: int) -> int:
        # Experts differ across DP ranks only with EP; everything else repeats every tp ranks.
        return rank % (self.tp * self.dp) if self.ep > 1 else rank % self.tp

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        self.validate(spec)
        t = rank % self.tp
        ep_rank = rank % (self.tp * self.dp) if self.ep > 1 else 0
        padded = padded_size(spec.vocab_size, VOCAB_PADDING)
        embed = spec.tensor("embed")
        out = [vocab_parallel(embed, "model.embed_tokens.weight", tp=self.tp, rank=t,
                              padded_rows=padded, dtype=self.local_dtype(embed))]
        for layer in range(spec.num_layers):
            out.extend(self._layer(spec, layer, t, ep_rank))
        norm = spec.tensor("final_norm")
        out.append(replicated(norm, "model.norm.weight", self.local_dtype(norm)))
        if not spec.tie_word_embeddings:
            head = spec.tensor("lm_head")
            out.append(vocab_parallel(head, "lm_head.weight", tp=self.tp, rank=t,
                                      padded_rows=padded, dtype=self.local_dtype(head)))
        return out

    def _layer(self, spec: ModelSpec, layer: int, t: int, ep_rank: int) -> list[Shard]:
        prefix = f"model.layers.{layer}."
        tensor = lambda role: spec.tensor(role, layer)  # noqa: E731
        dtype = self.local_dtype(tensor("q"))
        roles = spec.layer_roles(layer)
        out = [replicated(tensor(r), spec.name(r, layer), dtype)
               for r in ("input_norm", "post_attn_norm", "q_norm", "k_norm") if r in roles]
        out.append(concat_shard(prefix + "self_attn.qkv_proj.weight", dtype, self._qkv(spec, layer, t, "")))
        if spec.attention_bias:
            out.append(concat_shard(prefix + "self_attn.qkv_proj.bias", dtype, self._qkv(spec, layer, t, "_bias")))
        out.append(split(tensor("o"), prefix + "self_attn.o_proj.weight", dim=1, parts=self.tp, index=t, dtype=dtype))
        if spec.is_moe_layer(layer):
            out.extend(self._experts(spec, layer, t, ep_rank, dtype))
        else:
            gate, up = tensor("gate"), tensor("up")
            lo, hi = even_bounds(gate.shape[0], self.tp, what="intermediate_size")[t]
            out.append(concat_shard(prefix + "mlp.gate_up_proj.weight", dtype,
                                    [(gate, rows(gate, lo, hi)), (up, rows(up, lo, hi))]))
            out.append(split(tensor("down"), prefix + "mlp.down_proj.weight", dim=1, parts=self.tp,
                             index=t, dtype=dtype))
        return out

    def _qkv(self, spec: ModelSpec, layer: int, t: int, suffix: str) -> list[Part]:
        q = spec.tensor("q" + suffix, layer)
        k = spec.tensor("k" + suffix, layer)
        v = spec.tensor("v" + suffix, layer)
        hd = spec.head_dim
        q_lo, q_hi = even_bounds(spec.num_heads, self.tp, what="num_attention_heads")[t]
        kv_lo, kv_hi = kv_head_range(spec.num_kv_heads, self.tp, t)
        return [(q, rows(q, q_lo * hd, q_hi * hd)), (k, rows(k, kv_lo * hd, kv_hi * hd)),
                (v, rows(v, kv_lo * hd, kv_hi * hd))]

    def _experts(self, spec: ModelSpec, layer: int, t: int, ep_rank: int, dtype: str) -> list[Shard]:
        prefix = f"model.layers.{layer}.{_MOE_PREFIX.get(spec.family, 'mlp')}."
        etp = self.expert_tp
        group, e_rank = (ep_rank, 0) if self.ep > 1 else (0, t)
        per = spec.num_experts // self.ep
        e0, e1 = group * per, (group + 1) * per
        lo, hi = even_bounds(spec.moe_intermediate_size, etp, what="moe_intermediate_size")[e_rank]
        h = spec.hidden_size
        gate = spec.tensor("expert_gate", layer)
        up = spec.tensor("expert_up", layer)
        down = spec.tensor("expert_down", layer)
        return [
            replicated(spec.tensor("router", layer), prefix + "gate.weight", dtype),
            concat_shard(prefix + "experts.w13_weight", dtype,
                         [(gate, Box((e0, lo, 0), (e1 - e0, hi - lo, h))),
                          (up, Box((e0, lo, 0), (e1 - e0, hi - lo, h)))], dim=1),
            concat_shard(prefix + "experts.w2_weight", dtype,
                         [(down, Box((e0, 0, lo), (e1 - e0, h, hi - lo)))], dim=2),
        ]
