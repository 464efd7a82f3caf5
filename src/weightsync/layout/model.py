"""The canonical model: which tensors a model has, their checkpoint names and shapes.

A :class:`ModelSpec` is read from a Hugging Face ``config.json``. Each tensor of a
decoder-only transformer plays a *role* (``q``, ``gate``, ``expert_down``, ...); each family's
name map (``layout/families.py``) is a plain table from role to Hugging Face name template.
Engine layouts (``layout/kinds``) speak in roles, so adding a family is adding a table, and an
architecture no table knows is an error that lists the known ones.

    spec = ModelSpec.from_hf_config(json.load(open("config.json")))
    for name, tensor in spec.canonical_tensors().items(): ...
    spec.name("q", layer=3)  # 'model.layers.3.self_attn.q_proj.weight'
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.layout.families import (
    ARCHITECTURES,
    FAMILIES,
    FLOAT32_ROLES,
    MTP_ROLES,
    UNSUPPORTED_SWITCHES,
    Family,
)
from weightsync.layout.types import CanonicalTensor, itemsize

__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "ModelSpec"]

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The shape facts of a decoder-only transformer that layouts need.

    Latent attention (``kv_lora_rank > 0``) uses ``q_lora_rank`` (0: a plain ``q_proj``),
    ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim`` instead of ``head_dim``.
    ``mtp_layers`` MTP layers follow the decoder layers, numbered from ``num_layers``.
    """

    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # q/k/v biases (None: the family's rule, or none)
    o_bias: bool | None = None  # the output projection's bias (likewise)
    qk_norm: bool | None = None  # None: the family's default
    num_experts: int = 0
    moe_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()
    shared_intermediate_size: int = 0
    score_correction: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    dtype: str = "bfloat16"
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {sorted(FAMILIES)}")
        fam = FAMILIES[self.family]
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", fam.qk_norm)
        for attr, rule in (("attention_bias", fam.qkv_bias), ("o_bias", fam.o_bias)):
            if getattr(self, attr) is None:
                object.__setattr__(self, attr, rule is True)
            elif isinstance(rule, bool) and getattr(self, attr) != rule:
                raise ValueError(f"model config: a {self.family} model {'always' if rule else 'never'} has "
                                 f"{'q/k/v' if attr == 'attention_bias' else 'output projection'} biases in vLLM, "
                                 f"got {attr}={getattr(self, attr)}")
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
        if self.is_mla and min(self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim) <= 0:
            raise ValueError(f"model config: a {self.family} model needs kv_lora_rank, qk_rope_head_dim and "
                             f"v_head_dim > 0 (multi-head latent attention), got {self.kv_lora_rank}, "
                             f"{self.qk_rope_head_dim}, {self.v_head_dim}")

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
        for switch in UNSUPPORTED_SWITCHES.get(family, ()):
            if config.get(switch):
                raise ValueError(f"model config: {switch}={config[switch]!r} is not supported for {family} models "
                                 "(weightsync has no role for the tensors it adds)")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            layers = int(config["num_hidden_layers"])
            vocab = int(config["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"model config is missing {exc.args[0]!r}") from None
        dtype = _TORCH_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), "bfloat16")
        return cls(
            family=family,
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=_switch(fam.qkv_bias, config),
            o_bias=_switch(fam.o_bias, config),
            qk_norm=bool(config["use_qk_norm"]) if "use_qk_norm" in config else fam.qk_norm,
            dtype=dtype,
            **_moe_fields(fam, config, layers),
            **_mla_fields(fam, config),
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

    @property
    def is_mla(self) -> bool:
        return self.family_info.attention == "mla"

    @property
    def total_layers(self) -> int:
        """Decoder layers plus MTP layers (these are numbered after the decoder layers)."""
        return self.num_layers + self.mtp_layers

    def is_mtp_layer(self, layer: int) -> bool:
        return layer >= self.num_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    def name(self, role: str, layer: int | None = None) -> str:
        """Canonical name of ``role`` (in ``layer``); tied ``lm_head`` resolves to the embedding."""
        if role == "lm_head" and self.tie_word_embeddings:
            role = "embed"
        template = self.family_info.names[role]
        return template.format(L=layer) if "{L}" in template else template

    def shape(self, role: str) -> tuple[int, ...]:
        h, hd, heads = self.hidden_size, self.head_dim, self.num_heads
        e, ie, i = self.num_experts, self.moe_intermediate_size, self.intermediate_size
        if self.is_mla:
            q_rows, o_cols = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim), heads * self.v_head_dim
        else:
            q_rows, o_cols = heads * hd, heads * hd
        kv_rows = self.num_kv_heads * hd
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (self.vocab_size, h), "lm_head": (self.vocab_size, h),
            "final_norm": (h,), "input_norm": (h,), "post_attn_norm": (h,),
            "q": (q_rows, h), "k": (kv_rows, h), "v": (kv_rows, h),
            "q_bias": (q_rows,), "k_bias": (kv_rows,), "v_bias": (kv_rows,),
            "o": (h, o_cols), "o_bias": (h,), "sinks": (heads,),
            "q_norm": (hd,), "k_norm": (hd,),
            "q_a": (self.q_lora_rank, h), "q_a_norm": (self.q_lora_rank,), "q_b": (q_rows, self.q_lora_rank),
            "kv_a": (self.kv_lora_rank + self.qk_rope_head_dim, h), "kv_a_norm": (self.kv_lora_rank,),
            "kv_b": (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            "gate": (i, h), "up": (i, h), "down": (h, i),
            "router": (e, h), "router_bias": (e,), "router_correction": (e,),
            "expert_gate": (e, ie, h), "expert_up": (e, ie, h), "expert_down": (e, h, ie),
            "experts_gate_up": (e, h, 2 * ie), "experts_gate_up_bias": (e, 2 * ie),
            "experts_down": (e, ie, h), "experts_down_bias": (e, h),
            "shared_gate": (self.shared_intermediate_size, h), "shared_up": (self.shared_intermediate_size, h),
            "shared_down": (h, self.shared_intermediate_size),
            "mtp_enorm": (h,), "mtp_hnorm": (h,), "mtp_eh_proj": (h, 2 * h), "mtp_head_norm": (h,),
        }
        return shapes[role]

    def layer_roles(self, layer: int) -> tuple[str, ...]:
        """The roles present in ``layer`` (an MTP layer too), in a fixed order."""
        key = f"roles{layer}"
        cached = self._cache.get(key)
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        fam = self.family_info
        roles = list(MTP_ROLES[:3]) if self.is_mtp_layer(layer) else []
        roles.append("input_norm")
        if self.is_mla:
            roles += ["q_a", "q_a_norm", "q_b"] if self.q_lora_rank else ["q"]
            roles += ["kv_a", "kv_a_norm", "kv_b"]
        else:
            roles += ["q", "k", "v"]
            if self.attention_bias:
                roles += ["q_bias", "k_bias", "v_bias"]
            if self.qk_norm:
                roles += ["q_norm", "k_norm"]
        roles.append("o")
        if self.o_bias:
            roles.append("o_bias")
        if fam.sinks:
            roles.append("sinks")
        roles.append("post_attn_norm")
        if not self.is_moe_layer(layer):
            roles += ["gate", "up", "down"]
        elif fam.experts == "whole":
            roles += ["router", "router_bias", "experts_gate_up", "experts_gate_up_bias", "experts_down",
                      "experts_down_bias"]
        else:
            roles.append("router")
            if self.score_correction:
                roles.append("router_correction")
            roles += ["expert_gate", "expert_up", "expert_down"]
            if self.shared_intermediate_size:
                roles += ["shared_gate", "shared_up", "shared_down"]
        if self.is_mtp_layer(layer):
            roles.append(MTP_ROLES[3])
        out = tuple(roles)
        self._cache[key] = out
        return out

    def tensor(self, role: str, layer: int | None = None) -> CanonicalTensor:
        return self.canonical_tensors()[self.name(role, layer)]

    def canonical_tensors(self) -> dict[str, CanonicalTensor]:
        """All canonical tensors, in checkpoint order; one dict shared by every caller."""
        cached = self._cache.get("canonical")
        if cached is None:
            cached = {}
            for name, (role, _) in self.roles().items():
                cached[name] = CanonicalTensor(name, self.shape(role),
                                               "float32" if role in FLOAT32_ROLES else self.dtype)
            self._cache["canonical"] = cached
        return cached  # type: ignore[no-any-return]

    def roles(self) -> dict[str, tuple[str, int | None]]:
        """Canonical name -> (role, layer) for every canonical tensor, in checkpoint order (cached)."""
        cached = self._cache.get("roles")
        if cached is None:
            cached = {self.name("embed"): ("embed", None)}
            for layer in range(self.total_layers):
                for role in self.layer_roles(layer):
                    cached[self.name(role, layer)] = (role, layer)
            cached[self.name("final_norm")] = ("final_norm", None)
            if not self.tie_word_embeddings:
                cached[self.name("lm_head")] = ("lm_head", None)
            self._cache["roles"] = cached
        return cached  # type: ignore[no-any-return]

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.canonical_tensors().values())

    def without_mtp(self) -> ModelSpec:
        """The same model without its MTP layers (an engine that does not run them)."""
        return self if not self.mtp_layers else dataclasses.replace(self, mtp_layers=0, _cache={})

    def to_hf_config(self) -> dict[str, Any]:
        """A minimal ``config.json`` that reads back to this spec."""
        fam = self.family_info
        cfg: dict[str, Any] = {
            "architectures": [fam.architecture],
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
        for switch, value in ((fam.qkv_bias, self.attention_bias), (fam.o_bias, self.o_bias)):
            if isinstance(switch, str):
                cfg[switch] = bool(value)
        if self.qk_norm != fam.qk_norm:
            cfg["use_qk_norm"] = self.qk_norm
        if self.is_moe:
            cfg[fam.experts_key] = self.num_experts
            if fam.experts == "whole":
                cfg["intermediate_size"] = self.moe_intermediate_size
            else:
                cfg["moe_intermediate_size"] = self.moe_intermediate_size
                cfg["mlp_only_layers"] = sorted(self.dense_layers)
                if fam.experts_key == "n_routed_experts" and self.dense_layers == set(range(len(self.dense_layers))):
                    cfg["first_k_dense_replace"] = len(self.dense_layers)  # what DeepSeek/GLM engines read
        if self.shared_intermediate_size:
            cfg["n_shared_experts"] = self.shared_intermediate_size // self.moe_intermediate_size
        if self.score_correction:
            cfg["topk_method"] = "noaux_tc"
        if self.is_mla:
            cfg.update(q_lora_rank=self.q_lora_rank or None, kv_lora_rank=self.kv_lora_rank,
                       qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                       v_head_dim=self.v_head_dim)
        if self.mtp_layers:
            cfg["num_nextn_predict_layers"] = self.mtp_layers
        return cfg


def _switch(rule: bool | str, config: Mapping[str, Any]) -> bool:
    """A family's rule for an optional tensor (:class:`Family`): fixed, or read from a config switch."""
    return bool(config.get(rule, False)) if isinstance(rule, str) else rule


def _moe_fields(fam: Family, config: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Experts, dense layers, shared experts and the router's correction bias of an MoE config."""
    if not fam.moe:
        return {}
    experts = int(config.get(fam.experts_key) or config.get("num_experts") or config.get("num_local_experts") or 0)
    if fam.experts == "whole":  # gpt-oss: intermediate_size is the experts' size, every layer MoE
        return {"num_experts": experts, "moe_intermediate_size": int(config.get("intermediate_size") or 0)}
    moe_inter = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    dense = {int(x) for x in config.get("mlp_only_layers") or []}
    dense |= {i for i in range(layers) if (i + 1) % step}
    dense |= set(range(int(config.get("first_k_dense_replace") or 0)))
    freq = int(config.get("moe_layer_freq") or 1)  # DeepSeek: MoE where layer % freq == 0
    dense |= {i for i in range(layers) if i % freq}
    mtp = int(config.get("num_nextn_predict_layers") or 0) if "mtp_enorm" in fam.names else 0
    # vLLM's GLM-4.5 always has the correction bias; DeepSeek's only with noaux_tc routing
    correction = fam.name == "glm4_moe" or config.get("topk_method") == "noaux_tc"
    return {
        "num_experts": experts,
        "moe_intermediate_size": moe_inter,
        "dense_layers": frozenset(dense),
        "shared_intermediate_size": int(config.get("n_shared_experts") or 0) * moe_inter,
        "score_correction": correction,
        "mtp_layers": mtp,
    }


def _mla_fields(fam: Family, config: Mapping[str, Any]) -> dict[str, Any]:
    if fam.attention != "mla":
        return {}
    return {
        "q_lora_rank": int(config.get("q_lora_rank") or 0),
        "kv_lora_rank": int(config.get("kv_lora_rank") or 0),
        "qk_nope_head_dim": int(config.get("qk_nope_head_dim") or 0),
        "qk_rope_head_dim": int(config.get("qk_rope_head_dim") or 0),
        "v_head_dim": int(config.get("v_head_dim") or 0),
    }
