"""Training sources that need no framework: a plain module, or tensors already sharded.

``ModuleSource`` wraps an ``nn.Module`` whose parameter names are transformers names
(checkpoint names, or transformers >= 5's fused MoE experts; one process, whole model).
``ShardedSource`` wraps tensors a program laid out itself according to a registered layout
kind (``"megatron:tp=2"``, ...), and publishes the compact descriptor instead of a shard list.

    source = ModuleSource(model, config)        # config: HF config dict
    source = ShardedSource("megatron:tp=2", config, rank, tensors)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weightsync.layout import ModelSpec, RankLayout, parse_layout
from weightsync.tools.torch_layout import allocate, module_layout, named_tensors


def _spec(config: Mapping[str, Any] | ModelSpec) -> ModelSpec:
    return config if isinstance(config, ModelSpec) else ModelSpec.from_hf_config(config)


class ModuleSource:
    """A whole model in one process, parameters named like the HF checkpoint."""

    def __init__(self, module: torch.nn.Module, config: Mapping[str, Any] | ModelSpec, *, rank: int = 0) -> None:
        self.module = module
        self.spec = _spec(config)
        self.config = dict(config) if not isinstance(config, ModelSpec) else config.to_hf_config()
        self._layout = module_layout(named_tensors(module, self.spec).items(), self.spec, rank)
        self._names = {s.name for s in self._layout.shards}

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {n: p.detach() for n, p in named_tensors(self.module, self.spec).items() if n in self._names}

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None


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
