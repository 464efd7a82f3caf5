"""Model families as data: which canonical tensors a model has, their names and shapes.

A :class:`ModelSpec` is read from a Hugging Face ``config.json``. Each tensor of a
decoder-only transformer plays a *role* (``q``, ``gate``, ``expert_down``, ...); a family's
name map is a plain table from role to Hugging Face name template. Engine layouts
(``layout/kinds``) speak in roles, so adding a family is adding a table row, and an
architecture no table knows is an error that lists the known ones.

    spec = ModelSpec.from_hf_config(json.load(open("config.json")))
    for name, tensor in spec.canonical_tensors().items(): ...
    spec.name("q", layer=3)  # 'model.layers.3.self_attn.q_proj.weight'
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.layout.types import CanonicalTensor, itemsize

_LLAMA_NAMES: dict[str, str] = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{L}.input_layernorm.weight",
    "post_attn_norm": "model.layers.{L}.post_attention_layernorm.weight",
    "q": "model.layers.{L}.self_attn.q_proj.weight",
    "k": "model.layers.{L}.self_attn.k_proj.weight",
    "v": "model.layers.{L}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{L}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{L}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{L}.self_attn.v_proj.bias",
    "o": "model.layers.{L}.self_attn.o_proj.weight",
    "q_norm": "model.layers.{L}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{L}.self_attn.k_norm.weight",
    "gate": "model.layers.{L}.mlp.gate_proj.weight",
    "up": "model.layers.{L}.mlp.up_proj.weight",
    "down": "model.layers.{L}.mlp.down_proj.weight",
    "router": "model.layers.{L}.mlp.gate.weight",
    "expert_gate": "model.layers.{L}.mlp.experts.*.gate_proj.weight",
    "expert_up": "model.layers.{L}.mlp.experts.*.up_proj.weight",
    "expert_down": "model.layers.{L}.mlp.experts.*.down_proj.weight",
}

_MIXTRAL_NAMES: dict[str, str] = {
    **_LLAMA_NAMES,
    "router": "model.layers.{L}.block_sparse_moe.gate.weight",
    "expert_gate": "model.layers.{L}.block_sparse_moe.experts.*.w1.weight",
    "expert_up": "model.layers.{L}.block_sparse_moe.experts.*.w3.weight",
    "expert_down": "model.layers.{L}.block_sparse_moe.experts.*.w2.weight",
}


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: its name table and which optional tensors it has."""

    name: str
    names: Mapping[str, str]
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False


FAMILIES: Mapping[str, Family] = {
    "llama": Family("llama", _LLAMA_NAMES),
    "qwen2": Family("qwen2", _LLAMA_NAMES, qkv_bias=True),
    "qwen3": Family("qwen3", _LLAMA_NAMES, qk_norm=True),
    "qwen3_moe": Family("qwen3_moe", _LLAMA_NAMES, qk_norm=True, moe=True),
    "mixtral": Family("mixtral", _MIXTRAL_NAMES, moe=True),
}

#: Hugging Face ``architectures[0]`` (or ``model_type``) -> family.
ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The shape facts of a decoder-only transformer that layouts need."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()
    dtype: str = "bfloat16"
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {sorted(FAMILIES)}")
        itemsize(self.dtype)
        for attr in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"model config: {attr} must be positive, got {getattr(self, attr)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if FAMILIES[self.family].moe and self.num_experts <= 0:
            raise ValueError(f"model config: a {self.family} model needs num_experts > 0")

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read a Hugging Face ``config.json`` dict; unknown architectures are an error."""
        archs = list(config.get("architectures") or []) + [config.get("model_type", "")]
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ValueError(
                f"unknown architecture {archs[0] if archs[0] else config.get('model_type')!r}; "
                f"known: {sorted(a for a in ARCHITECTURES if a[0].isupper())}"
            )
        fam = FAMILIES[family]
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            layers = int(config["num_hidden_layers"])
            vocab = int(config["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"model config is missing {exc.args[0]!r}") from None
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        num_experts = 0
        moe_inter = 0
        dense: set[int] = set()
        if fam.moe:
            num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
            moe_inter = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
            step = int(config.get("decoder_sparse_step") or 1)
            dense = {int(x) for x in config.get("mlp_only_layers") or []}
            dense |= {i for i in range(layers) if (i + 1) % step}
            dense |= set(range(int(config.get("first_k_dense_replace") or 0)))
        dtype = _TORCH_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
                                  "bfloat16")
        return cls(
            family=family,
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            vocab_size=vocab,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=fam.qkv_bias or bool(config.get("attention_bias", False)),
            num_experts=num_experts,
            moe_intermediate_size=moe_inter,
            dense_layers=frozenset(dense),
            dtype=dtype,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelSpec:
        """Read ``config.json`` (or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"model config {str(path)!r} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
        return cls.from_hf_config(config)

    # -- queries --------------------------------------------------------------------------
    @property
    def family_info(self) -> Family:
        return FAMILIES[self.family]

    @property
    def is_moe(self) -> bool:
        return self.family_info.moe

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    def name(self, role: str, layer: int | None = None) -> str:
        """Canonical name of ``role`` (in ``layer``); tied ``lm_head`` resolves to the embedding."""
        if role == "lm_head" and self.tie_word_embeddings:
            role = "embed"
        template = self.family_info.names[role]
        return template.format(L=layer) if "{L}" in template else template

    def shape(self, role: str) -> tuple[int, ...]:
        h, hd = self.hidden_size, self.head_dim
        q_rows, kv_rows = self.num_heads * hd, self.num_kv_heads * hd
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (self.vocab_size, h),
            "lm_head": (self.vocab_size, h),
            "final_norm": (h,),
            "input_norm": (h,),
            "post_attn_norm": (h,),
            "q": (q_rows, h),
            "k": (kv_rows, h),
            "v": (kv_rows, h),
            "q_bias": (q_rows,),
            "k_bias": (kv_rows,),
            "v_bias": (kv_rows,),
            "o": (h, q_rows),
            "q_norm": (hd,),
            "k_norm": (hd,),
            "gate": (self.intermediate_size, h),
            "up": (self.intermediate_size, h),
            "down": (h, self.intermediate_size),
            "router": (self.num_experts, h),
            "expert_gate": (self.num_experts, self.moe_intermediate_size, h),
            "expert_up": (self.num_experts, self.moe_intermediate_size, h),
            "expert_down": (self.num_experts, h, self.moe_intermediate_size),
        }
        return shapes[role]

    def layer_roles(self, layer: int) -> tuple[str, ...]:
        """The roles present in ``layer``, in a fixed order."""
        fam = self.family_info
        roles = ["input_norm", "q", "k", "v"]
        if self.attention_bias:
            roles += ["q_bias", "k_bias", "v_bias"]
        if fam.qk_norm:
            roles += ["q_norm", "k_norm"]
        roles += ["o", "post_attn_norm"]
        if self.is_moe_layer(layer):
            roles += ["router", "expert_gate", "expert_up", "expert_down"]
        else:
            roles += ["gate", "up", "down"]
        return tuple(roles)

    def tensor(self, role: str, layer: int | None = None) -> CanonicalTensor:
        return self.canonical_tensors()[self.name(role, layer)]

    def canonical_tensors(self) -> dict[str, CanonicalTensor]:
        """All canonical tensors, in checkpoint order; one dict shared by every caller."""
        cached = self._cache.get("canonical")
        if cached is None:
            cached = {}
            def add(role: str, layer: int | None = None) -> None:
                name = self.name(role, layer)
                cached[name] = CanonicalTensor(name, self.shape(role), self.dtype)
            add("embed")
            for layer in range(self.num_layers):
                for role in self.layer_roles(layer):
                    add(role, layer)
            add("final_norm")
            if not self.tie_word_embeddings:
                add("lm_head")
            self._cache["canonical"] = cached
        return cached

    def roles(self) -> dict[str, tuple[str, int | None]]:
        """Canonical name -> (role, layer) for every canonical tensor (cached)."""
        cached = self._cache.get("roles")
        if cached is None:
            cached = {self.name("embed"): ("embed", None), self.name("final_norm"): ("final_norm", None)}
            if not self.tie_word_embeddings:
                cached[self.name("lm_head")] = ("lm_head", None)
            for layer in range(self.num_layers):
                for role in self.layer_roles(layer):
                    cached[self.name(role, layer)] = (role, layer)
            self._cache["roles"] = cached
        return cached

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.canonical_tensors().values())

    def to_hf_config(self) -> dict[str, Any]:
        """A minimal ``config.json`` that reads back to this spec."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[self.family]
        cfg: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }
        if self.family == "llama" and self.attention_bias:
            cfg["attention_bias"] = True
        if self.is_moe:
            cfg["num_experts" if self.family != "mixtral" else "num_local_experts"] = self.num_experts
            cfg["moe_intermediate_size"] = self.moe_intermediate_size
            cfg["mlp_only_layers"] = sorted(self.dense_layers)
        return cfg
