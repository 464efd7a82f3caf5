"""Every layout builder and kind, checked against local tensors built by hand with numpy.

For each case the expected local tensor is written out with explicit slicing and
concatenation of the canonical values (what the engine really stores), and compared with
what the layout's regions cut out of the same canonical values.
"""

from __future__ import annotations

import numpy as np
import pytest

from weightsync.layout import Box, CanonicalTensor, ModelSpec, parse_layout
from weightsync.layout.builders import flat_partition, kv_head_range, replicated, split, vocab_parallel
from weightsync.layout.kinds.megatron import stage_layers
from weightsync.plan.reference import cut_shards, random_canonical, view

GQA = ModelSpec(family="qwen3", hidden_size=16, intermediate_size=24, num_layers=3, num_heads=8,
                num_kv_heads=2, head_dim=4, vocab_size=100, dtype="float32")
MOE = ModelSpec(family="qwen3_moe", hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=4, vocab_size=50, num_experts=8, moe_intermediate_size=6,
                dense_layers=frozenset({0}), dtype="float32")
QWEN2 = ModelSpec(family="qwen2", hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=4, vocab_size=50, attention_bias=True, dtype="float32",
                  tie_word_embeddings=True)


def local(spec, kind, rank):
    layout = parse_layout(kind)
    layout.validate(spec)
    rl = layout.rank_layout(spec, rank)
    values = random_canonical(spec.canonical_tensors(), seed=1)
    shards = cut_shards(rl, values)
    return {s.name: shards[s.name].reshape(s.shape) for s in rl.shards}, values, rl


def W(values, role_name):
    return values[role_name]


# -- builders ---------------------------------------------------------------------------

def test_replicated_and_split():
    t = CanonicalTensor("w", (6, 4), "float32")
    vals = {"w": np.arange(24, dtype=np.float32).reshape(6, 4)}
    from weightsync.layout.types import RankLayout
    for shard, expected in [
        (replicated(t, "w"), vals["w"]),
        (split(t, "w", dim=0, parts=3, index=1), vals["w"][2:4]),
        (split(t, "w", dim=1, parts=2, index=1), vals["w"][:, 2:]),
        (split(t, "w", dim=0, parts=4, index=3, even=False), vals["w"][6:6]),  # chunk: empty
        (split(t, "w", dim=0, parts=4, index=2, even=False), vals["w"][4:6]),
    ]:
        got = cut_shards(RankLayout(0, (shard,), {"w": t}), vals)["w"].reshape(shard.shape)
        assert np.array_equal(got, expected)


def test_vocab_parallel_padding_maps_to_nothing():
    t = CanonicalTensor("emb", (10, 2), "float32")
    shard = vocab_parallel(t, "emb", tp=2, rank=1, padded_rows=16)
    assert shard.shape == (8, 2)
    (region,) = shard.regions
    assert region.box == Box((8, 0), (2, 2))  # rows 8..9 real, 6 padding rows
    empty = vocab_parallel(t, "emb", tp=4, rank=3, padded_rows=16)
    assert empty.shape == (4, 2) and empty.regions == ()


def test_kv_head_replication():
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="not a multiple"):
        kv_head_range(3, 4, 0)


def test_flat_partition_pads_the_last_run():
    t = CanonicalTensor("w", (3, 5), "float32")
    vals = np.arange(15, dtype=np.float32).reshape(3, 5)
    from weightsync.layout.types import RankLayout
    for rank in range(4):
        shard = flat_partition(t, "w", world=4, rank=rank)
        assert shard.shape == (4,)
        got = cut_shards(RankLayout(0, (shard,), {"w": t}), {"w": vals})["w"]
        run = vals.reshape(-1)[rank * 4:(rank + 1) * 4]
        assert np.array_equal(got[: len(run)], run)
        assert (got[len(run):] == 0).all()


# -- vLLM ------------------------------------------------------------------------------

def test_vllm_qkv_with_fewer_kv_heads_than_tp():
    for t in range(4):
        shards, v, _ = local(GQA, "vllm:tp=4", t)
        q, k, vv = (v[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
        head = t // 2  # 2 kv heads over 4 ranks: each replicated twice
        expected = np.concatenate([q[t * 8:(t + 1) * 8], k[head * 4:(head + 1) * 4], vv[head * 4:(head + 1) * 4]])
        assert np.array_equal(shards["model.layers.1.self_attn.qkv_proj.weight"], expected)


def test_vllm_gate_up_o_down_norm_embed():
    shards, v, _ = local(GQA, "vllm:tp=2,replicas=2", 3)  # replica 1, tp rank 1
    g, u = v["model.layers.0.mlp.gate_proj.weight"], v["model.layers.0.mlp.up_proj.weight"]
    assert np.array_equal(shards["model.layers.0.mlp.gate_up_proj.weight"], np.concatenate([g[12:], u[12:]]))
    assert np.array_equal(shards["model.layers.0.mlp.down_proj.weight"], v["model.layers.0.mlp.down_proj.weight"][:, 12:])
    assert np.array_equal(shards["model.layers.0.self_attn.o_proj.weight"], v["model.layers.0.self_attn.o_proj.weight"][:, 16:])
    assert np.array_equal(shards["model.norm.weight"], v["model.norm.weight"])
    assert np.array_equal(shards["model.layers.2.self_attn.q_norm.weight"], v["model.layers.2.self_attn.q_norm.weight"])
    # vocab 100 padded to 128, rows 64..127 on rank 1: 36 real rows then padding
    emb = shards["model.embed_tokens.weight"]
    assert emb.shape == (64, 16)
    assert np.array_equal(emb[:36], v["model.embed_tokens.weight"][64:])
    assert (emb[36:] == 0).all()


def test_vllm_stacked_experts_with_and_without_ep():
    shards, v, _ = local(MOE, "vllm:tp=2", 1)
    g = v["model.layers.1.mlp.experts.*.gate_proj.weight"]
    u = v["model.layers.1.mlp.experts.*.up_proj.weight"]
    d = v["model.layers.1.mlp.experts.*.down_proj.weight"]
    assert np.array_equal(shards["model.layers.1.mlp.experts.routed_experts.w13_weight"],
                          np.concatenate([g[:, 3:], u[:, 3:]], axis=1))
    assert np.array_equal(shards["model.layers.1.mlp.experts.routed_experts.w2_weight"], d[:, :, 3:])
    shards, _, _ = local(MOE, "vllm:tp=2,ep=2", 1)  # experts 4..7 whole on rank 1
    assert np.array_equal(shards["model.layers.1.mlp.experts.routed_experts.w13_weight"],
                          np.concatenate([g[4:], u[4:]], axis=1))
    assert np.array_equal(shards["model.layers.1.mlp.experts.routed_experts.w2_weight"], d[4:])
    assert np.array_equal(shards["model.layers.1.mlp.gate.weight"], v["model.layers.1.mlp.gate.weight"])


def test_vllm_experts_without_ep_are_split_over_tp_and_dp():
    """vLLM 0.32 flattens TP across DP for MoE layers when expert parallelism is off
    (``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``): with tp=1, dp=2 each DP rank
    holds half of every expert's intermediate dim, not all of it (issue 23, defect 12)."""
    g, u, d = (f"model.layers.1.mlp.experts.*.{m}_proj.weight" for m in ("gate", "up", "down"))
    for rank, (lo, hi) in enumerate([(0, 3), (3, 6)]):
        shards, v, _ = local(MOE, "vllm:tp=1,dp=2", rank)
        assert np.array_equal(shards["model.layers.1.mlp.experts.routed_experts.w13_weight"],
                              np.concatenate([v[g][:, lo:hi], v[u][:, lo:hi]], axis=1))
        assert np.array_equal(shards["model.layers.1.mlp.experts.routed_experts.w2_weight"], v[d][:, :, lo:hi])
        # attention and dense layers are whole on both DP ranks
        assert np.array_equal(shards["model.layers.0.mlp.down_proj.weight"], v["model.layers.0.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="moe_intermediate_size=6 is not divisible by the 4 ranks"):
        parse_layout("vllm:tp=2,dp=2").validate(MOE)


def test_vllm_qkv_bias_and_tied_head():
    shards, v, rl = local(QWEN2, "vllm:tp=2", 0)
    qb, kb, vb = (v[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv")
    assert np.array_equal(shards["model.layers.0.self_attn.qkv_proj.bias"],
                          np.concatenate([qb[:8], kb[:4], vb[:4]]))
    assert "lm_head.weight" not in shards  # tied: vLLM reuses embed_tokens


# -- Megatron --------------------------------------------------------------------------

def test_megatron_linear_qkv_groups_and_fc1_stride():
    for t in range(2):
        shards, v, _ = local(GQA, "megatron:tp=2", t)
        q, k, vv = (v[f"model.layers.2.self_attn.{x}_proj.weight"] for x in "qkv")
        g = t  # 2 query groups over tp=2: one group per rank, 4 q heads per group
        expected = np.concatenate([q[g * 16:(g + 1) * 16], k[g * 4:(g + 1) * 4], vv[g * 4:(g + 1) * 4]])
        assert np.array_equal(shards["decoder.layers.2.self_attention.linear_qkv.weight"], expected)
        gate, up = v["model.layers.2.mlp.gate_proj.weight"], v["model.layers.2.mlp.up_proj.weight"]
        assert np.array_equal(shards["decoder.layers.2.mlp.linear_fc1.weight"],
                              np.concatenate([gate[t * 12:(t + 1) * 12], up[t * 12:(t + 1) * 12]]))
        assert np.array_equal(shards["decoder.layers.2.mlp.linear_fc2.weight"],
                              v["model.layers.2.mlp.down_proj.weight"][:, t * 12:(t + 1) * 12])
        assert np.array_equal(shards["decoder.layers.2.input_layernorm.weight"],
                              v["model.layers.2.input_layernorm.weight"])
        assert np.array_equal(shards["decoder.layers.2.self_attention.k_layernorm.weight"],
                              v["model.layers.2.self_attn.k_norm.weight"])


def test_megatron_qkv_with_two_groups_per_rank():
    shards, v, _ = local(GQA.__class__(**{**_fields(GQA), "num_kv_heads": 4}), "megatron:tp=2", 1)
    q, k, vv = (v[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    parts = []
    for g in (2, 3):  # 4 groups of 2 q heads; rank 1 holds groups 2 and 3
        parts += [q[g * 8:(g + 1) * 8], k[g * 4:(g + 1) * 4], vv[g * 4:(g + 1) * 4]]
    assert np.array_equal(shards["decoder.layers.0.self_attention.linear_qkv.weight"], np.concatenate(parts))


def _fields(spec):
    import dataclasses
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if not f.name.startswith("_")}


def test_megatron_pipeline_stages_and_vocab_padding():
    assert [list(stage_layers(3, 2, s)) for s in range(2)] == [[0, 1], [2]]
    assert [list(stage_layers(61, 16, s))[:1] for s in (0, 13, 15)] == [[0], [52], [58]]  # 13 stages of 4, then 3 of 3
    first, v, _ = local(GQA, "megatron:tp=2,pp=2", 0)  # rank 0: tp 0, stage 0
    last, _, _ = local(GQA, "megatron:tp=2,pp=2", 3)  # rank 3: tp 1, stage 1
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    # stage 1 holds global layer 2 as local layer 0
    assert np.array_equal(last["decoder.layers.0.input_layernorm.weight"], v["model.layers.2.input_layernorm.weight"])
    # vocab 100 padded to a multiple of 128 * tp = 256: 128 rows per rank
    emb = first["embedding.word_embeddings.weight"]
    assert emb.shape == (128, 16) and np.array_equal(emb[:100], v["model.embed_tokens.weight"])
    head = last["output_layer.weight"]
    assert head.shape == (128, 16) and (head == 0).all()  # rank 1's rows are all padding


def test_megatron_tied_embedding_second_copy_on_last_stage():
    shards, v, _ = local(QWEN2, "megatron:tp=1,pp=2", 1)
    assert np.array_equal(shards["output_layer.weight"][:50], v["model.embed_tokens.weight"])


def test_megatron_experts_ep_and_etp():
    # tp=2, dp=2, ep=2 (etp=1): ranks i = t + 2d -> ep rank i % 2, experts 4 per ep rank
    for rank in range(4):
        shards, v, _ = local(MOE, "megatron:tp=2,dp=2,ep=2,etp=1", rank)
        t, d = rank % 2, rank // 2
        ep_rank = (t + 2 * d) % 2
        g = v["model.layers.1.mlp.experts.*.gate_proj.weight"]
        u = v["model.layers.1.mlp.experts.*.up_proj.weight"]
        dn = v["model.layers.1.mlp.experts.*.down_proj.weight"]
        for i in range(4):
            e = ep_rank * 4 + i
            assert np.array_equal(shards[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc1.weight"],
                                  np.concatenate([g[e], u[e]]))
            assert np.array_equal(shards[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc2.weight"], dn[e])
    # expert TP 2 (ep=1): each rank holds half of every expert's ffn
    shards, v, _ = local(MOE, "megatron:tp=2,etp=2", 1)
    g = v["model.layers.1.mlp.experts.*.gate_proj.weight"]
    u = v["model.layers.1.mlp.experts.*.up_proj.weight"]
    assert np.array_equal(shards["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"],
                          np.concatenate([g[5, 3:], u[5, 3:]]))
    shards, _, _ = local(MOE, "megatron:tp=2,ep=2,grouped=1,etp=1", 0)
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in shards


# -- FSDP2, DeepSpeed, HF ---------------------------------------------------------------

def test_fsdp_uneven_chunks():
    # vocab 100 over dp=3: chunks of 34, 34, 32 rows (torch.chunk)
    sizes = []
    for rank in range(3):
        shards, v, _ = local(GQA, "fsdp:dp=3", rank)
        emb = shards["model.embed_tokens.weight"]
        sizes.append(emb.shape[0])
        assert np.array_equal(emb, v["model.embed_tokens.weight"][rank * 34:(rank + 1) * 34])
        assert np.array_equal(shards["model.norm.weight"], v["model.norm.weight"][rank * 6:(rank + 1) * 6])
    assert sizes == [34, 34, 32]


def test_fsdp_2d_strided_shard():
    # mesh (dp=2, tp=2): rank = d * 2 + t. q_proj [32, 16] colwise: chunk d of TP chunk t.
    for rank in range(4):
        d, t = divmod(rank, 2)
        shards, v, _ = local(GQA, "fsdp:dp=2,tp=2", rank)
        q = v["model.layers.0.self_attn.q_proj.weight"]
        assert np.array_equal(shards["model.layers.0.self_attn.q_proj.weight"], q[t * 16:(t + 1) * 16][d * 8:(d + 1) * 8])
        o = v["model.layers.0.self_attn.o_proj.weight"]  # rowwise: TP on dim 1, FSDP rows
        assert np.array_equal(shards["model.layers.0.self_attn.o_proj.weight"], o[d * 8:(d + 1) * 8, t * 16:(t + 1) * 16])
        n = v["model.layers.0.input_layernorm.weight"]  # replicated over TP, FSDP rows
        assert np.array_equal(shards["model.layers.0.input_layernorm.weight"], n[d * 8:(d + 1) * 8])


def test_fsdp_per_expert_params():
    shards, v, _ = local(MOE, "fsdp:dp=2,per_expert=1", 1)
    g = v["model.layers.1.mlp.experts.*.gate_proj.weight"]
    assert np.array_equal(shards["model.layers.1.mlp.experts.7.gate_proj.weight"], g[7, 3:])


def test_fsdp_fused_experts_of_transformers_5():
    # experts.gate_up_proj [E, 2I, H] = [gate; up] along dim 1; FSDP chunks the experts
    g = "model.layers.1.mlp.experts.*.gate_proj.weight"
    u = "model.layers.1.mlp.experts.*.up_proj.weight"
    dn = "model.layers.1.mlp.experts.*.down_proj.weight"
    shards, v, _ = local(MOE, "fsdp:dp=3", 2)  # 8 experts in chunks of 3, 3, 2
    assert np.array_equal(shards["model.layers.1.mlp.experts.gate_up_proj"],
                          np.concatenate([v[g][6:], v[u][6:]], axis=1))
    assert np.array_equal(shards["model.layers.1.mlp.experts.down_proj"], v[dn][6:])
    assert np.array_equal(shards["model.layers.1.mlp.gate.weight"], v["model.layers.1.mlp.gate.weight"][6:])
    # 2-D: TP packs [gate_t; up_t] (_StridedShard(1, split_factor=2)), down splits dim 2
    for rank in range(4):
        d, t = divmod(rank, 2)
        shards, _, _ = local(MOE, "fsdp:dp=2,tp=2", rank)
        e = slice(d * 4, (d + 1) * 4)
        i = slice(t * 3, (t + 1) * 3)
        assert np.array_equal(shards["model.layers.1.mlp.experts.gate_up_proj"],
                              np.concatenate([v[g][e, i], v[u][e, i]], axis=1))
        assert np.array_equal(shards["model.layers.1.mlp.experts.down_proj"], v[dn][e, :, i])


def test_deepspeed_flat_runs():
    for rank in range(3):
        shards, v, rl = local(MOE, "deepspeed:dp=3,per_expert=1", rank)
        w = v["model.layers.0.self_attn.q_proj.weight"].reshape(-1)  # 256 elements, 86 per rank
        got = shards["model.layers.0.self_attn.q_proj.weight"]
        run = w[rank * 86:(rank + 1) * 86]
        assert got.shape == (86,) and np.array_equal(got[: len(run)], run)
        e = v["model.layers.1.mlp.experts.*.down_proj.weight"][2].reshape(-1)  # 96 elements, 32 each
        assert np.array_equal(shards["model.layers.1.mlp.experts.2.down_proj.weight"], e[rank * 32:(rank + 1) * 32])


def test_deepspeed_fused_experts_cut_at_gate_up_boundary():
    g = "model.layers.1.mlp.experts.*.gate_proj.weight"
    u = "model.layers.1.mlp.experts.*.up_proj.weight"
    for rank in range(3):
        shards, v, _ = local(MOE, "deepspeed:dp=3", rank)
        fused = np.concatenate([v[g], v[u]], axis=1).reshape(-1)  # 8 * 12 * 16 = 1536, 512 per rank
        assert np.array_equal(shards["model.layers.1.mlp.experts.gate_up_proj"], fused[rank * 512:(rank + 1) * 512])


def test_hf_whole_model_with_per_expert_names():
    shards, v, rl = local(MOE, "hf:replicas=2", 1)
    assert rl.rank == 1
    assert np.array_equal(shards["model.layers.1.mlp.experts.3.up_proj.weight"],
                          v["model.layers.1.mlp.experts.*.up_proj.weight"][3])
    assert np.array_equal(shards["lm_head.weight"], v["lm_head.weight"])


def test_a_bf16_whole_model_keeps_the_router_correction_bias_in_float32():
    """A bf16 engine's staging (``hf:dtype=bfloat16``) held DeepSeek-V3's e_score_correction_bias
    in bf16: every sync rounded it, though vLLM's parameter (and transformers') is float32, and
    the engine routed with biases a fresh engine on the same checkpoint does not have. Every
    other tensor takes the layout's dtype."""
    from weightsync.tools.tiny import tiny_config

    spec = ModelSpec.from_hf_config({**tiny_config(family="deepseek_v3"), "torch_dtype": "bfloat16"})
    shards = {s.name: s.dtype for s in parse_layout("hf:dtype=bfloat16").rank_layout(spec, 0).shards}
    bias = [n for n in shards if n.endswith("mlp.gate.e_score_correction_bias")]
    assert bias and {shards[n] for n in bias} == {"float32"}
    assert {d for n, d in shards.items() if n not in bias} == {"bfloat16"}
    fp32 = {s.name: s.dtype for s in parse_layout("hf:dtype=float32").rank_layout(spec, 0).shards}
    assert set(fp32.values()) == {"float32"}  # fp32 master weights: everything in float32


# -- framework parameters as canonical parts -------------------------------------------

def test_param_parts_cut_boxes_and_flat_runs_at_part_boundaries():
    from weightsync.layout.params import hf_param, hf_params

    values = random_canonical(MOE.canonical_tensors(), seed=2)
    gate, up = "model.layers.1.mlp.experts.*.gate_proj.weight", "model.layers.1.mlp.experts.*.up_proj.weight"
    parts = hf_params(MOE)["model.layers.1.mlp.experts.gate_up_proj"]
    fused = np.concatenate([values[gate], values[up]], axis=1)  # [8, 12, 16]: rows 6.. are up
    assert parts.shape == fused.shape
    box = Box((2, 4, 3), (3, 5, 10))  # rows 4..8 cross the gate/up boundary
    local = np.zeros((4, 7, 12), dtype=np.float32)
    local[1:4, 2:7, 1:11] = fused[box.slices()]
    regions = parts.box_regions(box, local.shape, (1, 2, 1))
    assert [(r.canonical, r.box) for r in regions] == [(gate, Box((2, 4, 3), (3, 2, 10))),
                                                       (up, Box((2, 0, 3), (3, 3, 10)))]
    for start, stop in [(0, fused.size), (90, 700), (95, 97), (5, 5)]:
        run = fused.reshape(-1)[start:stop]
        for r in list(regions) + parts.flat_regions(start, stop):
            flat = local.reshape(-1) if r in regions else run
            assert np.array_equal(view(flat, r.offset, r.box.sizes, r.strides), values[r.canonical][r.box.slices()])
    # per-expert (transformers 4) names resolve too; a tied lm_head is one more embedding copy
    expert = hf_param(MOE, "model.layers.1.mlp.experts.5.down_proj.weight")
    assert expert is not None and expert.shape == (16, 6) and expert.parts[0][1].offsets == (5, 0, 0)
    assert hf_param(MOE, "model.layers.1.mlp.experts.8.down_proj.weight") is None
    assert hf_param(QWEN2, "lm_head.weight").parts == ((QWEN2.name("embed"), Box((0, 0), (50, 16))),)
    padded = hf_param(QWEN2, "model.embed_tokens.weight").padded((64, 16))
    assert [r.box for r in padded.box_regions(Box((32, 0), (32, 16)), (32, 16))] == [Box((32, 0), (18, 16))]


def test_runs_are_torch_chunk_and_strided_shard():
    from weightsync.layout.params import chunk_runs, run_boxes, strided_runs

    assert chunk_runs(((0, 5),), 4, 2) == ((4, 1),) and chunk_runs(((0, 5),), 4, 3) == ()
    assert chunk_runs(((10, 3), (20, 3)), 4, 1) == ((12, 1), (20, 1))  # positions 2..3 of 6
    assert strided_runs(((0, 10),), 2, 0, 2) == ((0, 3), (5, 3))  # two halves, chunk 0 of each
    assert run_boxes([((5, 2), (0, 1)), ((0, 4),)]) == [(Box((0, 0), (2, 4)), Box((5, 0), (2, 4))),
                                                        (Box((2, 0), (1, 4)), Box((0, 0), (1, 4)))]


# -- specs and errors -------------------------------------------------------------------

def test_model_spec_from_hf_config_roles_and_counts():
    spec = ModelSpec.from_hf_config(MOE.to_hf_config())
    assert spec == MOE
    names = spec.canonical_tensors()
    assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0 is dense (mlp_only_layers)
    assert names["model.layers.1.mlp.experts.*.gate_proj.weight"].shape == (8, 6, 16)
    assert spec.roles()["model.layers.1.self_attn.q_norm.weight"] == ("q_norm", 1)


def test_mixtral_names_are_data():
    spec = ModelSpec(family="mixtral", hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=4, vocab_size=64, num_experts=2, moe_intermediate_size=8,
                     dtype="float32")
    assert "model.layers.0.block_sparse_moe.experts.*.w1.weight" in spec.canonical_tensors()
    shards, _, _ = local(spec, "vllm:tp=1", 0)
    assert "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight" in shards


@pytest.mark.parametrize(("config", "message"), [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unknown architecture 'GPT2LMHeadModel'"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}, "missing 'num_attention_heads'"),
])
def test_bad_configs(config, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize(("kind", "message"), [
    ("megatron:tp=4", "num_key_value_heads=2 .* not divisible by tp=4"),
    ("vllm:tp=3", "num_attention_heads=8 is not divisible by tp=3"),
    ("fsdp:tp=4", "num_key_value_heads=2 is not divisible by tp=4"),
    ("megatron:ep=2", "needs an MoE model"),
    ("mystery:tp=2", "unknown layout kind 'mystery'"),
    ("vllm:tq=2", "has no option 'tq'"),
    ("vllm:tp=two", "not an integer"),
    ("vllm:tp=0", "tp must be >= 1"),
])
def test_impossible_layouts(kind, message):
    with pytest.raises(ValueError, match=message):
        parse_layout(kind).validate(GQA)


def test_region_outside_local_tensor_is_rejected():
    from weightsync.layout import Region, Shard
    from weightsync.layout.columns import shard_rows
    bad = Shard("w", (2, 2), "float32", (Region("t", Box((0, 0), (2, 3)), 0, (2, 1)),))
    with pytest.raises(ValueError, match="reaches outside the local tensor"):
        shard_rows(bad)


def test_strided_view_reads_the_right_elements():
    flat = np.arange(12)
    assert np.array_equal(view(flat, 1, (2, 2), (6, 2)), np.array([[1, 3], [7, 9]]))
