"""``vllm``: vLLM model runners under TP, DP and EP, ``replicas`` independent engines.

Global rank ``= replica * dp * tp + d * tp + t``. Where vLLM is installed,
``weightsync.engines.vllm_layout.install()`` makes this kind ask vLLM itself: a dry run of its
own weight loaders on the meta device records every rank's parameters (``use_recorder``).
The tables below are for where it is not (planning on a laptop); a test checks that they
equal the recording for every family and TP size on vLLM 0.32's CPU build. They follow
vLLM 0.32's model code:

* ``qkv_proj`` = ``[q_t; k_t; v_t]``; with fewer KV heads than ``tp`` each KV head is
  replicated over ``tp // num_key_value_heads`` consecutive ranks;
* ``gate_up_proj`` = ``[gate_t; up_t]`` (shared experts too); ``o_proj``, ``down_proj`` split
  column-wise;
* latent attention (DeepSeek-V3): ``fused_qkv_a_proj`` = ``[q_a; kv_a]`` whole on every rank,
  ``q_b_proj``/``kv_b_proj`` (or ``q_proj``) split by heads, ``o_proj`` column-wise;
* gpt-oss: its attention is ``attn`` and its embedding ``embedding``; ``o_proj.bias`` whole
  on every rank, ``sinks`` split by heads;
* ``embed_tokens`` / ``lm_head`` pad the vocabulary to a multiple of 64 and split the
  padded rows evenly (padding maps to nothing); tied embeddings have no ``lm_head``;
* MoE experts are stacked per rank under ``experts.routed_experts``: ``w13_weight
  [E_local, 2*I_local, H]`` holding ``[gate; up]`` along dim 1, ``w2_weight [E_local, H,
  I_local]``; gpt-oss's keep its interleaved ``gate_up_proj`` columns, and its ``w2_bias`` is
  loaded on the first expert-TP rank only (zeros elsewhere, which map to nothing);
* ``eplb=FILE`` or ``redundant=R``: vLLM's expert-parallel load balancer (EPLB) places logical
  experts on ``E + R`` physical slots per layer, ``(E + R) / ep`` per EP rank, by a placement
  read from the engine (``weightsync.layout.eplb``; ``redundant=R`` alone: vLLM's initial one).
  Each rank's ``w13_weight``/``w2_weight`` then hold its slots, slot by slot the logical
  expert the placement names (a hot expert on several slots of one rank is received once and
  copied locally by the planner);
* ``mtp=1``: the engine runs MTP speculative decoding, its drafter holds the MTP layers
  (``model.layers.{N}.enorm``, ``eh_proj``, ... and the decoder layer as ``mtp_block``); it
  shares the target's embedding and output head.

Expert parallelism is modelled as vLLM runs it (``enable_expert_parallel``, vLLM 0.32
``FusedMoEParallelConfig``): the EP group is every TP rank of every DP rank, ``ep = tp * dp``,
each expert whole on one rank, rank ``d * tp + t`` holding experts ``[i*E/ep, (i+1)*E/ep)``.
Without EP (``ep=1``) every rank holds every expert, its intermediate dimension split over
all ``tp * dp`` ranks, ``d * tp + t`` holding part ``d * tp + t`` (vLLM flattens TP across DP
for MoE layers). Other values of ``ep`` describe nothing vLLM can run and are refused.
Data-parallel ranks otherwise hold the same attention and dense weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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
from weightsync.layout.eplb import Placement, check_fits, lookup, place_experts, register
from weightsync.layout.kinds.base import LayoutKind, memo, register_kind
from weightsync.layout.kinds.pieces import Piece
from weightsync.layout.model import ModelSpec
from weightsync.layout.quant_block import BLOCK_SCHEMES
from weightsync.layout.roster import Roster
from weightsync.layout.types import RankLayout, Shard, box_region

VOCAB_PADDING = 64

#: vLLM's module names where they differ from the checkpoint's, per family.
_MOE_PREFIX = {"mixtral": "block_sparse_moe"}
_ATTN_PREFIX = {"gpt_oss": "attn"}
_EMBED_NAME = {"gpt_oss": "model.embedding.weight"}
#: Families whose vLLM attention needs tp to divide the KV heads (it does not replicate them).
_NO_KV_REPLICATION = frozenset({"mixtral", "gpt_oss"})

#: (spec, layout, rank) -> shards, set by ``weightsync.engines.vllm_layout.install``.
_RECORDER: dict[str, Callable[[ModelSpec, Any, int], list[Shard]]] = {}


def use_recorder(recorder: Callable[[ModelSpec, Any, int], list[Shard]] | None) -> None:
    """Take every rank's shards from ``recorder`` (vLLM's own loaders), or the tables (None)."""
    from weightsync.layout.kinds.base import _memo_tables

    _RECORDER.pop("vllm", None)
    if recorder is not None:
        _RECORDER["vllm"] = recorder
    _memo_tables.cache_clear()


def recorder_in_use() -> bool:
    """Whether layouts come from vLLM's loaders (else from the tables below)."""
    return "vllm" in _RECORDER


@register_kind
@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMLayout(LayoutKind):
    """``vllm:tp=N[,dp=D][,ep=1|N*D][,replicas=R][,mtp=1][,redundant=R][,eplb=FILE]``."""

    kind = "vllm"
    tp: int = 1
    dp: int = 1
    ep: int = 1
    replicas: int = 1
    mtp: int = 0
    #: redundant expert slots per MoE layer (vLLM's ``eplb_config.num_redundant_experts``)
    redundant: int = 0
    #: the engine's expert placement: a JSON file, or the digest of one registered here
    eplb: str | None = None
    #: every rank's experts as slots [0, L) not placed yet (what _placed_roster places)
    unplaced_slots: bool = dataclasses.field(default=False, init=False, repr=False)
    supports_quant = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eplb is not None:  # the wire and describe() name a placement by its content digest
            object.__setattr__(self, "eplb", register(lookup(self.eplb)))

    @property
    def placed(self) -> bool:
        """Whether experts sit in EPLB slots (a placement, or redundant slots)."""
        return self.eplb is not None or self.redundant > 0 or self.unplaced_slots

    def placement(self, spec: ModelSpec) -> Placement:
        """The expert placement (vLLM's initial one for ``redundant=R`` alone)."""
        if self.eplb is not None:
            return lookup(self.eplb)
        layers = sum(1 for layer in range(spec.num_layers) if spec.is_moe_layer(layer))
        return Placement.initial(spec.num_experts, self.redundant, max(layers, 1))

    def attachments(self) -> tuple[str, ...]:
        return (self.eplb,) if self.eplb is not None else ()

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.replicas

    @property
    def expert_tp(self) -> int:
        """Ranks each expert is split over: ``tp * dp`` without EP, 1 with it (vLLM's FusedMoE)."""
        return 1 if self.ep > 1 else self.tp * self.dp

    def validate(self, spec: ModelSpec) -> None:
        if spec.num_heads % self.tp:
            raise ValueError(f"vllm: num_attention_heads={spec.num_heads} is not divisible by tp={self.tp}")
        if not spec.is_mla:
            kv_head_range(spec.num_kv_heads, self.tp, 0)
            if spec.family in _NO_KV_REPLICATION and spec.num_kv_heads % self.tp:
                raise ValueError(f"vllm: num_key_value_heads={spec.num_kv_heads} is not divisible by tp={self.tp} "
                                 f"(vLLM's {spec.family} does not replicate KV heads)")
        if spec.intermediate_size % self.tp and (spec.dense_layers or not spec.is_moe):
            raise ValueError(f"vllm: intermediate_size={spec.intermediate_size} is not divisible by tp={self.tp}")
        if padded_size(spec.vocab_size, VOCAB_PADDING) % self.tp:
            raise ValueError(
                f"vllm: vocabulary padded to {padded_size(spec.vocab_size, VOCAB_PADDING)} rows "
                f"is not divisible by tp={self.tp}"
            )
        if self.ep not in (1, self.tp * self.dp):
            raise ValueError(f"vllm: ep={self.ep} is not a parallelism vLLM runs: with expert parallelism its EP "
                             f"group is every TP rank of every DP rank (ep = tp x dp = {self.tp * self.dp}, each "
                             "expert whole on one rank); use ep=1 (experts split over tp x dp) or "
                             f"ep={self.tp * self.dp}")
        if self.mtp and not spec.mtp_layers:
            raise ValueError(f"vllm: mtp=1 needs a model with MTP layers (num_nextn_predict_layers > 0); this "
                             f"{spec.family} model has none")
        if self.placed:
            self._validate_placement(spec)
        if spec.is_moe:
            if spec.num_experts % self.ep and not self.placed:
                raise ValueError(f"vllm: num_experts={spec.num_experts} is not divisible by ep={self.ep}")
            if spec.moe_intermediate_size % self.expert_tp:
                raise ValueError(
                    f"vllm: moe_intermediate_size={spec.moe_intermediate_size} is not divisible by the "
                    f"{self.expert_tp} ranks each expert is split over (tp x dp without expert parallelism)"
                )
            if spec.shared_intermediate_size % self.tp:
                raise ValueError(f"vllm: the shared experts' intermediate size {spec.shared_intermediate_size} "
                                 f"is not divisible by tp={self.tp}")
        elif self.ep > 1:
            raise ValueError(f"vllm: ep={self.ep} needs an MoE model, {spec.family} has no experts")

    def _validate_placement(self, spec: ModelSpec) -> None:
        if not spec.is_moe:
            raise ValueError(f"vllm: an expert placement (eplb=, redundant=) needs an MoE model, {spec.family} has "
                             "no experts")
        if self.ep == 1:
            raise ValueError(f"vllm: an expert placement (eplb=, redundant=) needs expert parallelism (vLLM's EPLB "
                             f"requires it): set ep={self.tp * self.dp}")
        placement = self.placement(spec)
        if self.eplb is not None and self.redundant and self.redundant != placement.num_redundant:
            raise ValueError(f"vllm: redundant={self.redundant} but the placement {self.eplb} has "
                             f"{placement.num_redundant} redundant experts per layer (leave redundant= out)")
        check_fits(placement, spec, replicas=self.replicas, ep=self.ep)

    def shard_key(self, rank: int) -> int:
        # Experts differ across DP ranks (whole with EP, cut without); all else repeats every tp ranks.
        # (A placement differs per replica too: placed layouts never share templates, see rank_layout.)
        return rank % (self.tp * self.dp)

    def shards(self, spec: ModelSpec, rank: int) -> list[Shard]:
        self.validate(spec)
        if self.placed:  # vLLM's loaders load its initial placement only: the slots come from the tables
            return list(self._placed_roster(spec, quantized=False).layout(rank).shards)
        if "vllm" in _RECORDER:
            return _RECORDER["vllm"](spec, self, rank)
        return self.piece_shards(spec, rank)

    def rank_layout(self, spec: ModelSpec, rank: int) -> RankLayout:
        if not self.placed:
            return super().rank_layout(spec, rank)
        self.validate(spec)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.describe()}: rank {rank} is outside world size {self.world_size}")
        return self.roster(spec).layout(rank)

    def roster(self, spec: ModelSpec, ranks: Any = None) -> Roster:
        if not self.placed:
            return super().roster(spec, ranks)
        self.validate(spec)
        return self._placed_roster(spec, quantized=bool(self.quant), ranks=ranks)

    def _placed_roster(self, spec: ModelSpec, *, quantized: bool, ranks: Any = None) -> Roster:
        """Ranks ``ranks`` (default: all) with their expert slots placed
        (:func:`weightsync.layout.eplb.place_experts`). The slots before placing are the same
        for every placement with as many slots: each engine replica's readers publish their own
        placement, and only their experts are placed anew when it changes."""
        placement = self.placement(spec)
        key = (quantized, None if ranks is None else tuple(int(r) for r in ranks))
        cache = memo(self, spec, "placed")
        found = cache.get(key)
        if found is None:
            slots = dataclasses.replace(self, quant=self.quant if quantized else None, eplb=None,
                                        redundant=placement.num_redundant)
            object.__setattr__(slots, "unplaced_slots", True)
            unplaced = LayoutKind.roster(slots, spec, ranks)
            found = cache[key] = place_experts(unplaced, spec, placement, group=self.tp * self.dp)
        return found  # type: ignore[no-any-return]

    def pieces(self, spec: ModelSpec, rank: int) -> list[Piece] | None:
        """The embedding, each layer (MTP layers too), the norm and head; None with vLLM's recorder."""
        if "vllm" in _RECORDER and not self.placed:
            return None
        return self._pieces(spec, rank)

    def _pieces(self, spec: ModelSpec, rank: int) -> list[Piece]:
        t = rank % self.tp
        i = rank % (self.tp * self.dp)  # this rank's place in the MoE group (EP or flattened TP)
        out = [Piece("embed", (t,))]
        out += [Piece("layer", (t, i), layer, f"model.layers.{layer}.") for layer in range(spec.num_layers)]
        out.append(Piece("head", (t,)))
        if self.mtp:
            out += [Piece("mtp", (t, i), layer, f"model.layers.{layer}.")
                    for layer in range(spec.num_layers, spec.total_layers)]
        return out

    def build_piece(self, spec: ModelSpec, piece: Piece) -> list[Shard]:
        what, (t, *rest) = piece.what, piece.args
        padded = padded_size(spec.vocab_size, VOCAB_PADDING)
        if what == "embed":
            embed = spec.tensor("embed")
            return [vocab_parallel(embed, _EMBED_NAME.get(spec.family, "model.embed_tokens.weight"), tp=self.tp,
                                   rank=t, padded_rows=padded, dtype=self.local_dtype(embed))]
        if what == "head":
            norm = spec.tensor("final_norm")
            out = [replicated(norm, "model.norm.weight", self.local_dtype(norm))]
            if not spec.tie_word_embeddings:
                head = spec.tensor("lm_head")
                out.append(vocab_parallel(head, "lm_head.weight", tp=self.tp, rank=t,
                                          padded_rows=padded, dtype=self.local_dtype(head)))
            return out
        layer, prefix = piece.layer, piece.prefix
        assert layer is not None
        if what == "layer":
            return self._layer(spec, layer, t, rest[0], prefix)
        dtype = self.local_dtype(spec.tensor("mtp_enorm", layer))
        out = [replicated(spec.tensor(r, layer), spec.name(r, layer), dtype)
               for r in ("mtp_enorm", "mtp_hnorm", "mtp_eh_proj", "mtp_head_norm")]
        return out + self._layer(spec, layer, t, rest[0], prefix + "mtp_block.")

    def _layer(self, spec: ModelSpec, layer: int, t: int, i: int, prefix: str) -> list[Shard]:
        tensor = lambda role: spec.tensor(role, layer)  # noqa: E731
        dtype = self.local_dtype(tensor("input_norm"))
        roles = spec.layer_roles(layer)
        attn = prefix + _ATTN_PREFIX.get(spec.family, "self_attn") + "."
        out = [replicated(tensor("input_norm"), prefix + "input_layernorm.weight", dtype)]
        out.append(replicated(tensor("post_attn_norm"), prefix + "post_attention_layernorm.weight", dtype))
        out += [replicated(tensor(r), attn + r + ".weight", dtype) for r in ("q_norm", "k_norm") if r in roles]
        out += self._mla(spec, layer, t, attn, dtype) if spec.is_mla else self._gqa(spec, layer, t, attn, dtype)
        out.append(split(tensor("o"), attn + "o_proj.weight", dim=1, parts=self.tp, index=t, dtype=dtype))
        if "o_bias" in roles:
            out.append(replicated(tensor("o_bias"), attn + "o_proj.bias", dtype))
        if "sinks" in roles:
            out.append(split(tensor("sinks"), attn + "sinks", dim=0, parts=self.tp, index=t, dtype=dtype))
        if not spec.is_moe_layer(layer):
            out.extend(self._mlp(spec, layer, t, prefix + "mlp.", ("gate", "up", "down"), dtype=dtype))
            return out
        moe = prefix + _MOE_PREFIX.get(spec.family, "mlp") + "."
        if spec.family_info.experts == "whole":
            out += [replicated(tensor("router"), moe + "router.weight", dtype),
                    replicated(tensor("router_bias"), moe + "router.bias", dtype)]
            return out + self._whole_experts(spec, layer, i, moe + "experts.routed_experts.", dtype)
        out.append(replicated(tensor("router"), moe + "gate.weight", dtype))
        if "router_correction" in roles:  # vLLM keeps it in float32 whatever the model's dtype
            out.append(replicated(tensor("router_correction"), moe + "gate.e_score_correction_bias", "float32"))
        if "shared_gate" in roles:
            out.extend(self._mlp(spec, layer, t, moe + "shared_experts.", ("shared_gate", "shared_up", "shared_down"),
                                 dtype=dtype))
        return out + self._stacked_experts(spec, layer, i, moe + "experts.routed_experts.", dtype)

    def _gqa(self, spec: ModelSpec, layer: int, t: int, attn: str, dtype: str) -> list[Shard]:
        out = [concat_shard(attn + "qkv_proj.weight", dtype, self._qkv(spec, layer, t, ""))]
        if spec.attention_bias:
            out.append(concat_shard(attn + "qkv_proj.bias", dtype, self._qkv(spec, layer, t, "_bias")))
        return out

    def _mla(self, spec: ModelSpec, layer: int, t: int, attn: str, dtype: str) -> list[Shard]:
        tensor = lambda role: spec.tensor(role, layer)  # noqa: E731
        out = [replicated(tensor("kv_a_norm"), attn + "kv_a_layernorm.weight", dtype),
               split(tensor("kv_b"), attn + "kv_b_proj.weight", dim=0, parts=self.tp, index=t, dtype=dtype)]
        kv_a = tensor("kv_a")
        if spec.q_lora_rank:
            q_a = tensor("q_a")
            out += [concat_shard(attn + "fused_qkv_a_proj.weight", dtype,
                                 [(q_a, Box.full(q_a.shape)), (kv_a, Box.full(kv_a.shape))]),
                    replicated(tensor("q_a_norm"), attn + "q_a_layernorm.weight", dtype),
                    split(tensor("q_b"), attn + "q_b_proj.weight", dim=0, parts=self.tp, index=t, dtype=dtype)]
        else:
            out += [replicated(kv_a, attn + "kv_a_proj_with_mqa.weight", dtype),
                    split(tensor("q"), attn + "q_proj.weight", dim=0, parts=self.tp, index=t, dtype=dtype)]
        return out

    def _mlp(self, spec: ModelSpec, layer: int, t: int, prefix: str, roles: tuple[str, str, str], *,
             dtype: str) -> list[Shard]:
        gate, up, down = (spec.tensor(r, layer) for r in roles)
        lo, hi = even_bounds(gate.shape[0], self.tp, what=f"{roles[0]} rows")[t]
        return [concat_shard(prefix + "gate_up_proj.weight", dtype,
                             [(gate, rows(gate, lo, hi)), (up, rows(up, lo, hi))]),
                split(down, prefix + "down_proj.weight", dim=1, parts=self.tp, index=t, dtype=dtype)]

    def _qkv(self, spec: ModelSpec, layer: int, t: int, suffix: str) -> list[Part]:
        q = spec.tensor("q" + suffix, layer)
        k = spec.tensor("k" + suffix, layer)
        v = spec.tensor("v" + suffix, layer)
        hd = spec.head_dim
        q_lo, q_hi = even_bounds(spec.num_heads, self.tp, what="num_attention_heads")[t]
        kv_lo, kv_hi = kv_head_range(spec.num_kv_heads, self.tp, t)
        return [(q, rows(q, q_lo * hd, q_hi * hd)), (k, rows(k, kv_lo * hd, kv_hi * hd)),
                (v, rows(v, kv_lo * hd, kv_hi * hd))]

    def _expert_slice(self, spec: ModelSpec, i: int) -> tuple[int, int, int, int, int]:
        """(first expert, end, intermediate lo, hi, expert-TP rank) that MoE rank ``i`` holds."""
        group, e_rank = (i, 0) if self.ep > 1 else (0, i)
        if self.placed:  # every rank's slots [0, L); the placement fills them (place_experts)
            group, per = 0, self.placement(spec).num_physical // self.ep
        else:
            per = spec.num_experts // self.ep
        lo, hi = even_bounds(spec.moe_intermediate_size, self.expert_tp, what="moe_intermediate_size")[e_rank]
        return group * per, (group + 1) * per, lo, hi, e_rank

    def _stacked_experts(self, spec: ModelSpec, layer: int, i: int, prefix: str, dtype: str) -> list[Shard]:
        e0, e1, lo, hi, _ = self._expert_slice(spec, i)
        h = spec.hidden_size
        gate = spec.tensor("expert_gate", layer)
        up = spec.tensor("expert_up", layer)
        down = spec.tensor("expert_down", layer)
        return [
            concat_shard(prefix + "w13_weight", dtype,
                         [(gate, Box((e0, lo, 0), (e1 - e0, hi - lo, h))),
                          (up, Box((e0, lo, 0), (e1 - e0, hi - lo, h)))], dim=1),
            concat_shard(prefix + "w2_weight", dtype, [(down, Box((e0, 0, lo), (e1 - e0, h, hi - lo)))], dim=2),
        ]

    def _whole_experts(self, spec: ModelSpec, layer: int, i: int, prefix: str, dtype: str) -> list[Shard]:
        """gpt-oss: vLLM transposes the checkpoint's ``[E, H, 2I]``/``[E, I, H]`` experts, keeping the
        interleaved gate/up columns."""
        e0, e1, lo, hi, e_rank = self._expert_slice(spec, i)
        n, w, h = e1 - e0, hi - lo, spec.hidden_size
        scheme = BLOCK_SCHEMES.get(self.quant or "")
        if scheme is not None and self.expert_tp > 1:  # vLLM splits MX experts by whole blocks
            block = scheme.block
            per = -(-spec.moe_intermediate_size // block // self.expert_tp) * block
            lo, hi = min(e_rank * per, spec.moe_intermediate_size), min((e_rank + 1) * per, spec.moe_intermediate_size)
            n, w = e1 - e0, per  # the last rank's tensors are padded to the others' width
        held = hi - lo
        gate_up, down = spec.tensor("experts_gate_up", layer), spec.tensor("experts_down", layer)
        gu_bias, d_bias = spec.tensor("experts_gate_up_bias", layer), spec.tensor("experts_down_bias", layer)
        out = [
            Shard(prefix + "w13_weight", (n, 2 * w, h), dtype,
                  (_region(gate_up.name, Box((e0, 0, 2 * lo), (n, h, 2 * held)), (2 * w * h, 1, h)),)),
            Shard(prefix + "w13_bias", (n, 2 * w), dtype,
                  (_region(gu_bias.name, Box((e0, 2 * lo), (n, 2 * held)), (2 * w, 1)),)),
            Shard(prefix + "w2_weight", (n, h, w), dtype,
                  (_region(down.name, Box((e0, lo, 0), (n, held, h)), (h * w, 1, w)),)),
        ]
        if e_rank == 0:  # vLLM zeroes the down bias on the other expert-TP ranks
            out.append(concat_shard(prefix + "w2_bias", dtype, [(d_bias, Box((e0, 0), (n, h)))]))
        return out


def _region(canonical: str, box: Box, strides: tuple[int, ...]) -> Any:
    """A region at offset 0 of a local tensor that stores ``box`` with the given strides."""
    region = box_region(canonical, box, box.sizes)
    return dataclasses.replace(region, strides=strides)
