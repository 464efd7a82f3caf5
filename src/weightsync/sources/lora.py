"""A trainer's LoRA adapter as a training source: only the adapter's A and B matrices move.

In LoRA RL the base model is frozen and already in the engine; each version is the adapter
alone (megabytes). The source presents this rank's adapter tensors under their PEFT names
(``base_model.model.<module>.lora_A.weight``), with the tensor-parallel layout of
:class:`~weightsync.layout.lora.LoraSpec`, so the planner reshards them like any weights::

    lora = LoraSpec(r=8, alpha=16)
    source = LoraSource.from_module(peft_model, config, lora)            # PEFT-wrapped model
    source = LoraSource(my_tensors, config, lora, tp=2, tp_rank=1, rank=1)   # TP-sharded trainer
    with WeightWriter(source, rank=..., config=SyncConfig(...)) as writer:
        for step in ...:
            train_step()
            writer.write(step)          # the adapter's current bytes, in place, no copy

Names are accepted in every form PEFT produces: saved (``...lora_A.weight``), live
``PeftModel`` parameters (``...lora_A.default.weight``) and ``inject_adapter_in_model``
ones (no ``base_model.model.`` prefix).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.layout import ModelSpec, RankLayout
from weightsync.layout.lora import PEFT_PREFIX, LoraSpec
from weightsync.tools.torch_layout import check_tensors, dtype_name

_LORA_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[\w-]+))?\.weight$")


def peft_name(name: str, *, adapter: str = "default") -> str | None:
    """The saved PEFT name of a LoRA parameter name, or None if ``name`` is not one of ``adapter``'s."""
    match = _LORA_NAME.match(name)
    if match is None or match["adapter"] not in (None, adapter):
        return None
    module = match["module"]
    if not module.startswith(PEFT_PREFIX):
        module = PEFT_PREFIX + module
    return f"{module}.lora_{match['ab']}.weight"


class LoraSource:
    """This rank's adapter tensors (TP shards of them under ``tp > 1``), sent as they are.

    Args:
        tensors: PEFT name (any form, see the module docstring) -> this rank's local tensor;
            under TP, column-parallel layers' B and row-parallel layers' A are this rank's slice.
        config: the base model's HF config (or its :class:`ModelSpec`).
        lora: the adapter's rank, alpha and target modules.
        tp, tp_rank: the trainer's tensor parallelism; rank: the writer rank.
        adapter: the PEFT adapter name to take from live ``PeftModel`` names.

    Raises:
        ValueError: a target module's tensor is missing, unexpected, or has the wrong shape.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any] | ModelSpec,
                 lora: LoraSpec, *, tp: int = 1, tp_rank: int = 0, rank: int = 0, adapter: str = "default") -> None:
        self.spec = config if isinstance(config, ModelSpec) else ModelSpec.from_hf_config(config)
        self.lora = lora
        renamed: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            canonical = peft_name(name, adapter=adapter)
            if canonical is None:
                continue
            if canonical in renamed:
                raise ValueError(f"LoRA tensors {name!r} and another name both map to {canonical!r}")
            renamed[canonical] = tensor.detach()
        dtypes = {dtype_name(t.dtype) for t in renamed.values()}
        if len(dtypes) > 1:
            raise ValueError(f"LoRA tensors mix dtypes {sorted(dtypes)}; cast them to one")
        self._layout = lora.rank_layout(self.spec, rank, tp=tp, tp_rank=tp_rank,
                                        dtype=dtypes.pop() if dtypes else None)
        expected = {s.name for s in self._layout.shards}
        extra = sorted(set(renamed) - expected)
        if extra:
            raise ValueError(f"LoRA tensors {extra[:3]} are not targets of {list(lora.target_modules)} "
                             f"(r={lora.r}); pass the LoraSpec the adapter was built with")
        check_tensors(self._layout, renamed, f"LoRA source rank {rank}")
        self._tensors = {s.name: renamed[s.name] for s in self._layout.shards}

    @classmethod
    def from_module(cls, module: torch.nn.Module, config: Mapping[str, Any] | ModelSpec, lora: LoraSpec,
                    **kwargs: Any) -> LoraSource:
        """The LoRA parameters of a PEFT-wrapped (or adapter-injected) module, by reference."""
        return cls(dict(module.named_parameters()), config, lora, **kwargs)

    def layout(self) -> RankLayout:
        return self._layout

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def descriptor(self) -> tuple[str, Mapping[str, object]] | None:
        return None  # explicit layout: an adapter's few hundred shards are cheap to publish
