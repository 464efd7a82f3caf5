"""Tiny Qwen3 / Qwen3-MoE checkpoints on disk, made without transformers model code.

For self-checks (``weightsync doctor``), examples and tests: a real engine loads them in
seconds. Shapes suit vLLM on CPU (head_dim 32: its CPU attention has no smaller size).
Matrices are drawn N(0, 0.2), so greedy outputs of two seeds differ within a few tokens.
:func:`write_tokenizer` adds a word-level tokenizer for trainers that need one.

    config = tiny_config(moe=False)
    canonical = write_checkpoint(path, config, seed=1)      # config.json + model.safetensors
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from weightsync.layout import ModelSpec, expert_name, is_expert_stack

VOCAB = 512


#: Tiny configs of the frontier families, sized for vLLM's CPU build: its MLA backend takes only
#: DeepSeek's latent sizes (kv_lora_rank 512, qk_rope_head_dim 64), its attention head sizes of 32
#: and up. Each has 2 decoder layers (one dense where the family has dense layers), 4 experts and,
#: where the family has it, one MTP layer.
FRONTIER: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "hidden_act": "silu",
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    },
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "hidden_act": "silu",
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4,
        "num_experts_per_tok": 2, "experts_per_token": 2, "attention_bias": True, "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 7.0, "rope_theta": 150000.0,
        "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 256, "truncate": False},
    },
}


def tiny_config(*, moe: bool = False, tie: bool = False, family: str | None = None) -> dict[str, Any]:
    """A tiny Qwen3 (Qwen3-MoE with ``moe``) config, or one of :data:`FRONTIER` by family name."""
    if family is not None:
        return {**FRONTIER[family], "vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 1024,
                "tie_word_embeddings": tie, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024,
        "tie_word_embeddings": tie, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }
    if moe:
        config.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      norm_topk_prob=True, mlp_only_layers=[])
    return config


def canonical_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random canonical tensors (expert stacks stacked) for ``config``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in ModelSpec.from_hf_config(config).canonical_tensors().items():
        if len(tensor.shape) == 1:  # norms: around 1
            out[name] = 1 + 0.1 * torch.randn(tensor.shape, generator=gen)
        else:
            out[name] = 0.2 * torch.randn(tensor.shape, generator=gen)
    return out


def checkpoint_tensors(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors under checkpoint names (expert stacks split per expert)."""
    out = {}
    for name, tensor in canonical.items():
        if is_expert_stack(name):
            out.update({expert_name(name, e): tensor[e].contiguous() for e in range(tensor.shape[0])})
        else:
            out[name] = tensor
    return out


def write_checkpoint(path: Path, config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Write ``config.json`` + ``model.safetensors``; returns the canonical tensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    canonical = canonical_weights(config, seed)
    save_file(checkpoint_tensors(canonical), str(path / "model.safetensors"))
    return canonical


class CanonicalSource:
    """A training source holding the whole model under checkpoint names (the ``hf`` kind, rank 0):
    a stand-in trainer for self-checks and examples. ``tensors()`` are filled in place.

    ``device``: where the tensors live. A job's ranks all hold their weights on one kind of
    device (:func:`weightsync.tools.devices.choose_transport`), so a stand-in for an engine's trainer
    lives where that engine stages: :meth:`beside`.
    """

    def __init__(self, config: dict[str, Any], *, device: str = "cpu") -> None:
        from weightsync.layout import parse_layout
        from weightsync.tools.torch_layout import allocate

        self.config = dict(config)
        self._kind = parse_layout("hf")
        self._layout = self._kind.rank_layout(ModelSpec.from_hf_config(config), 0)
        self._tensors = allocate(self._layout, device=device)

    @classmethod
    def beside(cls, engine: Any, config: dict[str, Any]) -> CanonicalSource:
        """A source on ``engine``'s device (its ``device`` property: a GPU engine stages on GPU)."""
        return cls(config, device=str(engine.device))

    def layout(self) -> Any:
        return self._layout

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def descriptor(self) -> tuple[str, dict[str, Any]]:
        return self._kind.describe(), self.config


def lora_weights(config: dict[str, Any], lora: Any, seed: int) -> dict[str, torch.Tensor]:
    """Random adapter tensors (PEFT saved names) of ``lora`` (a ``LoraSpec``) on ``config``'s model.

    Both A and B are drawn N(0, 0.2) (PEFT starts B at zero; a trained adapter is not), so
    adapters of two seeds generate differently."""
    from weightsync.tools.torch_layout import torch_dtype

    spec = ModelSpec.from_hf_config(config)
    gen = torch.Generator().manual_seed(seed)
    return {name: (0.2 * torch.randn(t.shape, generator=gen)).to(torch_dtype(t.dtype))
            for name, t in lora.canonical(spec).items()}


def write_adapter(path: Path, config: dict[str, Any], lora: Any, seed: int) -> dict[str, torch.Tensor]:
    """Write a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(lora.peft_config()))
    tensors = lora_weights(config, lora, seed)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return tensors


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer over ``vocab_size`` ids (``<unk>``, ``<s>``, ``</s>``, then ``w3``,
    ``w4``, ...: the word ``wN`` is id N), for trainers that need one (TRL) and no hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<unk>"}))
