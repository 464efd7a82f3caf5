"""``megatron``: Megatron-core GPT models under TP, PP, DP, EP (and expert TP).

Rank order is Megatron's default (``tp`` fastest, then ``dp``, then ``pp``):
``rank = t + tp * (d + dp * p)``. Within a pipeline stage, the ``tp * dp`` ranks are
regrouped for experts as ``(etp, ep, edp)`` with ``etp`` fastest, so ``ep * etp`` must divide
``tp * dp``. ``etp`` defaults to ``tp``, as in Megatron-core (``initialize_model_parallel``:
``expert_tensor_parallel_size=None`` means ``tensor_model_parallel_size``); the usual MoE
setting, experts whole on each rank, is ``etp=1``, written out.

Fused tensors, as Megatron lays them out:

* ``linear_qkv``: per query group ``g`` the rows ``[q heads of g; k_g; v_g]``; TP splits
  whole groups, so ``num_key_value_heads`` must be divisible by ``tp``;
* ``linear_fc1`` (SwiGLU, ``partition_stride`` 2): TP rank ``r`` holds ``[gate_r; up_r]``;
* the vocabulary is padded to a multiple of ``vocab_multiple * tp`` (Megatron's
  ``make_vocab_size_divisible_by``), padding rows mapping to nothing;
* layers are spread over stages as evenly as possible (earlier stages take the remainder)
  and numbered locally from 0 on each stage; the embedding lives on the first stage, the
  final norm and ``output_layer`` on the last (with tied embeddings and ``pp > 1`` the last
  stage's ``output_layer`` is a second copy of the embedding).

``grouped=1`` names experts like ``TEGroupedMLP`` (``experts.linear_fc1.weight{i}``) instead
of ``SequentialMLP`` (``experts.local_experts.{i}.linear_fc1.weight``).
"""

from __future__ import annotations

import dataclasses

from weightsync.layout.box import Box, even_bounds
from weightsync.layout.builders import (
    Part,
    concat_shard,
    padded_size,
    replicated,
    rows,
    split,
    vocab_parallel,
)
from weightsync.layout.kinds.base import LayoutKind, register_kind
from weightsync.layout.kinds.pieces import Piece
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import Shard

#: Megatron local name of each role that is a plain (unfused) parameter.
_PLAIN_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "pre_mlp_layernorm.weight",
    "q_norm": "self_attention.q_layernorm.weight",
    "k_norm": "self_attention.k_layernorm.weight",
    "router": "mlp.router.weight",
}


#: The families whose Megatron-core parameters the tables below name (Llama-style attention and MLPs).
_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"})


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global layer numbers on ``stage``: as even as possible, remainder to early stages."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronLayout(LayoutKind):
    """``megatron:tp=,pp=,dp=[,ep=,etp=,vocab_multiple=,grouped=]``."""

    kind = "megatron"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 0
    vocab_multiple: int = 128
    grouped: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp  # Megatron-core's default (see module docstring)

    def validate(self, spec: ModelSpec) -> None:
        if spec.family not in _FAMILIES:
            raise ValueError(f"megatron: the {spec.family} family's Megatron-core names are not modelled (its "
                             f"latent attention, shared experts or MTP layers); modelled: {sorted(_FAMILIES)}")
        if spec.num_kv_heads % self.tp:
            raise ValueError(
                f"megatron: num_key_value_heads={spec.num_kv_heads} (query groups) is not "
                f"divisible by tp={self.tp}"
            )
        if spec.num_heads % self.tp:
            raise ValueError(f"megatron: num_attention_heads={spec.num_heads} is not divisible by tp={self.tp}")
        if spec.intermediate_size % self.tp:
            raise ValueError(f"megatron: intermediate_size={spec.intermediate_size} is not divisible by tp={self.tp}")
        if self.pp > spec.num_layers:
            raise ValueError(f"megatron: pp={self.pp} exceeds num_hidden_layers={spec.num_layers}")
        if spec.is_moe:
            if spec.num_experts % self.ep:
                raise ValueError(f"megatron: num_experts={spec.num_experts} is not divisible by ep={self.ep}")
            if (self.tp * self.dp) % (self.ep * self.expert_tp):
                raise ValueError(
                    f"megatron: ep={self.ep} x etp={self.expert_tp} must divide tp x dp = "
                    f"{self.tp * self.dp} (experts are placed on the tp x dp ranks of each stage)"
                )
            if spec.moe_intermediate_size % self.expert_tp:
                raise ValueError(
                    f"megatron: moe_intermediate_size={spec.moe_intermediate_size} is not "
                    f"divisible by etp={self.expert_tp}"
                )
        elif self.ep > 1:
            raise ValueError(f"megatron: ep={self.ep} needs an MoE model, {spec.family} has no experts")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp rank, dp rank, pp stage) of a global rank."""
        t = rank % self.tp
        d = (rank // self.tp) % self.dp
        p = rank // (self.tp * self.dp)
        return t, d, p

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        self.validate(spec)
        return self.piece_shards(spec, rank)

    def pieces(self, spec: ModelSpec, rank: int) -> list[Piece]:
        """The embedding (first stage), each layer's dense part and experts, the head (last stage)."""
        t, d, p = self.coords(rank)
        out = [Piece("embed", (t,))] if p == 0 else []
        i = t + self.tp * d  # index among the tp x dp ranks of this stage
        e_rank, ep_rank = i % self.expert_tp, (i // self.expert_tp) % self.ep
        for local, layer in enumerate(stage_layers(spec.num_layers, self.pp, p)):
            prefix = f"decoder.layers.{local}."
            out.append(Piece("dense", (t,), layer, prefix))
            if spec.is_moe_layer(layer):
                out.append(Piece("experts", (ep_rank, e_rank), layer, prefix))
        if p == self.pp - 1:
            out.append(Piece("head", (t,)))
        return out

    def build_piece(self, spec: ModelSpec, piece: Piece) -> list[Shard]:
        what, args, layer = piece.what, piece.args, piece.layer
        padded = padded_size(spec.vocab_size, self.vocab_multiple * self.tp)
        if what == "embed":
            embed = spec.tensor("embed")
            return [vocab_parallel(embed, "embedding.word_embeddings.weight", tp=self.tp, rank=args[0],
                                   padded_rows=padded, dtype=self.local_dtype(embed))]
        if what == "dense":
            assert layer is not None
            return self._layer(spec, layer, piece.prefix, args[0])
        if what == "experts":
            assert layer is not None
            return self._experts(spec, layer, piece.prefix, args[0], args[1])
        norm = spec.tensor("final_norm")
        out = [replicated(norm, "decoder.final_layernorm.weight", self.local_dtype(norm))]
        if not spec.tie_word_embeddings or self.pp > 1:
            head = spec.tensor("lm_head")  # resolves to the embedding when tied
            out.append(vocab_parallel(head, "output_layer.weight", tp=self.tp, rank=args[0],
                                      padded_rows=padded, dtype=self.local_dtype(head)))
        return out

    def _layer(self, spec: ModelSpec, layer: int, prefix: str, t: int) -> list[Shard]:
        """The non-expert parameters of one layer on TP rank ``t``."""
        roles = spec.layer_roles(layer)
        tensor = lambda role: spec.tensor(role, layer)  # noqa: E731
        dtype = self.local_dtype(tensor("q"))
        out: list[Shard] = []
        for role in roles:
            if role in _PLAIN_NAMES:
                out.append(replicated(tensor(role), prefix + _PLAIN_NAMES[role], dtype))
        out.append(concat_shard(prefix + "self_attention.linear_qkv.weight", dtype,
                                self._qkv_parts(spec, layer, t, "")))
        if spec.attention_bias:
            out.append(concat_shard(prefix + "self_attention.linear_qkv.bias", dtype,
                                    self._qkv_parts(spec, layer, t, "_bias")))
        out.append(split(tensor("o"), prefix + "self_attention.linear_proj.weight",
                         dim=1, parts=self.tp, index=t, dtype=dtype))
        if not spec.is_moe_layer(layer):
            gate, up = tensor("gate"), tensor("up")
            lo, hi = even_bounds(gate.shape[0], self.tp, what="intermediate_size")[t]
            out.append(concat_shard(prefix + "mlp.linear_fc1.weight", dtype,
                                    [(gate, rows(gate, lo, hi)), (up, rows(up, lo, hi))]))
            out.append(split(tensor("down"), prefix + "mlp.linear_fc2.weight",
                             dim=1, parts=self.tp, index=t, dtype=dtype))
        return out

    def _qkv_parts(self, spec: ModelSpec, layer: int, t: int, suffix: str) -> list[Part]:
        q = spec.tensor("q" + suffix, layer)
        k = spec.tensor("k" + suffix, layer)
        v = spec.tensor("v" + suffix, layer)
        hd = spec.head_dim
        per_group = spec.num_heads // spec.num_kv_heads
        groups = spec.num_kv_heads // self.tp
        parts: list[Part] = []
        for g in range(t * groups, (t + 1) * groups):
            parts.append((q, rows(q, g * per_group * hd, (g + 1) * per_group * hd)))
            parts.append((k, rows(k, g * hd, (g + 1) * hd)))
            parts.append((v, rows(v, g * hd, (g + 1) * hd)))
        return parts

    def _experts(self, spec: ModelSpec, layer: int, prefix: str, ep_rank: int, e_rank: int) -> list[Shard]:
        """The local experts of EP rank ``ep_rank``, expert-TP rank ``e_rank``."""
        gate = spec.tensor("expert_gate", layer)
        up = spec.tensor("expert_up", layer)
        down = spec.tensor("expert_down", layer)
        etp = self.expert_tp
        dtype = self.local_dtype(gate)
        local_experts = spec.num_experts // self.ep
        inter = spec.moe_intermediate_size
        lo, hi = even_bounds(inter, etp, what="moe_intermediate_size")[e_rank]
        h = spec.hidden_size
        out: list[Shard] = []
        for local in range(local_experts):
            e = ep_rank * local_experts + local
            fc1_parts: list[Part] = [
                (gate, Box((e, lo, 0), (1, hi - lo, h))),
                (up, Box((e, lo, 0), (1, hi - lo, h))),
            ]
            fc2_part: list[Part] = [(down, Box((e, 0, lo), (1, h, hi - lo)))]
            if self.grouped:
                fc1_name = f"{prefix}mlp.experts.linear_fc1.weight{local}"
                fc2_name = f"{prefix}mlp.experts.linear_fc2.weight{local}"
            else:
                fc1_name = f"{prefix}mlp.experts.local_experts.{local}.linear_fc1.weight"
                fc2_name = f"{prefix}mlp.experts.local_experts.{local}.linear_fc2.weight"
            out.append(concat_shard(fc1_name, dtype, fc1_parts, dim=0, drop_leading=1))
            out.append(concat_shard(fc2_name, dtype, fc2_part, dim=1, drop_leading=1))
        return out
