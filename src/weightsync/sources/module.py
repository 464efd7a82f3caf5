"""Training sources that need no framework: a plain module, or tensors already sharded.

``ModuleSource`` wraps an ``nn.Module`` whose parameter names are transformers names
(checkpoint names, or transformers >= 5's fused MoE experts; one process, whole model).
``ShardedSource`` wraps tensors a program laid out itself according to a registered layout
kind (``"megatron:tp=2"``, ...), and publishes the compact descriptor instead of a shard list.

    source = ModuleSource(model, config)        # config: HF config dict
    source = ShardedSource("megatron:tp=2", config, rank, tensors)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from weightsync.layout import Box, ModelSpec, RankLayout, Shard, parse_layout
from weightsync.layout.params import hf_param
from weightsync.transport.tensors import TORCH_DTYPES, dtype_name


def module_layout(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, rank: int) -> RankLayout:
    """Match named tensors (transformers names) to the canonical model; every name must be known.

    Both namings of MoE experts are understood: per-expert checkpoint names and the fused
    ``experts.gate_up_proj``/``experts.down_proj`` of transformers >= 5.

    Raises:
        ValueError: listing names no canonical tensor maps, or shape mismatches.
    """
    shards: list[Shard] = []
    unknown, wrong = [], []
    for name, tensor in named:
        parts = hf_param(spec, name)
        if parts is None:
            unknown.append(name)
            continue
        if tuple(tensor.shape) != parts.shape:
            wrong.append(f"{name}: {tuple(tensor.shape)} != {parts.shape}")
            continue
        regions = parts.box_regions(Box.full(parts.shape), parts.shape)
        shards.append(Shard(name, parts.shape, dtype_name(tensor.dtype), tuple(regions)))
    if unknown:
        raise ValueError(f"{len(unknown)} parameter name(s) match no canonical tensor of the {spec.family} "
                         f"name map: {unknown[:8]}")
    if wrong:
        raise ValueError(f"parameter shapes disagree with the model config: {wrong[:5]}")
    return RankLayout(rank, tuple(shards), spec.canonical_tensors())


def _spec(config: Mapping[str, Any] | ModelSpec) -> ModelSpec:
    return config if isinstance(config, ModelSpec) else ModelSpec.from_hf_config(config)


class ModuleSource:
    """A whole model in one process, parameters named like the HF checkpoint."""

    def __init__(self, module: torch.nn.Module, config: Mapping[str, Any] | ModelSpec, *, rank: int = 0) -> None:
        self.module = module
        self.spec = _spec(config)
        self.config = dict(config) if not isinstance(config, ModelSpec) else config.to_hf_config()
        self._layout = module_layout(((n, p) for n, p in module.named_parameters()), self.spec, rank)
        self._names = {s.name for s in self._layout.shards}

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.module.named_parameters() if n in self._names}

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None


def allocate(layout: RankLayout, *, device: str | torch.device = "cpu", fill: float | None = None
             ) -> dict[str, torch.Tensor]:
    """Fresh contiguous tensors for every shard of ``layout`` (zeros, or ``fill``)."""
    out = {}
    for shard in layout.shards:
        t = torch.zeros(shard.shape, dtype=TORCH_DTYPES[shard.dtype], device=device)
        if fill is not None:
            t.fill_(fill)
        out[shard.name] = t
    return out


class ShardedSource:
    """Tensors already laid out per a registered layout kind on this rank."""

    def __init__(self, layout: str, config: Mapping[str, Any], rank: int,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        self.layout_text = parse_layout(layout).describe()
        self.config = dict(config)
        self.spec = ModelSpec.from_hf_config(config)
        kind = parse_layout(layout)
        kind.validate(self.spec)
        self._layout = kind.rank_layout(self.spec, rank)
        self._tensors = dict(tensors) if tensors is not None else allocate(self._layout)
        missing = sorted({s.name for s in self._layout.shards} - set(self._tensors))
        if missing:
            raise ValueError(f"{self.layout_text} rank {rank}: tensors missing for shards {missing[:5]}")

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return self.layout_text, self.config


def fill_from_canonical(layout: RankLayout, tensors: Mapping[str, torch.Tensor],
                        values: Mapping[str, torch.Tensor]) -> None:
    """Copy each region's box of the canonical ``values`` into the local tensors, in place.

    For programs (tests, the demo, benchmarks) that hold full canonical weights and need
    any rank's shards of them.
    """
    for shard in layout.shards:
        flat = tensors[shard.name].detach().view(-1)
        for region in shard.regions:
            view = flat.as_strided(region.box.sizes, region.strides, flat.storage_offset() + region.offset)
            view.copy_(values[region.canonical][region.box.slices()])
