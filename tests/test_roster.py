"""Rosters (``layout.roster``): every rank's layout as columns, from the layout kinds to the planner.

A kind's roster, built from pieces renamed layer by layer, equals the columns of its rank
layouts built one by one as objects, row for row; and one rank's share of the job computed
the way a session computes it at job start (descriptors decoded into rosters, FP8 offers
derived in columns) equals the global plan built from objects, filtered to that rank, op for
op, with the same fingerprint.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from budget import examples
from strategies import layout_kinds, model_specs
from weightsync.configs import load_spec
from weightsync.job.channel import Member
from weightsync.layout import ModelSpec, parse_layout
from weightsync.layout.kinds.base import _memo_tables
from weightsync.layout.quant_offers import quantized_sources
from weightsync.layout.roster import Roster
from weightsync.layout.wire import encode_descriptor, encode_explicit
from weightsync.plan import PlanOptions, build_plan
from weightsync.session.sync_session import decode_roster, plan_share
from weightsync.tools.codecs.fp8 import WriterQuantizer

EXACT = PlanOptions(min_split_bytes=0)


def assert_same_columns(got: Roster, want: Roster) -> None:
    for field in ("ranks", "rank_canonical", "rank", "shard", "off", "size", "loff", "stride", "ndim", "dtype"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape and np.array_equal(a, b), field
    assert [got.names[i] for i in got.name_idx] == [want.names[i] for i in want.name_idx]
    for field in ("rank", "dtype", "shape", "ndim"):
        assert np.array_equal(getattr(got.shards, field), getattr(want.shards, field)), f"shards.{field}"
    assert list(got.shards.names) == list(want.shards.names)


def assert_kind_roster_is_its_layouts(spec: ModelSpec, text: str) -> None:
    kind = parse_layout(text)
    got = kind.roster(spec)
    _memo_tables.cache_clear()  # the objects are built anew, without the pieces the roster built
    layouts = kind.all_rank_layouts(spec)
    assert_same_columns(got, Roster.from_layouts(layouts))
    assert [lay.shards for lay in got.layouts()] == [lay.shards for lay in layouts]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_kinds_roster_is_the_columns_of_its_rank_layouts(data):
    spec = data.draw(model_specs())
    text = data.draw(layout_kinds(spec.num_layers, spec.is_moe))
    try:
        parse_layout(text).validate(spec)
    except ValueError:
        assume(False)
    assert_kind_roster_is_its_layouts(spec, text)


@pytest.mark.parametrize(("config", "text"), [
    ("deepseek-v3", "vllm:tp=8,dp=2,ep=16,mtp=1"),         # latent attention, shared experts, MTP
    ("glm-4.5", "vllm:tp=4,dp=2,ep=8,mtp=1,quant=fp8_block"),  # FP8 readers: quantized pieces
    ("gpt-oss-120b", "vllm:tp=4,replicas=2"),               # whole experts, sinks, biases
    ("qwen3-30b-a3b", "megatron:tp=2,pp=4,dp=2,ep=4,etp=1,grouped=1"),
])
def test_frontier_rosters_are_the_columns_of_their_rank_layouts(config, text):
    assert_kind_roster_is_its_layouts(load_spec(config), text)


def test_a_roster_of_some_ranks_and_one_rank_as_objects():
    spec = load_spec("tiny-qwen3-moe")
    kind = parse_layout("megatron:tp=2,pp=2,dp=2,ep=2,etp=1")
    some = kind.roster(spec, [6, 1, 3])
    assert some.ranks.tolist() == [1, 3, 6]
    assert [lay.shards for lay in some.layouts()] == [kind.rank_layout(spec, r).shards for r in (1, 3, 6)]
    with pytest.raises(ValueError, match="rank 8 is outside world size 8"):
        kind.roster(spec, [8])


# The 1T shape in miniature: whole experts per Megatron rank, vLLM readers in bf16 and FP8.
MOE = ModelSpec(family="qwen3_moe", hidden_size=512, intermediate_size=1024, num_layers=3, num_heads=8,
                num_kv_heads=4, head_dim=128, vocab_size=300, tie_word_embeddings=False, num_experts=8,
                moe_intermediate_size=256, dense_layers=frozenset({0}), dtype="bfloat16")


@pytest.mark.parametrize("target", ["vllm:tp=2,replicas=2", "vllm:tp=2,replicas=2,quant=fp8_block",
                                    "vllm:tp=2,dp=2,ep=4,quant=fp8_channel"])
@pytest.mark.parametrize("source", ["megatron:tp=2,pp=2,dp=2,ep=4,etp=1", "fsdp:dp=3"])
def test_job_start_shares_equal_the_global_plan_filtered(source, target):
    """What each rank plans at job start (rosters, columnar FP8 offers) is its part of the
    global plan built from rank layouts as objects: the same ops, the same fingerprint."""
    src, dst = parse_layout(source), parse_layout(target)
    writers, quant = quantized_sources(src.all_rank_layouts(MOE), dst.all_rank_layouts(MOE))
    plan = build_plan(writers.layouts(), dst.all_rank_layouts(MOE), EXACT)  # objects from here on
    config = MOE.to_hf_config()
    # Writer 1 publishes its shard list, the others their descriptor.
    people = [Member("writer", r, "h", encode_explicit(src.rank_layout(MOE, r)) if r == 1
                     else encode_descriptor(src.describe(), "m")) for r in range(src.world_size)]
    people += [Member("reader", r, "h", encode_descriptor(dst.describe(), "m")) for r in range(dst.world_size)]
    rosters = decode_roster(people, lambda digest: config)
    for role, world in (("writer", src.world_size), ("reader", dst.world_size)):
        for rank in range(world):
            local, planned, quantizer = plan_share(*rosters, role=role, rank=rank, options=EXACT)
            side = "src_rank" if role == "writer" else "dst_rank"
            assert local.ops == tuple(op for op in plan.ops if getattr(op, side) == rank), (role, rank)
            assert local.fingerprint == plan.fingerprint
            if role == "writer" and quant:
                assert planned.layout(rank).shards == writers.layout(rank).shards
                want = WriterQuantizer(quant, writers.layout(rank), plan)
                if not want.active:
                    assert quantizer is None
                    continue
                assert quantizer is not None
                assert (quantizer.value_ops, quantizer.needed, quantizer.exchanged, quantizer.publishes) == \
                       (want.value_ops, want.needed, want.exchanged, want.publishes)
