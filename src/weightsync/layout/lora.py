"""LoRA adapters as canonical tensors: PEFT names, shapes, and their tensor-parallel shards.

A LoRA adapter on a linear layer ``W [out, in]`` is two matrices, ``A [r, in]`` and
``B [out, r]`` (the layer computes ``W x + scaling * B A x``, ``scaling = alpha / r``).
Their canonical names are PEFT's saved names, the ones ``adapter_model.safetensors`` and
``get_peft_model_state_dict`` use and vLLM parses::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, hidden]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [q_rows, r]

Under tensor parallelism an adapter follows its base layer: a column-parallel layer (q, k,
v, gate, up: output rows split) splits B's rows and replicates A; a row-parallel layer (o,
down: input columns split) splits A's columns and replicates B. An adapter is therefore
just another set of canonical tensors and shards, and the ordinary planner reshards it
(two TP writers into one reader, the replicated halves sent once)::

    lora = LoraSpec(r=8, alpha=16)
    layout = lora.rank_layout(spec, rank=1, tp=2, tp_rank=1)   # a trainer's TP rank 1
    reader = lora.rank_layout(spec, rank=0)                    # an engine holding it whole
    lora.peft_config()                                         # adapter_config.json content

Pure (no torch), like the rest of ``layout``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.layout.box import Box, even_bounds
from weightsync.layout.model import ModelSpec
from weightsync.layout.types import CanonicalTensor, RankLayout, Shard, box_region, itemsize

#: PEFT target module name -> (model role, whether the base layer is column-parallel).
LORA_MODULES: Mapping[str, tuple[str, bool]] = {
    "q_proj": ("q", True),
    "k_proj": ("k", True),
    "v_proj": ("v", True),
    "o_proj": ("o", False),
    "gate_proj": ("gate", True),
    "up_proj": ("up", True),
    "down_proj": ("down", False),
}

#: The prefix PEFT puts before a module's path in saved adapter names.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoraTensor:
    """One adapter matrix: its canonical tensor, and how tensor parallelism splits it."""

    tensor: CanonicalTensor
    module: str  # the base layer's module path, e.g. ``model.layers.0.self_attn.q_proj``
    matrix: str  # "A" or "B"
    split_dim: int | None  # the dimension TP ranks split (None: every TP rank holds it whole)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """A LoRA adapter's shape: rank ``r``, ``alpha``, target modules and the adapter dtype.

    ``dtype`` None means the model's dtype. MoE expert layers are not targets (only the
    attention projections of MoE layers carry adapters).
    """

    r: int
    alpha: float
    target_modules: tuple[str, ...] = tuple(LORA_MODULES)
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha}")
        unknown = sorted(set(self.target_modules) - set(LORA_MODULES))
        if unknown or not self.target_modules:
            raise ValueError(f"LoRA target_modules {unknown or '[]'} not supported; use some of "
                             f"{sorted(LORA_MODULES)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"LoRA target_modules {list(self.target_modules)} name a module twice")
        if self.dtype is not None:
            itemsize(self.dtype)

    @property
    def scaling(self) -> float:
        """``alpha / r``: what the adapter's product ``B A`` is multiplied by."""
        return self.alpha / self.r

    @classmethod
    def from_peft_config(cls, config: Mapping[str, Any], *, dtype: str | None = None) -> LoraSpec:
        """Read PEFT's ``adapter_config.json`` (plain LoRA only: no DoRA, no per-module ranks)."""
        for key in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save"):
            if config.get(key):
                raise ValueError(f"adapter config sets {key}={config[key]!r}; only plain LoRA is supported")
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            raise ValueError(f"adapter config target_modules is a pattern ({targets!r}); list the modules")
        known = [m for m in LORA_MODULES if m in set(targets)]
        return cls(r=int(config["r"]), alpha=float(config["lora_alpha"]),
                   target_modules=tuple(known + [m for m in targets if m not in LORA_MODULES]), dtype=dtype)

    def peft_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` of this adapter (what vLLM's ``PEFTHelper`` reads)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.alpha,
                "target_modules": list(self.target_modules), "lora_dropout": 0.0, "bias": "none",
                "use_dora": False, "use_rslora": False, "modules_to_save": None,
                "fan_in_fan_out": False, "base_model_name_or_path": ""}

    def dtype_for(self, spec: ModelSpec) -> str:
        return self.dtype or spec.dtype

    # -- the canonical tensors -------------------------------------------------------------
    def tensors(self, spec: ModelSpec) -> list[LoraTensor]:
        """Every adapter matrix of ``spec``, layer by layer, A before B."""
        dtype = self.dtype_for(spec)
        out: list[LoraTensor] = []
        for layer in range(spec.num_layers):
            roles = set(spec.layer_roles(layer))
            for module in self.target_modules:
                role, column = LORA_MODULES[module]
                if role not in roles:
                    continue
                rows, cols = spec.shape(role)
                path = spec.name(role, layer).removesuffix(".weight")
                out.append(LoraTensor(CanonicalTensor(f"{PEFT_PREFIX}{path}.lora_A.weight", (self.r, cols), dtype),
                                      path, "A", None if column else 1))
                out.append(LoraTensor(CanonicalTensor(f"{PEFT_PREFIX}{path}.lora_B.weight", (rows, self.r), dtype),
                                      path, "B", 0 if column else None))
        if not out:
            raise ValueError(f"LoRA target_modules {list(self.target_modules)} match no layer of this "
                             f"{spec.family} model")
        return out

    def canonical(self, spec: ModelSpec) -> dict[str, CanonicalTensor]:
        return {t.tensor.name: t.tensor for t in self.tensors(spec)}

    def nbytes(self, spec: ModelSpec) -> int:
        """Bytes of the whole adapter: what a sync moves, once."""
        return sum(t.tensor.nbytes for t in self.tensors(spec))

    # -- shards ------------------------------------------------------------------------------
    def shards(self, spec: ModelSpec, *, tp: int = 1, tp_rank: int = 0) -> list[Shard]:
        """TP rank ``tp_rank``'s local adapter tensors, each named by its canonical name.

        Splits are even and contiguous, like the base layers' (heads stay whole when the head
        counts divide by ``tp``); a dimension that does not divide is an error naming it.
        """
        if not 0 <= tp_rank < tp:
            raise ValueError(f"LoRA layout: tp_rank {tp_rank} is outside tp={tp}")
        out = []
        for t in self.tensors(spec):
            offsets = [0, 0]
            sizes = list(t.tensor.shape)
            if t.split_dim is not None and tp > 1:
                what = f"{t.tensor.name} dim {t.split_dim}"
                lo, hi = even_bounds(sizes[t.split_dim], tp, what=what)[tp_rank]
                offsets[t.split_dim], sizes[t.split_dim] = lo, hi - lo
            box = Box(tuple(offsets), tuple(sizes))
            out.append(Shard(t.tensor.name, tuple(sizes), t.tensor.dtype,
                             (box_region(t.tensor.name, box, sizes),)))
        return out

    def rank_layout(self, spec: ModelSpec, rank: int, *, tp: int = 1, tp_rank: int = 0,
                    dtype: str | None = None) -> RankLayout:
        """The layout a writer or reader rank publishes (explicit form; adapters are small).

        ``dtype`` overrides the local dtype (a trainer holding fp32 adapters of a bf16 spec).
        """
        shards = self.shards(spec, tp=tp, tp_rank=tp_rank)
        if dtype is not None:
            itemsize(dtype)
            shards = [Shard(s.name, s.shape, dtype, s.regions) for s in shards]
        return RankLayout(rank, tuple(shards), self.canonical(spec))
