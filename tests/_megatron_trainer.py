"""A Megatron-core training rank of a frontier family (DeepSeek-V3, GLM-4.5, gpt-oss), MTP layers included,
writing versions through ``MegatronSource``; and the helpers ``tests/test_megatron_frontier.py``
builds its forked ranks with.

    WEIGHTSYNC_META_ADDR=... WEIGHTSYNC_META_TOKEN=... MASTER_ADDR=127.0.0.1 MASTER_PORT=...
    python tests/_megatron_trainer.py --config '<hf config json>' --parallel '{"tp": 2, ...}' \
        --rank R --world 4 --seeds 1,2 --job j

The rank builds its stage of a real megatron-core ``GPTModel`` (the local spec, with the CPU shims
of :func:`cpu_shims`). Version ``i`` holds ``weightsync.tools.tiny.canonical_weights(config, seeds[i - 1])``,
put into the model as mbridge's ``load_weights`` does (:func:`load_like_mbridge`).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.nn.functional as F

from _frontier_trainer import run_rank
from weightsync.layout import ModelSpec


def cpu_shims() -> None:
    """The test-only device shim of ``tests/test_megatron_frontier.py``'s docstring (in trainer
    processes only: the test process is untouched)."""
    import megatron.core.transformer.multi_latent_attention as mla

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    mla.HAVE_TE = False
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def gpt_oss_config(hf: dict[str, Any], par: dict[str, int]) -> Any:
    """megatron-bridge's gpt-oss provider settings that shape the weights (routing and fusions change none):
    sinks (``softmax_type="learnable"``), biases everywhere, every other layer a sliding window."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"], kv_channels=hf["head_dim"], ffn_hidden_size=hf["intermediate_size"],
        moe_ffn_hidden_size=hf["intermediate_size"], num_moe_experts=hf["num_local_experts"],
        moe_router_topk=hf["num_experts_per_tok"], gated_linear_unit=True, activation_func=quick_gelu,
        glu_linear_offset=1.0, activation_func_clamp_value=hf["swiglu_limit"], normalization="RMSNorm",
        add_bias_linear=True, softmax_type="learnable", window_size=(hf["sliding_window"] - 1, 0),
        window_attn_skip_freq=2, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=par["tp"],
        pipeline_model_parallel_size=par["pp"], expert_model_parallel_size=par["ep"],
        expert_tensor_parallel_size=par["etp"], moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def transformer_config(hf: dict[str, Any], par: dict[str, int]) -> Any:
    """The megatron-core config a trainer of ``hf`` writes (routing settings change no weight)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    if hf["model_type"] == "gpt_oss":
        return gpt_oss_config(hf, par)
    layers, dense = hf["num_hidden_layers"], hf["first_k_dense_replace"]
    common: dict[str, Any] = {
        "num_layers": layers, "hidden_size": hf["hidden_size"], "num_attention_heads": hf["num_attention_heads"],
        "ffn_hidden_size": hf["intermediate_size"], "gated_linear_unit": True, "activation_func": F.silu,
        "normalization": "RMSNorm", "add_bias_linear": False, "use_cpu_initialization": True, "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32, "bias_activation_fusion": False, "bias_dropout_fusion": False,
        "masked_softmax_fusion": False, "apply_rope_fusion": False, "persist_layer_norm": False,
        "gradient_accumulation_fusion": False, "tensor_model_parallel_size": par["tp"],
        "pipeline_model_parallel_size": par["pp"], "expert_model_parallel_size": par["ep"],
        "expert_tensor_parallel_size": par["etp"], "num_moe_experts": hf["n_routed_experts"],
        "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_router_topk": hf["num_experts_per_tok"],
        "moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        "moe_shared_expert_intermediate_size": hf["moe_intermediate_size"] * hf["n_shared_experts"],
        "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid", "moe_router_dtype": "fp32",
        "mtp_num_layers": hf["num_nextn_predict_layers"], "qk_layernorm": True,
    }
    if hf["model_type"] == "deepseek_v3":
        return MLATransformerConfig(**common, multi_latent_attention=True, q_lora_rank=hf["q_lora_rank"],
                                    kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
                                    qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                                    rope_type="rope")
    return TransformerConfig(**common, num_query_groups=hf["num_key_value_heads"], kv_channels=hf["head_dim"],
                             add_qkv_bias=True)


def build(hf: dict[str, Any], par: dict[str, int]) -> torch.nn.Module:
    """This rank's stage of a megatron-core GPTModel of ``hf`` (local spec, MTP on the last stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    ps.initialize_model_parallel(tensor_model_parallel_size=par["tp"], pipeline_model_parallel_size=par["pp"],
                                 expert_model_parallel_size=par["ep"], expert_tensor_parallel_size=par["etp"])
    config = transformer_config(hf, par)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    layer = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       pp_rank=par["pp"] - 1).layer_specs[-1]
    if config.multi_latent_attention:  # shim 3 (see cpu_shims)
        for spec in [*block.layer_specs, layer]:
            spec.submodules.self_attention.submodules.core_attention = IdentityOp
    mtp = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False) if config.mtp_num_layers else None
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=hf["vocab_size"], max_sequence_length=64,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    position_embedding_type="rope", mtp_block_spec=mtp)


def load_like_mbridge(model: torch.nn.Module, spec: ModelSpec, canonical: dict[str, torch.Tensor]) -> None:
    """Put the checkpoint into ``model`` with mbridge's own conversion and TP split of each tensor
    (what its ``load_weights`` does, without the scatter from TP rank 0)."""
    from megatron.core import parallel_state as ps

    from weightsync.sources.megatron import _WHOLE_EXPERT, _global_name, _tensors
    from weightsync.sources.megatron_names import MegatronNames

    names = MegatronNames.of(spec)
    bridge = copy.copy(names.bridge)  # the real hidden size: these are the real tensors, not probes
    bridge.hf_config = copy.copy(bridge.hf_config)
    bridge.hf_config.hidden_size = spec.hidden_size
    with torch.no_grad():
        for name, tensor in _tensors(model).items():
            whole = _WHOLE_EXPERT.fullmatch(_global_name(model, name)) if spec.family_info.experts == "whole" else None
            if whole is not None:
                tensor.copy_(_gpt_oss_expert(canonical, spec, whole))
                continue
            found = names.resolve(_global_name(model, name))
            assert found is not None, name
            hf = [canonical[t.name] if e is None else canonical[t.name][e]
                  for t, e in zip(found.tensors, found.experts, strict=True)]
            whole = bridge._weight_to_mcore_format(found.te_name, hf)
            if ".experts." in name:
                size, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
            else:
                size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            tensor.copy_(bridge._weight_split_across_tp(found.te_name, whole, tensor, size)[rank])


def _gpt_oss_expert(canonical: dict[str, torch.Tensor], spec: ModelSpec, match: Any) -> torch.Tensor:
    """This rank's slice of a gpt-oss expert's parameter, as megatron-bridge's gpt-oss bridge loads it: fc1
    ``[gate; up]`` de-interleaved from ``gate_up_proj``'s columns and transposed, fc2 ``down_proj`` transposed;
    fc1 split ``[gate_r; up_r]`` and fc2 by columns over expert TP (its bias whole)."""
    from megatron.core import parallel_state as ps

    layer, fc, attr, expert = int(match[1]), match[2], match[3], int(match[4])
    size, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    if fc == "linear_fc1":
        packed = canonical[spec.tensor("experts_gate_up" + ("_bias" if attr == "bias" else ""), layer).name][expert]
        gate, up = packed[..., 0::2], packed[..., 1::2]
        gate, up = (gate.t(), up.t()) if attr == "weight" else (gate, up)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    if attr == "bias":
        return canonical[spec.tensor("experts_down_bias", layer).name][expert]
    return canonical[spec.tensor("experts_down", layer).name][expert].t().chunk(size, dim=1)[rank]


def megatron_rank(config: dict[str, Any], args: Any) -> tuple[Any, Any]:
    """This rank's stage of the megatron-core model of ``config`` at ``args.parallel``; its step
    loads the weights as mbridge does."""
    from weightsync.sources.megatron import MegatronSource
    from weightsync.tools.tiny import canonical_weights

    cpu_shims()
    model = build(config, args.parallel)
    spec = ModelSpec.from_hf_config(config)
    return (MegatronSource(model, config, rank=args.rank),
            lambda seed: load_like_mbridge(model, spec, canonical_weights(config, seed)))


def main() -> int:
    from megatron.core import parallel_state as ps

    return run_rank(megatron_rank, "parallel", close=ps.destroy_model_parallel)


if __name__ == "__main__":
    sys.exit(main())
