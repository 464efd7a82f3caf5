"""Model families as data: the checkpoint name of every tensor *role*, per family.

Each tensor of a decoder-only transformer plays a role (``q``, ``kv_b``, ``expert_down``,
``mtp_eh_proj``, ...). A family is a table from role to its Hugging Face name template plus
the few switches that say which roles its layers have. Adding a family is a table and a row
of :data:`ARCHITECTURES`; the shapes (``ModelSpec.shape``) and the layout kinds work in roles.

The families beyond Llama/Qwen/Mixtral:

* ``deepseek_v3`` (DeepSeek-V3, Kimi-K2): multi-head latent attention (``q_a_proj`` +
  ``q_a_layernorm`` + ``q_b_proj``, or ``q_proj`` without a query LoRA; ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``), dense layers before ``first_k_dense_replace``, shared
  experts, the router's ``e_score_correction_bias`` (float32, with ``topk_method: noaux_tc``)
  and the MTP layers, numbered from ``num_hidden_layers`` (``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.norm`` and a whole decoder layer).
* ``glm4_moe`` (GLM-4.5/4.6): GQA with q/k/v biases, optional QK norm, shared experts, the
  correction bias, dense first layers and MTP layers like DeepSeek's.
* ``gpt_oss``: q/k/v/o biases, per-head attention ``sinks``, a router with a bias, and experts
  stored whole as checkpoint tensors (``experts.gate_up_proj [E, H, 2I]``, gate and up
  columns interleaved, with ``gate_up_proj_bias``, ``down_proj [E, I, H]``, ``down_proj_bias``).

An MTP layer's ``embed_tokens`` and ``shared_head.head`` are the model's embedding and output
head (DeepSeek-V3 shares them, and vLLM's MTP drafter uses the target's modules), so they
are not canonical tensors of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

_L = "model.layers.{L}."

_LLAMA_NAMES: dict[str, str] = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": _L + "input_layernorm.weight",
    "post_attn_norm": _L + "post_attention_layernorm.weight",
    "q": _L + "self_attn.q_proj.weight",
    "k": _L + "self_attn.k_proj.weight",
    "v": _L + "self_attn.v_proj.weight",
    "q_bias": _L + "self_attn.q_proj.bias",
    "k_bias": _L + "self_attn.k_proj.bias",
    "v_bias": _L + "self_attn.v_proj.bias",
    "o": _L + "self_attn.o_proj.weight",
    "q_norm": _L + "self_attn.q_norm.weight",
    "k_norm": _L + "self_attn.k_norm.weight",
    "gate": _L + "mlp.gate_proj.weight",
    "up": _L + "mlp.up_proj.weight",
    "down": _L + "mlp.down_proj.weight",
    "router": _L + "mlp.gate.weight",
    "expert_gate": _L + "mlp.experts.*.gate_proj.weight",
    "expert_up": _L + "mlp.experts.*.up_proj.weight",
    "expert_down": _L + "mlp.experts.*.down_proj.weight",
}

_MIXTRAL_NAMES: dict[str, str] = {
    **_LLAMA_NAMES,
    "router": _L + "block_sparse_moe.gate.weight",
    "expert_gate": _L + "block_sparse_moe.experts.*.w1.weight",
    "expert_up": _L + "block_sparse_moe.experts.*.w3.weight",
    "expert_down": _L + "block_sparse_moe.experts.*.w2.weight",
}

#: Shared experts, the router's correction bias and the MTP layer (DeepSeek-V3, GLM-4.5).
_DEEPSEEK_MOE_NAMES: dict[str, str] = {
    "router_correction": _L + "mlp.gate.e_score_correction_bias",
    "shared_gate": _L + "mlp.shared_experts.gate_proj.weight",
    "shared_up": _L + "mlp.shared_experts.up_proj.weight",
    "shared_down": _L + "mlp.shared_experts.down_proj.weight",
    "mtp_enorm": _L + "enorm.weight",
    "mtp_hnorm": _L + "hnorm.weight",
    "mtp_eh_proj": _L + "eh_proj.weight",
    "mtp_head_norm": _L + "shared_head.norm.weight",
}

_DEEPSEEK_NAMES: dict[str, str] = {
    **_LLAMA_NAMES,
    **_DEEPSEEK_MOE_NAMES,
    "q_a": _L + "self_attn.q_a_proj.weight",
    "q_a_norm": _L + "self_attn.q_a_layernorm.weight",
    "q_b": _L + "self_attn.q_b_proj.weight",
    "kv_a": _L + "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": _L + "self_attn.kv_a_layernorm.weight",
    "kv_b": _L + "self_attn.kv_b_proj.weight",
}

_GPT_OSS_NAMES: dict[str, str] = {
    **_LLAMA_NAMES,
    "o_bias": _L + "self_attn.o_proj.bias",
    "sinks": _L + "self_attn.sinks",
    "router": _L + "mlp.router.weight",
    "router_bias": _L + "mlp.router.bias",
    "experts_gate_up": _L + "mlp.experts.gate_up_proj",
    "experts_gate_up_bias": _L + "mlp.experts.gate_up_proj_bias",
    "experts_down": _L + "mlp.experts.down_proj",
    "experts_down_bias": _L + "mlp.experts.down_proj_bias",
}


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: its name table and which optional tensors it has.

    ``attention`` is ``"gqa"`` (q/k/v/o) or ``"mla"`` (latent attention); ``experts`` is
    ``"stacked"`` (one checkpoint tensor per expert matrix, canonical stacks ``experts.*``)
    or ``"whole"`` (gpt-oss: the checkpoint holds every expert in one tensor, with biases).

    ``qkv_bias`` and ``o_bias`` say whether the q/k/v and the output projections carry biases
    the way vLLM's model of the family decides it: ``True`` always, ``False`` never, or the
    name of the config switch that decides it (absent from a config: no bias, its default in
    transformers and vLLM).
    """

    name: str
    names: Mapping[str, str]
    architecture: str
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    sinks: bool = False  # per-head attention sinks
    qk_norm: bool = False
    moe: bool = False
    attention: str = "gqa"
    experts: str = "stacked"
    #: the HF config key holding the number of routed experts
    experts_key: str = "num_experts"


FAMILIES: Mapping[str, Family] = {
    # vLLM's Llama: attention_bias (or bias) puts biases on q/k/v and o_proj alike
    "llama": Family("llama", {**_LLAMA_NAMES, "o_bias": _L + "self_attn.o_proj.bias"}, "LlamaForCausalLM",
                    qkv_bias="attention_bias", o_bias="attention_bias"),
    "qwen2": Family("qwen2", _LLAMA_NAMES, "Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("qwen3", _LLAMA_NAMES, "Qwen3ForCausalLM", qkv_bias="attention_bias", qk_norm=True),
    "qwen3_moe": Family("qwen3_moe", _LLAMA_NAMES, "Qwen3MoeForCausalLM", qkv_bias="attention_bias", qk_norm=True,
                        moe=True),
    "mixtral": Family("mixtral", _MIXTRAL_NAMES, "MixtralForCausalLM", moe=True, experts_key="num_local_experts"),
    "deepseek_v3": Family("deepseek_v3", _DEEPSEEK_NAMES, "DeepseekV3ForCausalLM", moe=True, attention="mla",
                          experts_key="n_routed_experts"),
    "glm4_moe": Family("glm4_moe", {**_LLAMA_NAMES, **_DEEPSEEK_MOE_NAMES}, "Glm4MoeForCausalLM",
                       qkv_bias="attention_bias", moe=True, experts_key="n_routed_experts"),
    "gpt_oss": Family("gpt_oss", _GPT_OSS_NAMES, "GptOssForCausalLM", qkv_bias=True, o_bias=True, sinks=True, moe=True,
                      experts="whole", experts_key="num_local_experts"),
}

#: Config switches a family's config may hold that change its tensors in ways no role expresses:
#: refused by name rather than ignored (vLLM's Llama reads ``mlp_bias``).
UNSUPPORTED_SWITCHES: Mapping[str, tuple[str, ...]] = {"llama": ("mlp_bias",)}

#: Hugging Face ``architectures[0]`` (or ``model_type``) -> family. Kimi-K2 checkpoints name
#: ``DeepseekV3ForCausalLM`` (model type ``kimi_k2``).
ARCHITECTURES: Mapping[str, str] = {
    **{f.architecture: f.name for f in FAMILIES.values()},
    "MistralForCausalLM": "llama",
    **{name: name for name in FAMILIES},
    "mistral": "llama",
    "kimi_k2": "deepseek_v3",
}

#: Roles whose tensor is float32 whatever the model's dtype (DeepSeek-V3 keeps the router's
#: correction bias in float32; transformers' ``_keep_in_fp32_modules_strict``, vLLM's parameter).
FLOAT32_ROLES = frozenset({"router_correction"})

#: Roles transformers keeps as buffers, not parameters: training frameworks update them outside
#: the optimizer (the router's load-balancing bias), FSDP2 and ZeRO-3 leave them whole on every rank.
BUFFER_ROLES = frozenset({"router_correction"})

#: Roles of the MTP layer that a decoder layer does not have.
MTP_ROLES = ("mtp_enorm", "mtp_hnorm", "mtp_eh_proj", "mtp_head_norm")
