"""Planner properties: exact coverage, zero redundancy, balance, determinism, locality."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from budget import examples
from strategies import layout_pairs, raw_layout_pairs
from weightsync.layout import Box, CanonicalTensor, ModelSpec, RankLayout, Region, Shard, parse_layout
from weightsync.layout.box import contiguous_strides
from weightsync.plan import (
    PlanError,
    PlanOptions,
    build_local_plan,
    build_plan,
    plan_statistics,
    send_lower_bound,
    water_fill,
)
from weightsync.plan.reference import check_destinations, cut_shards, empty_shards, random_canonical, run_plan

EXACT = PlanOptions(min_split_bytes=0)
SETTINGS = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.filter_too_much])


def execute_and_check(canonical, sources, dests, plan):
    """Run the plan in numpy; every covered destination element written exactly once, bitwise."""
    values = random_canonical(canonical, seed=7)
    src = {s.rank: cut_shards(s, values) for s in sources}
    dst = {d.rank: empty_shards(d, fill=-1) for d in dests}
    writes = run_plan(plan, src, dst)
    check_destinations(dests, dst, values)
    for d in dests:
        for shard in d.shards:
            w = writes[d.rank][shard.name]
            covered = sum(r.numel for r in shard.regions)
            assert w.max(initial=0) <= 1, f"{shard.name}: an element was written twice"
            assert int(w.sum()) == covered, f"{shard.name}: not every needed element arrived"
            # elements no region covers (padding) are never touched
            untouched = dst[d.rank][shard.name][w == 0]
            assert (untouched == -1).all()


def needed_bytes(dests):
    return sum(r.numel * 4 for d in dests for s in d.shards for r in s.regions)


@SETTINGS
@given(layout_pairs())
def test_random_layout_pairs_reproduce_every_destination(case):
    spec, sources, dests = case
    plan = build_plan(sources, dests, EXACT)
    execute_and_check(spec.canonical_tensors(), sources, dests, plan)
    assert plan.stats.sent_bytes == plan.stats.needed_bytes == needed_bytes(dests)
    assert plan.total_bytes == needed_bytes(dests)


@SETTINGS
@given(raw_layout_pairs())
def test_random_raw_layouts_with_replication_and_strided_storage(case):
    canonical, sources, dests = case
    plan = build_plan(sources, dests, EXACT)
    execute_and_check(canonical, sources, dests, plan)
    assert plan.stats.sent_bytes == needed_bytes(dests)
    assert all(op.converts == (op.src_dtype != "float32") for op in plan.ops)


@SETTINGS
@given(layout_pairs(), st.integers(0, 1000))
def test_local_plans_equal_the_global_plan_filtered(case, seed):
    spec, sources, dests = case
    plan = build_plan(sources, dests, EXACT)
    rng = random.Random(seed)
    reader = rng.choice(dests).rank
    writer = rng.choice(sources).rank
    shuffled_src = rng.sample(sources, len(sources))  # input order must not matter
    local_r = build_local_plan(shuffled_src, dests, role="reader", rank=reader, options=EXACT)
    local_w = build_local_plan(sources, dests, role="writer", rank=writer, options=EXACT)
    assert local_r.ops == tuple(op for op in plan.ops if op.dst_rank == reader)
    assert local_w.ops == tuple(op for op in plan.ops if op.src_rank == writer)
    assert local_r.fingerprint == local_w.fingerprint == plan.fingerprint


def _tied_embeddings_over_three_stages():
    """Megatron TP 2 x PP 3 with tied embeddings to HF: the vocabulary halves are held by rank t of
    the first stage and rank t of the last (classes (0, 4) and (1, 5)), which cross the stages'
    classes. Each rank sends about 1.02 MB on average, and no single class is denser, but stages
    0 and 2 together hold 4,530,176 bytes no rank of stage 1 can send: 1,132,544 per rank. The
    bound of single classes (1,017,941, the mean) put the fill (1,134,080) 11% over it, 6.1% over
    the test's allowance; hypothesis drew such a job once in about 12,000 examples."""
    spec = ModelSpec(family="qwen3_moe", hidden_size=256, intermediate_size=128, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=64, vocab_size=1728, tie_word_embeddings=True, num_experts=2,
                     moe_intermediate_size=128, dense_layers=frozenset({0}), dtype="float32")
    return (spec, parse_layout("megatron:tp=2,pp=3,dp=1,ep=1,etp=1").all_rank_layouts(spec),
            parse_layout("hf").all_rank_layouts(spec))


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.filter_too_much])
@given(layout_pairs(scale=32))
@example(_tied_embeddings_over_three_stages())
def test_balance_within_five_percent_of_the_lower_bound(case):
    """On realistic tensor sizes the busiest writer sends at most 5% over the lower bound (the
    fractional optimum, :func:`send_lower_bound`)."""
    _, sources, dests = case
    stats = plan_statistics(sources, dests, PlanOptions(min_split_bytes=1024))
    assert stats.sent_bytes == stats.needed_bytes
    assert stats.max_send_bytes <= 1.05 * stats.lower_bound_send_bytes + 1


def test_classes_that_cross_are_balanced_too():
    """Megatron TP 2 x PP 2 with tied embeddings: the vocabulary's halves are held by rank 0 of
    each stage and rank 1 of each stage, classes that cross the stages'. Poured smallest first
    they landed on the second stage before its own replicated weights did: the busiest writer sent
    8.4% over the bound (hypothesis found it in `make test`). The refined fill keeps it within 5%."""
    spec = ModelSpec(family="qwen3_moe", hidden_size=128, intermediate_size=128, num_layers=2, num_heads=2,
                     num_kv_heads=2, head_dim=64, vocab_size=160, tie_word_embeddings=True, qk_norm=True,
                     num_experts=2, moe_intermediate_size=64, dtype="float32")
    sources = parse_layout("megatron:tp=2,pp=2,dp=1,ep=1,etp=1").all_rank_layouts(spec)
    for target in ("hf", "megatron:tp=1,pp=2,dp=2,ep=1,etp=1"):
        stats = plan_statistics(sources, parse_layout(target).all_rank_layouts(spec), PlanOptions(min_split_bytes=1024))
        assert stats.max_send_bytes <= 1.05 * stats.lower_bound_send_bytes + 1, target


def test_replicas_share_the_load():
    """Four data-parallel replicas each send a quarter (the peer sends all from one)."""
    spec = ModelSpec(family="llama", hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                     num_kv_heads=4, head_dim=32, vocab_size=4096, dtype="float32")
    sources = parse_layout("hf:replicas=4").all_rank_layouts(spec)
    dests = parse_layout("vllm:tp=2").all_rank_layouts(spec)
    stats = build_plan(sources, dests, PlanOptions(min_split_bytes=4096)).stats
    assert stats.max_send_bytes <= 1.01 * stats.needed_bytes / 4


def test_plan_is_deterministic():
    spec = ModelSpec.from_hf_config(_tiny_moe())
    sources = parse_layout("megatron:tp=2,pp=2,dp=2,ep=2,etp=1").all_rank_layouts(spec)
    dests = parse_layout("vllm:tp=2,replicas=2").all_rank_layouts(spec)
    a = build_plan(sources, dests)
    b = build_plan(list(reversed(sources)), dests)
    assert a.fingerprint == b.fingerprint
    assert a.ops == b.ops
    c = build_plan(sources, dests, PlanOptions(min_split_bytes=0))
    assert c.fingerprint != a.fingerprint  # options enter the fingerprint


def test_zero_copy_destinations_are_marked_contiguous():
    spec = ModelSpec.from_hf_config(_tiny_moe())
    plan = build_plan(parse_layout("megatron:tp=2").all_rank_layouts(spec),
                      parse_layout("vllm:tp=1").all_rank_layouts(spec))
    by_name = {op.dst_shard: op for op in plan.ops}
    assert by_name["model.layers.0.self_attn.qkv_proj.weight"].dst_contiguous
    # a column slice of down_proj lands in a non-contiguous view
    down = [op for op in plan.ops if op.dst_shard == "model.layers.0.mlp.down_proj.weight"]
    assert down and not any(op.dst_contiguous for op in down)


def _tiny_moe():
    return {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
            "moe_intermediate_size": 8, "num_experts": 4, "mlp_only_layers": [0], "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 64,
            "torch_dtype": "float32"}


# -- balancing primitives ---------------------------------------------------------------

def _fill_loads(demands, num_sources):
    """Each rank's bytes under :func:`water_fill`, which splits every class's demand exactly."""
    loads = [0] * num_sources
    for cls, amounts in water_fill(demands).items():
        assert sum(amounts) == demands[cls]
        for r, a in zip(cls, amounts):
            loads[r] += a
    return loads


def test_water_fill_reaches_the_fractional_optimum_on_nested_classes():
    demands = {(0, 2): 4, (1, 3): 2, (0, 1, 2, 3): 4}
    assert max(_fill_loads(demands, 4)) <= 3  # fractional optimum 2.5, integer 3
    assert send_lower_bound(demands, 4) == 2.5


def test_send_lower_bound_counts_unions_of_classes_that_cross():
    """Three pipeline stages of TP 2 (ranks 0-1, 2-3, 4-5); a tied embedding's halves held by rank t
    of the first and last stage. Single classes give at most 2 (each half over its two ranks) and
    the mean 14 / 6; the first and last stage together hold 4 + 4 + 3 + 2 = 13 over 4 ranks."""
    demands = {(0, 4): 4, (1, 5): 4, (0, 1): 3, (4, 5): 2, (2, 3): 1}
    assert send_lower_bound(demands, 6) == 3.25
    assert max(_fill_loads(demands, 6)) == 4  # the bound, rounded up to whole bytes


def _densest_by_enumeration(demands, num_sources):
    """``max_S D(S) / |S|`` over every set of source ranks, by brute force."""
    best = Fraction(0)
    for size in range(1, num_sources + 1):
        for ranks in itertools.combinations(range(num_sources), size):
            inside = sum(b for cls, b in demands.items() if set(cls) <= set(ranks))
            best = max(best, Fraction(inside, size))
    return best


_classes = st.lists(st.integers(0, 5), min_size=1, max_size=6).map(lambda ranks: tuple(sorted(set(ranks))))


@settings(max_examples=examples(200), deadline=None)
@given(st.dictionaries(_classes, st.one_of(st.integers(0, 12), st.integers(0, 10**12)), min_size=1, max_size=7))
def test_send_lower_bound_is_the_densest_set_of_ranks(demands):
    """The bound is exact: the densest set of ranks, whether or not the classes nest; and the
    water-fill's busiest rank never beats it."""
    bound = send_lower_bound(demands, 6)
    assert bound == float(_densest_by_enumeration(demands, 6))
    assert max(_fill_loads(demands, 6)) >= bound


def test_water_fill_is_integer_exact():
    alloc = water_fill({(0, 1, 2): 10})
    assert alloc[(0, 1, 2)] == (4, 3, 3)


# -- errors name what is wrong ----------------------------------------------------------

def _one(rank, name, shape, box, dtype="float32"):
    canonical = {name: CanonicalTensor(name, shape, "float32")}
    shard = Shard(name, box.sizes, dtype, (Region(name, box, 0, contiguous_strides(box.sizes)),))
    return RankLayout(rank, (shard,), canonical)


def test_missing_tensor_is_named():
    src = [_one(0, "a", (4,), Box((0,), (4,)))]
    dst = [_one(0, "b", (4,), Box((0,), (4,)))]
    with pytest.raises(PlanError, match=r"needed by readers are held by no writer: b"):
        build_plan(src, dst)


def test_unneeded_source_is_an_error_unless_allowed():
    a = _one(0, "a", (4,), Box((0,), (4,)))
    both = RankLayout(0, a.shards + _one(0, "b", (4,), Box((0,), (4,))).shards,
                      {**a.canonical, "b": CanonicalTensor("b", (4,), "float32")})
    with pytest.raises(PlanError, match=r"needed by no reader: b"):
        build_plan([both], [a])
    assert len(build_plan([both], [a], PlanOptions(allow_unneeded_sources=True))) == 1


def test_uncovered_destination_names_rank_and_box():
    src = [_one(0, "w", (8, 2), Box((0, 0), (4, 2)))]
    dst = [_one(3, "w", (8, 2), Box((2, 0), (4, 2)))]
    with pytest.raises(PlanError, match=r"reader rank 3 shard 'w' needs 'w' \(2, 0\)\+\(4, 2\), 4 of 8"):
        build_plan(src, dst)


def test_shape_disagreement_is_named():
    # it used to say "(rank 0) ... (rank 0)" without saying which side
    with pytest.raises(PlanError, match=r"'w' has shape \(8,\) in writer rank 0's layout and \(6,\) in reader rank "
                                        r"0's: the two sides were built from different model configs"):
        build_plan([_one(0, "w", (8,), Box((0,), (8,)))], [_one(0, "w", (6,), Box((0,), (6,)))])


def test_source_dtype_disagreement_is_named():
    src = [_one(0, "w", (8,), Box((0,), (8,)), "float32"), _one(1, "w", (8,), Box((0,), (8,)), "bfloat16")]
    with pytest.raises(PlanError, match=r"writers hold 'w' in different dtypes"):
        build_plan(src, [_one(0, "w", (8,), Box((0,), (8,)))])


def test_duplicate_ranks_rejected():
    a = _one(0, "w", (8,), Box((0,), (8,)))
    with pytest.raises(PlanError, match=r"writer rank\(s\) \[0\] appear more than once"):
        build_plan([a, a], [a])


def test_partially_overlapping_sources_are_refined():
    """Rank 0 holds rows 0..5, rank 1 rows 3..7: overlap 3..5 is sent once, by either."""
    canonical = {"w": CanonicalTensor("w", (8, 3), "float32")}
    s0 = _one(0, "w", (8, 3), Box((0, 0), (6, 3)))
    s1 = _one(1, "w", (8, 3), Box((3, 0), (5, 3)))
    d = _one(0, "w", (8, 3), Box((0, 0), (8, 3)))
    plan = build_plan([s0, s1], [d], EXACT)
    execute_and_check(canonical, [s0, s1], [d], plan)
    assert plan.stats.sent_bytes == 8 * 3 * 4


def test_dtype_conversion_is_declared_on_the_op():
    src = [_one(0, "w", (4,), Box((0,), (4,)), "float32")]
    dst = [_one(0, "w", (4,), Box((0,), (4,)), "bfloat16")]
    (op,) = build_plan(src, dst).ops
    assert (op.src_dtype, op.dst_dtype, op.nbytes, op.converts) == ("float32", "bfloat16", 8, True)


def test_columns_are_consistent_with_ops():
    spec = ModelSpec.from_hf_config(_tiny_moe())
    plan = build_plan(parse_layout("deepspeed:dp=3").all_rank_layouts(spec),
                      parse_layout("vllm:tp=2").all_rank_layouts(spec))
    assert int(np.sum(plan.columns.nbytes)) == sum(op.nbytes for op in plan.ops)
    keys = [(op.src_rank, op.dst_rank) for op in plan.ops]
    assert keys == sorted(keys)  # wire order
