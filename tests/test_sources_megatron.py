"""MegatronSource on real megatron-core GPT models: 4 forked gloo ranks on CPU.

Each rank builds its GPTModel stage, then writes known canonical weights into it with the
Hugging Face -> Megatron mapping spelled out by hand below (the one Megatron's own forward
was checked against: grouped ``linear_qkv``, ``[gate_r; up_r]`` fc1, padded vocabulary,
global experts). The source must find every canonical value where it says, in the live
parameters, and its layout must equal the pure ``megatron:`` layout kind.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from _sources import assert_covered, check_source, run_ranks
from weightsync.layout import ModelSpec, parse_layout
from weightsync.plan.reference import random_canonical
from weightsync.sources.param_mapping import same_layout

pytestmark = pytest.mark.xdist_group("sources-megatron")

DENSE = {  # Qwen2: qkv bias; tied embeddings, so with PP the last stage holds a second copy
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 8, "tie_word_embeddings": True, "torch_dtype": "float32",
}
MOE = {  # Qwen3-MoE: q/k norms, 8 experts in every layer
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 8, "num_experts": 8, "mlp_only_layers": [],
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def import_megatron() -> None:
    """Import megatron-core and mbridge (which names its parameters) once, in the test process
    (forked ranks inherit them)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install weightsync[megatron])")
    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install weightsync[megatron])")
    import mbridge.models  # noqa: F401
    import megatron.core.models.gpt
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.post_training.modelopt.gpt.state_dict_hooks  # noqa: F401


def build(hf: dict, *, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = hf["model_type"] == "qwen3_moe"
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], kv_channels=hf["head_dim"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        ffn_hidden_size=hf["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=not moe, qk_layernorm=moe,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **({"num_moe_experts": hf["num_experts"], "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_router_topk": 2, "moe_token_dispatcher_type": "allgather",
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0} if moe else {}),
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=hf.get("num_experts"), qk_layernorm=moe,
                                          normalization="RMSNorm")
    padded = -(-hf["vocab_size"] // (128 * tp)) * 128 * tp  # Megatron-LM's make_vocab_size_divisible_by
    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=padded, max_sequence_length=64,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=hf["tie_word_embeddings"], position_embedding_type="rope")


def megatron_value(name: str, c: dict, spec: ModelSpec, padded_rows: int) -> torch.Tensor:
    """What Megatron stores in local parameter ``name`` on this rank, from HF tensors ``c``."""
    from megatron.core import parallel_state as ps

    tp, t = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, et = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    per_stage = spec.num_layers // ps.get_pipeline_model_parallel_world_size()
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        w = c["lm_head.weight" if name == "output_layer.weight" and not spec.tie_word_embeddings
              else "model.embed_tokens.weight"]
        return F.pad(w, (0, 0, 0, padded_rows - w.shape[0])).chunk(tp)[t]
    if name == "decoder.final_layernorm.weight":
        return c["model.norm.weight"]
    j, rest = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name).groups()
    p = f"model.layers.{ps.get_pipeline_model_parallel_rank() * per_stage + int(j)}."
    whole = {"input_layernorm.weight": "input_layernorm.weight", "pre_mlp_layernorm.weight":
             "post_attention_layernorm.weight", "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attention.k_layernorm.weight": "self_attn.k_norm.weight", "mlp.router.weight": "mlp.gate.weight"}
    if rest in whole:
        return c[p + whole[rest]]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = (c[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
        hd, groups = spec.head_dim, spec.num_kv_heads
        per_group = spec.num_heads // groups
        grouped = [torch.cat([q[g * per_group * hd:(g + 1) * per_group * hd], k[g * hd:(g + 1) * hd],
                              v[g * hd:(g + 1) * hd]]) for g in range(groups)]
        return torch.cat(grouped).chunk(tp)[t]
    if rest == "self_attention.linear_proj.weight":
        return c[p + "self_attn.o_proj.weight"].chunk(tp, 1)[t]
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([c[p + "mlp.gate_proj.weight"].chunk(tp)[t], c[p + "mlp.up_proj.weight"].chunk(tp)[t]])
    if rest == "mlp.linear_fc2.weight":
        return c[p + "mlp.down_proj.weight"].chunk(tp, 1)[t]
    k, fc = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", rest).groups()
    e = ps.get_expert_model_parallel_rank() * (spec.num_experts // ps.get_expert_model_parallel_world_size()) + int(k)
    stack = {x: c[f"{p}mlp.experts.*.{x}_proj.weight"][e] for x in ("gate", "up", "down")}
    if fc == "linear_fc1":
        return torch.cat([stack["gate"].chunk(etp)[et], stack["up"].chunk(etp)[et]])
    return stack["down"].chunk(etp, 1)[et]


def fill_and_check(model: torch.nn.Module, hf: dict, rank: int, kind: str) -> tuple[list, object]:
    from weightsync.sources.megatron import MegatronSource

    source = MegatronSource([model], hf)
    spec = source.spec
    canonical = {n: torch.from_numpy(a) for n, a in random_canonical(spec.canonical_tensors(), seed=3).items()}
    padded = -(-spec.vocab_size // (128 * source.groups.tp[0])) * 128 * source.groups.tp[0]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(megatron_value(name, canonical, spec, padded))
    held = check_source(source, canonical, params)
    assert source.layout().rank == rank
    assert same_layout(source.layout(), parse_layout(kind).rank_layout(spec, rank))
    return held, source.descriptor()


def _dense_rank(rank: int, world: int) -> tuple[list, object, str]:
    from weightsync.sources.megatron import MegatronSource

    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings with PP: Megatron moves them .cuda()
    model = build(DENSE, tp=2, pp=2)
    held, descriptor = fill_and_check(model, DENSE, rank, "megatron:tp=2,pp=2")
    model.decoder.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError) as error:
        MegatronSource(model, DENSE)
    return held, descriptor, str(error.value)


def _moe_rank(rank: int, world: int) -> list[tuple[list, object]]:
    from megatron.core import parallel_state as ps

    out = []
    for etp, kind in ((1, "megatron:tp=2,dp=2,ep=2,etp=1"), (2, "megatron:tp=2,dp=2,ep=2")):
        out.append(fill_and_check(build(MOE, tp=2, pp=1, ep=2, etp=etp), MOE, rank, kind))
        ps.destroy_model_parallel()
    return out


def test_megatron_tp2_pp2_tied_embeddings_qkv_bias_padded_vocab():
    import_megatron()
    results = run_ranks(_dense_rank, 4, timeout=180)
    spec = ModelSpec.from_hf_config(DENSE)
    assert_covered([held for held, _, _ in results], {n: t.shape for n, t in spec.canonical_tensors().items()})
    assert {d[0] for _, d, _ in results} == {"megatron:pp=2,tp=2"}
    assert all("match no canonical tensor of the qwen2 model: ['decoder.extra']" in e for _, _, e in results)
    # the embedding's rows are held on stage 0 and, as a second copy, by stage 1's output_layer
    embed = [sum(box.numel for name, box in held if name == "model.embed_tokens.weight") for held, _, _ in results]
    assert embed == [512 * 64, 488 * 64, 512 * 64, 488 * 64]  # 1000 rows padded to 1024


def test_megatron_moe_ep2_with_expert_tp_1_and_2():
    import_megatron()
    results = run_ranks(_moe_rank, 4, timeout=180)
    spec = ModelSpec.from_hf_config(MOE)
    shapes = {n: t.shape for n, t in spec.canonical_tensors().items()}
    for case in range(2):
        assert_covered([r[case][0] for r in results], shapes)
    assert [r[0][1][0] for r in results] == ["megatron:dp=2,ep=2,etp=1,tp=2"] * 4
    assert [r[1][1][0] for r in results] == ["megatron:dp=2,ep=2,tp=2"] * 4
    # etp=1: experts 0-3 whole on ranks 0 and 2, 4-7 on ranks 1 and 3 (EP along attention TP)
    gate = "model.layers.1.mlp.experts.*.gate_proj.weight"
    firsts = [sorted({box.offsets[0] for name, box in r[0][0] if name == gate}) for r in results]
    assert firsts == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]


def test_te_grouped_experts_without_partition_attributes_match_the_kind():
    """TEGroupedMLP's ``linear_fc1.weight{k}`` carries no partition attributes (no TE on CPU
    to build one): the split follows the name, and equals ``megatron:...,grouped=1``."""
    from types import SimpleNamespace

    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install weightsync[megatron])")
    from weightsync.sources.megatron import Groups, _global_name, _shard, _split
    from weightsync.sources.megatron_names import MegatronNames

    spec = ModelSpec.from_hf_config(MOE)
    kind = parse_layout("megatron:tp=2,dp=2,ep=2,etp=2,grouped=1,dtype=float32")
    rank = 3  # expert-TP rank 1 of EP rank 1: experts 4..7, second half of each ffn
    layer = SimpleNamespace(layer_number=2, mlp=SimpleNamespace(local_expert_indices=[4, 5, 6, 7]))
    model = SimpleNamespace(decoder=SimpleNamespace(layers=[None, layer]))
    groups = Groups(tp=(2, 1), etp=(2, 1), pp=1, dp=2, ep=2, cp=1)
    expected = {s.name: s for s in kind.rank_layout(spec, rank).shards}
    for name, shape in (("decoder.layers.1.mlp.experts.linear_fc1.weight2", (32, 64)),
                        ("decoder.layers.1.mlp.experts.linear_fc2.weight2", (64, 16))):
        parts = MegatronNames.of(spec).parts(_global_name(model, name))
        param = torch.zeros(shape)
        shard = _shard(name, param, parts, _split(name, param, True, groups))
        assert shard.shape == expected[name].shape
        assert set(shard.regions) == set(expected[name].regions)
