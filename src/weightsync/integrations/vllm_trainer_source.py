"""What a trainer hands vLLM's trainer-side backend, as a weightsync training source
(:func:`as_training_source`): a weightsync source as it is, vLLM's ``ModuleSource`` by its
module (DTensor-sharded or plain), any other vLLM ``WeightSource`` through
:class:`WeightSourceAdapter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weightsync.layout import ModelSpec, RankLayout
from weightsync.tools.torch_layout import module_layout


class WeightSourceAdapter:
    """Any vLLM ``WeightSource`` as a weightsync training source (see module docstring).

    ``metadata()`` describes the whole model on every rank; ``held_names()`` (None: all)
    what this rank sends. Iterating the source is a collective among ranks sharing a
    tensor, so ``tensors()`` runs one full pass on every rank, every version.
    """

    def __init__(self, source: Any, config: Mapping[str, Any], rank: int) -> None:
        self.source = source
        self.spec = ModelSpec.from_hf_config(config)
        held = source.held_names()
        meta = [m for m in source.metadata() if held is None or m.name in set(held)]
        if not meta:
            raise ValueError(f"trainer rank {rank}: the WeightSource holds no parameters (held_names() is empty)")
        named = ((m.name, torch.empty(m.shape, dtype=m.dtype, device="meta")) for m in meta)
        self._layout = module_layout(named, self.spec, rank)
        self._buffers: dict[str, torch.Tensor] | None = None

    def layout(self) -> RankLayout:
        return self._layout

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None

    def tensors(self) -> Mapping[str, torch.Tensor]:
        shapes = {s.name: s for s in self._layout.shards}
        for names, tensors in self.source.iter_groups():
            for name, tensor in zip(names, tensors, strict=True):
                if tensor is None or name not in shapes:
                    continue
                if self._buffers is None:  # on the source's device, allocated once
                    from weightsync.tools.torch_layout import allocate

                    self._buffers = allocate(self._layout, device=tensor.device)
                self._buffers[name].copy_(tensor.detach())
        if self._buffers is None:
            raise ValueError("the WeightSource yielded none of the tensors this rank holds")
        return self._buffers


def as_training_source(source: Any, config: Mapping[str, Any] | None, rank: int) -> Any:
    """A weightsync training source for whatever the trainer passed (module docstring)."""
    if all(hasattr(source, attr) for attr in ("layout", "tensors", "descriptor")):
        return source  # already a weightsync source
    if config is None:
        raise ValueError("WeightSyncTrainerInitInfo.model_config (the model's Hugging Face config) is needed to "
                         "place a vLLM WeightSource's tensors")
    module = _vllm_module_source_module(source)
    if module is not None:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in module.parameters()):
            from weightsync.sources.dtensor import DTensorSource

            return DTensorSource(module, config, rank=rank)  # shard by shard, no full_tensor()
        from weightsync.sources.module import ModuleSource

        return ModuleSource(module, config, rank=rank)
    return WeightSourceAdapter(source, config, rank)


def _vllm_module_source_module(source: Any) -> torch.nn.Module | None:
    """The module behind vLLM 0.32's ``ModuleSource`` (a private attribute: checked here only)."""
    from vllm.distributed.weight_transfer.base import ModuleSource as VLLMModuleSource

    if type(source) is VLLMModuleSource:
        module = getattr(source, "_module", None)
        return module if isinstance(module, torch.nn.Module) else None
    return None
