"""Megatron-core GPT models (TP, PP, EP, expert TP) as Hugging Face canonical regions.

    model_chunks = get_model(model_provider, ...)   # a list: one chunk per virtual stage
    source = MegatronSource(model_chunks, hf_config)

For every parameter, its name says which canonical tensors the whole (unsharded) parameter
fuses, and the model itself says which slice of it this rank holds:

* partition attributes ``tensor_model_parallel``/``partition_dim``/``partition_stride``,
  split over the TP group, or over the expert-TP group for experts (``parallel_state``):
  with stride ``s`` the dimension is cut into ``size * s`` chunks and rank ``r`` holds
  chunks ``r, r + size, ...``, so ``linear_fc1`` = ``[gate; up]`` (stride 2) is ``[gate_r; up_r]``;
* ``linear_qkv`` rows are ``[q heads of g; k_g; v_g]`` per query group ``g``;
* the vocabulary may be padded (Megatron-LM's ``make_vocab_size_divisible_by``): padding
  rows map to nothing; the padded size is read from the local shape;
* ``decoder.layers.{j}`` counts from 0 on every stage: the global layer is the layer
  module's ``layer_number - 1`` (covers uneven and virtual pipeline stages);
* ``local_experts.{k}`` (TE's ``linear_fc1.weight{k}``) is global expert
  ``local_expert_indices[k]`` of its MoE layer;
* with tied embeddings and PP > 1 the last stage's ``output_layer.weight`` is a second copy
  of the embedding: one more holder.

Anything else (shared experts, biases of linear layers, MTP layers, the legacy GroupedMLP
``weight1``/``weight2``) raises a ValueError listing the names. Megatron is imported inside
the constructor only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.layout import Box, ModelSpec, RankLayout, Shard
from weightsync.layout.builders import padded_size, rows
from weightsync.layout.params import ParamParts, Runs, run_boxes, runs_length
from weightsync.sources.param_mapping import check_known, matching_descriptor, read_config, uniform_dtype
from weightsync.torch_layout import dtype_name

_TE_EXPERT = re.compile(r"\.linear_fc[12]\.weight\d+$")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))")

#: Per-layer parameters that are one whole canonical tensor (TE fuses the norms into linears).
_LAYER_ROLES = {
    "input_layernorm.weight": "input_norm",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm",
    "self_attention.q_layernorm.weight": "q_norm",
    "self_attention.k_layernorm.weight": "k_norm",
    "self_attention.linear_proj.weight": "o",
    "pre_mlp_layernorm.weight": "post_attn_norm",
    "mlp.linear_fc1.layer_norm_weight": "post_attn_norm",
    "mlp.linear_fc2.weight": "down",
    "mlp.router.weight": "router",
}
_TOP_ROLES = {
    "embedding.word_embeddings.weight": "embed",
    "output_layer.weight": "lm_head",  # the embedding when tied
    "decoder.final_layernorm.weight": "final_norm",
}


@dataclass(frozen=True, slots=True)
class Groups:
    """(size, rank) of the TP and expert-TP groups, plus what a descriptor needs."""

    tp: tuple[int, int]
    etp: tuple[int, int]
    pp: int
    dp: int
    ep: int
    cp: int

    @classmethod
    def from_parallel_state(cls) -> Groups:
        from megatron.core import parallel_state as ps

        return cls(
            tp=(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()),
            etp=(ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()),
            pp=ps.get_pipeline_model_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
        )


def _unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def _qkv_parts(spec: ModelSpec, layer: int, suffix: str) -> ParamParts:
    q, k, v = (spec.tensor(x + suffix, layer) for x in "qkv")
    hd, per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    parts = []
    for g in range(spec.num_kv_heads):
        parts += [(q, rows(q, g * per_group * hd, (g + 1) * per_group * hd)),
                  (k, rows(k, g * hd, (g + 1) * hd)), (v, rows(v, g * hd, (g + 1) * hd))]
    return ParamParts.concat(parts, role="qkv" + suffix)


def _layer_parts(spec: ModelSpec, model: Any, j: int, rest: str) -> tuple[ParamParts, bool] | None:
    """(parts, is_expert) of ``decoder.layers.{j}.{rest}``; None when unknown."""
    layer_module = model.decoder.layers[j]
    layer = int(layer_module.layer_number) - 1
    if not 0 <= layer < spec.num_layers:
        return None
    roles = spec.layer_roles(layer)
    if rest in _LAYER_ROLES:
        role = _LAYER_ROLES[rest]
        return (ParamParts.whole(spec.tensor(role, layer), role), False) if role in roles else None
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = "" if rest.endswith("weight") else "_bias"
        return (_qkv_parts(spec, layer, suffix), False) if "q" + suffix in roles else None
    if rest == "mlp.linear_fc1.weight" and "gate" in roles:
        gate, up = spec.tensor("gate", layer), spec.tensor("up", layer)
        return ParamParts.concat([(gate, Box.full(gate.shape)), (up, Box.full(up.shape))], role="fc1"), False
    match = _EXPERT.fullmatch(rest)
    if match is None or "expert_gate" not in roles:
        return None
    local, fc = (int(match[1]), match[2]) if match[1] is not None else (int(match[4]), match[3])
    expert = int(layer_module.mlp.local_expert_indices[local])
    if fc == "linear_fc1":
        gate, up = spec.tensor("expert_gate", layer), spec.tensor("expert_up", layer)
        part = Box((expert, 0, 0), (1, *gate.shape[1:]))
        return ParamParts.concat([(gate, part), (up, part)], drop_leading=1, role="expert_fc1"), True
    return ParamParts.expert(spec.tensor("expert_down", layer), expert, "expert_fc2"), True


def _param_parts(spec: ModelSpec, model: Any, name: str) -> tuple[ParamParts, bool] | None:
    if name in _TOP_ROLES:
        role = _TOP_ROLES[name]
        if role == "lm_head" and spec.tie_word_embeddings:
            role = "embed"
        return ParamParts.whole(spec.tensor(role), role), False
    match = _LAYER.fullmatch(name)
    return _layer_parts(spec, model, int(match[1]), match[2]) if match else None


def _split(param: Any, parts: ParamParts, is_expert: bool, groups: Groups) -> tuple[int, int, int, int] | None:
    """(dim, stride, size, rank) of the TP split of ``param``; None when it is whole here."""
    size, rank = groups.etp if is_expert else groups.tp
    if getattr(param, "tensor_model_parallel", False):
        dim, stride = int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    elif is_expert:  # TE grouped experts carry no attributes: fc1 splits rows [gate; up], fc2 columns
        dim, stride = (0, 2) if parts.role == "expert_fc1" else (1, 1)
    else:
        return None
    return (dim, stride, size, rank) if size > 1 else None


def _shard(name: str, param: torch.Tensor, parts: ParamParts, split: tuple[int, int, int, int] | None) -> Shard:
    local = param.detach()
    if not local.is_contiguous():
        raise ValueError(f"{name}: the local tensor (strides {local.stride()}) is not contiguous")
    shape = list(local.shape)
    runs: list[Runs] = [((0, n),) for n in shape]
    if split is not None:
        dim, stride, size, rank = split
        shape[dim] *= size
        chunk = local.shape[dim] // stride
        runs[dim] = tuple(((j * size + rank) * chunk, chunk) for j in range(stride))
    if parts.role in ("embed", "lm_head") and shape[0] >= parts.shape[0]:
        parts = parts.padded((shape[0], *parts.shape[1:]))  # rows past the vocabulary map to nothing
    if tuple(shape) != parts.shape or tuple(runs_length(r) for r in runs) != tuple(local.shape):
        raise ValueError(f"{name}: local shape {tuple(local.shape)} (split {split}) does not fit a parameter of "
                         f"{parts.shape}, the shape the model config gives")
    regions = [r for lbox, gbox in run_boxes(runs) for r in parts.box_regions(gbox, local.shape, lbox.offsets)]
    return Shard(name, tuple(local.shape), dtype_name(local.dtype), tuple(regions))


class MegatronSource:
    """Megatron-core ``GPTModel`` chunks on this rank, as canonical regions.

    Args:
        model_chunks: the rank's model chunk, or its list of virtual-pipeline chunks
            (DDP / Float16Module wrappers are unwrapped).
        config: the Hugging Face config (dict) or a ModelSpec of the same model.
        rank: this writer's rank (default: the global torch.distributed rank).

    Shard names are the Megatron parameter names, prefixed ``chunk{i}.`` when there are
    several chunks. Build the source after ``initialize_model_parallel``.

    Raises:
        ValueError: listing parameters no canonical tensor matches, or on shapes that
            disagree with the config.
    """

    def __init__(self, model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
                 config: Mapping[str, Any] | ModelSpec, *, rank: int | None = None) -> None:
        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
        self.models = [_unwrap(c) for c in chunks]
        self.spec, self.config = read_config(config)
        self.groups = Groups.from_parallel_state()
        if rank is None:
            rank = torch.distributed.get_rank()
        self._names: dict[str, tuple[int, str]] = {}
        unknown: list[str] = []
        found = []
        for i, model in enumerate(self.models):
            prefix = f"chunk{i}." if len(self.models) > 1 else ""
            for name, param in model.named_parameters():
                mapped = _param_parts(self.spec, model, name)
                if mapped is None:
                    unknown.append(prefix + name)
                else:
                    found.append((prefix + name, param, *mapped))
                    self._names[prefix + name] = (i, name)
        check_known(unknown, self.spec, "Megatron")
        shards = tuple(_shard(name, param, parts, _split(param, parts, is_expert, self.groups))
                       for name, param, parts, is_expert in found)
        self._layout = RankLayout(rank, shards, self.spec.canonical_tensors())

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        params = [dict(m.named_parameters()) for m in self.models]
        return {local: params[i][name].detach() for local, (i, name) in self._names.items()}

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        """``megatron:tp=..,pp=..`` when this rank's shards are exactly that kind's."""
        g = self.groups
        if len(self.models) > 1 or g.cp > 1:
            return None
        tp = g.tp[0]
        padded = int(getattr(self.models[0], "vocab_size", 0))  # GPTModel's (padded) vocabulary, every stage
        multiple = 128 if not padded or padded_size(self.spec.vocab_size, 128 * tp) == padded else padded // tp
        grouped = int(any(_TE_EXPERT.search(s.name) for s in self._layout.shards))
        etp = "" if g.etp[0] == tp else f",etp={g.etp[0]}"  # the kind's default (Megatron-core's: tp)
        kind = (f"megatron:tp={tp},pp={g.pp},dp={g.dp},ep={g.ep}{etp},vocab_multiple={multiple},"
                f"grouped={grouped}" + uniform_dtype(self._layout, self.spec))
        return matching_descriptor(self._layout, self.spec, self.config, [kind])

