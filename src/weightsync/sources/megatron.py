"""Megatron-core GPT models (TP, PP, EP, expert TP) as Hugging Face canonical regions.

    model_chunks = get_model(model_provider, ...)   # a list: one chunk per virtual stage
    source = MegatronSource(model_chunks, hf_config)

For every parameter (and the router's ``expert_bias`` buffer), mbridge says which canonical
tensors the whole (unsharded) parameter fuses (:mod:`weightsync.sources.megatron_names`:
latent attention, shared experts, MTP layers and the Llama-style families alike), and the model
itself says which slice of it this rank holds:

* partition attributes ``tensor_model_parallel``/``partition_dim``/``partition_stride``,
  split over the TP group, or over the expert-TP group for experts (``parallel_state``):
  with stride ``s`` the dimension is cut into ``size * s`` chunks and rank ``r`` holds
  chunks ``r, r + size, ...``, so ``linear_fc1`` = ``[gate; up]`` (stride 2) is ``[gate_r; up_r]``;
* the vocabulary may be padded (Megatron-LM's ``make_vocab_size_divisible_by``): padding
  rows map to nothing; the padded size is read from the local shape;
* ``decoder.layers.{j}`` counts from 0 on every stage: the global layer is the layer
  module's ``layer_number - 1`` (covers uneven and virtual pipeline stages); ``mtp.layers.{i}``
  is checkpoint layer ``num_hidden_layers + i``;
* ``local_experts.{k}`` (TE's ``linear_fc1.weight{k}``) is global expert
  ``local_expert_indices[k]`` of its MoE layer;
* with tied embeddings and PP > 1 the last stage's ``output_layer.weight`` is a second copy
  of the embedding, and with MTP layers and PP > 1 the last stage embeds too: more holders;
* a parameter megatron-core splits over TP without marking it (gpt-oss's sinks,
  ``DotProductAttention.softmax_offset``, ``heads / tp`` per rank) is cut where its local shape
  differs from the whole, as mbridge's own TP split does;
* gpt-oss's experts: the checkpoint holds them whole with gate and up columns interleaved,
  Megatron's ``linear_fc1`` as ``[gate_r; up_r]`` rows. ``tensors()`` stages each local expert's
  ``linear_fc1`` weight and bias in the checkpoint's interleaved order (:func:`stage_fc1`) into
  buffers the source keeps: a standing copy of every local expert's fc1 (about 2/3 of the rank's
  expert bytes); ``linear_fc2`` is sent from the parameter itself (``whole_expert_shard``).

A parameter mbridge maps to no canonical tensor raises a ValueError listing the names.
Megatron and mbridge are imported inside the constructor only.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.layout import ModelSpec, RankLayout, Shard
from weightsync.layout.builders import padded_size
from weightsync.layout.kinds.megatron import whole_expert_shard
from weightsync.layout.params import ParamParts, Runs, run_boxes, runs_length
from weightsync.sources.param_mapping import check_known, matching_descriptor, read_config, uniform_dtype
from weightsync.tools.torch_layout import dtype_name

_TE_EXPERT = re.compile(r"\.linear_fc[12]\.weight\d+$")
_LAYER = re.compile(r"(decoder|mtp)\.layers\.(\d+)\.(.+)")
#: A gpt-oss expert's parameter, by global name: (layer, linear_fc1|2, weight|bias, expert).
_WHOLE_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)")
_EXPERT = re.compile(r"(.*)experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)"
                     r"|(linear_fc[12])\.(weight|bias)(\d+))")
#: The families the ``megatron`` layout kind lays out without mbridge (a descriptor other ranks expand).
_KIND_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"})


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


def stage_fc1(fc1: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A gpt-oss expert's ``linear_fc1`` weight ``[gate; up]`` (``[2w, H]``) as the checkpoint orders it,
    ``[H, 2w]`` with gate and up columns interleaved (its bias ``[2w]`` likewise), written into ``out``
    (a new tensor when None)."""
    w = fc1.shape[0] // 2
    if fc1.dim() == 1:
        out = torch.empty_like(fc1) if out is None else out
        out.view(w, 2).copy_(fc1.view(2, w).t())
        return out
    h = fc1.shape[1]
    out = fc1.new_empty((h, 2 * w)) if out is None else out
    out.view(h, w, 2).copy_(fc1.view(2, w, h).permute(2, 1, 0))
    return out


def _unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers (the router's ``expert_bias``) of a GPTModel, by name."""
    out = dict(model.named_parameters())
    persistent = {k for k in model.state_dict(keep_vars=True) if not k.endswith("_extra_state")}
    out.update((name, b) for name, b in model.named_buffers() if name in persistent and name not in out)
    return out


def _global_name(model: Any, name: str) -> str:
    """``name`` with global layer and expert numbers, in the form mbridge maps (TEGroupedMLP's experts)."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return name
    stack, index, rest = match[1], int(match[2]), match[3]
    if stack == "decoder":
        layer = model.decoder.layers[index]
        prefix = f"decoder.layers.{int(layer.layer_number) - 1}."
    else:
        layer = model.mtp.layers[index]
        prefix = name[: match.start(3)]
    expert = _EXPERT.fullmatch(rest)
    if expert is None:
        return prefix + rest
    head = expert[1]
    moe = functools.reduce(getattr, head.rstrip(".").split("."), layer)
    if expert[2] is not None:
        local, fc, attr = int(expert[2]), expert[3], expert[4]
    else:
        local, fc, attr = int(expert[7]), expert[5], expert[6]
    return f"{prefix}{head}experts.{fc}.{attr}{int(moe.local_expert_indices[local])}"


def _split(name: str, param: Any, is_expert: bool, groups: Groups,
           whole: tuple[int, ...] | None = None) -> tuple[int, int, int, int] | None:
    """(dim, stride, size, rank) of the TP split of ``param`` (of unsharded shape ``whole``, when known);
    None when it is whole here."""
    size, rank = groups.etp if is_expert else groups.tp
    if getattr(param, "tensor_model_parallel", False):
        dim, stride = int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    elif is_expert:  # TE grouped experts carry no attributes: fc1 splits rows [gate; up], fc2 columns
        dim, stride = (0, 2) if ".linear_fc1." in name else (1, 1)
    elif whole is not None and len(whole) == param.dim() and tuple(param.shape) != whole:
        # unmarked yet cut (softmax_offset): where the shapes differ, as mbridge's _weight_split_across_tp
        dim, stride = next(d for d, (a, b) in enumerate(zip(param.shape, whole, strict=True)) if a != b), 1
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
        from weightsync.sources.megatron_names import MegatronNames

        chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
        self.models = [_unwrap(c) for c in chunks]
        self.spec, self.config = read_config(config)
        self.groups = Groups.from_parallel_state()
        if rank is None:
            rank = torch.distributed.get_rank()
        names = MegatronNames.of(self.spec)
        self.whole_experts = self.spec.family_info.experts == "whole"
        self._names: dict[str, tuple[int, str]] = {}
        #: gpt-oss experts' linear_fc1 in the checkpoint's order, refilled before every version; kept, so that
        #: transports prepared on their storage (registrations, shared-memory endpoints) stay valid
        self._staged: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        shards = []
        for i, model in enumerate(self.models):
            prefix = f"chunk{i}." if len(self.models) > 1 else ""
            for name, tensor in _tensors(model).items():
                whole = _WHOLE_EXPERT.fullmatch(_global_name(model, name)) if self.whole_experts else None
                if whole is not None:
                    shards.append(self._whole_expert(prefix + name, tensor, whole))
                    self._names[prefix + name] = (i, name)
                    continue
                parts = names.parts(_global_name(model, name))
                if parts is None:
                    unknown.append(prefix + name)
                    continue
                split = _split(name, tensor, ".experts." in name, self.groups, parts.shape)
                shards.append(_shard(prefix + name, tensor, parts, split))
                self._names[prefix + name] = (i, name)
        check_known(unknown, self.spec, "Megatron")
        self._layout = RankLayout(rank, tuple(shards), self.spec.canonical_tensors())

    def _whole_expert(self, name: str, tensor: torch.Tensor, match: re.Match[str]) -> Shard:
        """A gpt-oss expert's parameter (``match``: its global name) as ``whole_expert_shard`` lays it out."""
        layer, suffix, expert = int(match[1]), f"{match[2]}.{match[3]}", int(match[4])
        size, rank = self.groups.etp
        w = tensor.shape[0] // 2 if suffix.startswith("linear_fc1") else (
            tensor.shape[1] if suffix == "linear_fc2.weight" else self.spec.moe_intermediate_size // size)
        shard = whole_expert_shard(self.spec, layer, suffix, expert, (rank * w, (rank + 1) * w), name=name,
                                   dtype=dtype_name(tensor.dtype))
        if shard.numel != tensor.numel() or (suffix == "linear_fc2.bias" and tuple(tensor.shape) != shard.shape):
            raise ValueError(f"{name}: local shape {tuple(tensor.shape)} does not fit the gpt-oss expert "
                             f"parameter of {shard.shape} the model config gives (expert TP {size})")
        if suffix.startswith("linear_fc1"):
            self._staged[name] = torch.empty(shard.shape, dtype=tensor.dtype, device=tensor.device)
        return shard

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The local tensors by shard name; gpt-oss experts' ``linear_fc1`` as their staged copies, refilled."""
        held = [_tensors(m) for m in self.models]
        out = {local: held[i][name].detach() for local, (i, name) in self._names.items()}
        for local, staged in self._staged.items():
            out[local] = stage_fc1(out[local], staged)
        return out

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        """``megatron:tp=..,pp=..`` when this rank's shards are exactly that kind's."""
        g = self.groups
        if len(self.models) > 1 or g.cp > 1 or self.spec.family not in _KIND_FAMILIES:
            return None  # the kind lays out the other families only where mbridge is installed: not on readers
        tp = g.tp[0]
        padded = int(getattr(self.models[0], "vocab_size", 0))  # GPTModel's (padded) vocabulary, every stage
        multiple = 128 if not padded or padded_size(self.spec.vocab_size, 128 * tp) == padded else padded // tp
        grouped = int(any(_TE_EXPERT.search(s.name) for s in self._layout.shards))
        etp = "" if g.etp[0] == tp else f",etp={g.etp[0]}"  # the kind's default (Megatron-core's: tp)
        kind = (f"megatron:tp={tp},pp={g.pp},dp={g.dp},ep={g.ep}{etp},vocab_multiple={multiple},"
                f"grouped={grouped}" + uniform_dtype(self._layout, self.spec))
        return matching_descriptor(self._layout, self.spec, self.config, [kind])

