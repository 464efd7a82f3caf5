"""Planner properties on the frontier families: DeepSeek-V3 (latent attention with and without
a query LoRA, shared experts, the correction bias, MTP layers), GLM-4.5 and gpt-oss.

Random small models of each family, random pairs of the layout kinds that describe them
(``hf``, ``fsdp``, ``deepspeed``, ``vllm`` with TP/DP/EP and the MTP drafter; ``megatron``
with TP/PP/DP/EP/expert TP for gpt-oss, laid out from mbridge and megatron-core): the plan
sends exactly the bytes the readers need (zero redundancy), and running it in numpy writes
every destination element exactly once, bitwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from test_planner import SETTINGS, execute_and_check, needed_bytes
from weightsync.layout import ModelSpec, parse_layout
from weightsync.plan import PlanOptions, build_plan
from weightsync.tools.tiny import tiny_config

#: Whether the ``megatron`` kind can lay gpt-oss out here (mbridge's names, megatron-core's layer specs).
MEGATRON = all(importlib.util.find_spec(m) is not None for m in ("mbridge", "megatron"))


@st.composite
def frontier_specs(draw, family: str | None = None):
    family = family or draw(st.sampled_from(["deepseek_v3", "glm4_moe", "gpt_oss"]))
    layers = draw(st.integers(1, 3))
    heads = draw(st.sampled_from([2, 4]))
    inter = draw(st.sampled_from([2, 4]))
    common = {"family": family, "hidden_size": draw(st.sampled_from([4, 8])), "intermediate_size": 8,
              "num_layers": layers, "num_heads": heads, "num_kv_heads": draw(st.sampled_from([1, 2])),
              "head_dim": 2, "vocab_size": draw(st.integers(5, 70)), "tie_word_embeddings": draw(st.booleans()),
              "num_experts": draw(st.sampled_from([2, 4])), "moe_intermediate_size": inter, "dtype": "float32"}
    if family == "gpt_oss":
        return ModelSpec(**common, attention_bias=True)
    extra = {"dense_layers": frozenset(range(draw(st.integers(0, layers)))),
             "shared_intermediate_size": draw(st.sampled_from([0, inter])),
             "score_correction": draw(st.booleans()), "mtp_layers": draw(st.integers(0, 1))}
    if family == "deepseek_v3":
        extra |= {"q_lora_rank": draw(st.sampled_from([0, 4])), "kv_lora_rank": 4, "qk_nope_head_dim": 2,
                  "qk_rope_head_dim": 2, "v_head_dim": 2}
    else:
        extra |= {"attention_bias": True, "qk_norm": draw(st.booleans())}
    return ModelSpec(**common, **extra)


def frontier_kinds(spec, *, readers: bool):
    """Training kinds hold every tensor (MTP layers too); readers may also be vLLM engines,
    with or without the MTP drafter."""
    ep = st.sampled_from([1, 2]) if spec.is_moe else st.just(1)
    kinds = [st.builds(lambda r: f"hf:replicas={r}", st.integers(1, 2)),
             st.builds(lambda d: f"fsdp:dp={d}", st.integers(1, 3)),
             st.builds(lambda d: f"deepspeed:dp={d}", st.integers(1, 3))]
    if readers:
        kinds.append(st.builds(lambda t, d, e, m: f"vllm:tp={t},dp={d},ep={t * d if e > 1 else 1},mtp={m}",
                               st.sampled_from([1, 2]), st.integers(1, 2), ep, st.integers(0, spec.mtp_layers)))
    return st.one_of(*kinds)


def megatron_kinds(spec):
    """Megatron-core trainers: TP, PP, DP, EP, expert TP, ``SequentialMLP`` or ``TEGroupedMLP`` names."""
    ep = st.sampled_from([1, 2]) if spec.is_moe else st.just(1)
    return st.builds(lambda t, p, d, e, x, g: f"megatron:tp={t},pp={p},dp={d},ep={e},etp={x},grouped={g}",
                     st.sampled_from([1, 2]), st.integers(1, 2), st.integers(1, 2), ep, st.sampled_from([1, 2]),
                     st.integers(0, 1))


@contextlib.contextmanager
def derived_megatron_rules(on: bool) -> Iterator[None]:
    """The ``megatron`` kind's rules derived from mbridge and megatron-core, installed for one layout."""
    if not on:
        yield
        return
    from weightsync.layout.kinds.megatron import use_params
    from weightsync.sources.megatron_names import install

    install()
    try:
        yield
    finally:
        use_params(None)


@st.composite
def frontier_pairs(draw, family: str | None = None, megatron: bool = False):
    """A spec (of ``family``), a training layout (a Megatron one with ``megatron``) and an engine's."""
    spec = draw(frontier_specs(family))
    layouts = []
    for readers in (False, True):
        kinds = megatron_kinds(spec) if megatron and not readers else frontier_kinds(spec, readers=readers)
        kind = parse_layout(draw(kinds))
        with derived_megatron_rules(kind.kind == "megatron"):
            try:
                kind.validate(spec)
            except ValueError:
                assume(False)
            layouts.append(kind.all_rank_layouts(spec))
    return spec, layouts[0], layouts[1]


@SETTINGS
@given(frontier_pairs())
def test_frontier_plans_have_zero_redundancy_and_cover_every_element_once(case):
    _check_plan(*case)


@pytest.mark.skipif(not MEGATRON, reason="mbridge or megatron-core is not installed (pip install weightsync[megatron])")
@pytest.mark.stack("megatron")  # megatron-core's import and layer specs: 10 s of CPU
@SETTINGS
@given(frontier_pairs(family="gpt_oss", megatron=True))
def test_gpt_oss_from_megatron_plans_have_zero_redundancy_and_cover_every_element_once(case):
    """The same for Megatron-core trainers of gpt-oss (names from mbridge's Qwen2-MoE bridge and megatron-core,
    the experts' fc1 staged in the checkpoint's order) into every engine kind."""
    _check_plan(*case)


def _check_plan(spec, sources, dests) -> None:
    # a trainer of the MTP layers may sync an engine that does not draft with them (vllm mtp=0)
    plan = build_plan(sources, dests, PlanOptions(min_split_bytes=0, allow_unneeded_sources=True))
    execute_and_check(spec.canonical_tensors(), sources, dests, plan)
    assert plan.stats.sent_bytes == plan.stats.needed_bytes == needed_bytes(dests)


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "glm-4.5", "gpt-oss-120b"])
def test_published_configs_read_to_their_parameter_counts(name):
    """The bundled configs of the real models, with the sizes their authors publish."""
    from weightsync.configs import load_spec

    spec = load_spec(name)
    billions = {"deepseek-v3": (671 + 11.5, 1), "kimi-k2": (1026.4, 0.1), "glm-4.5": (355, 2.5),
                "gpt-oss-120b": (116.8, 0.1)}[name]
    assert abs(spec.num_parameters / 1e9 - billions[0]) <= billions[1], spec.num_parameters


def test_kinds_that_do_not_model_a_family_refuse_it():
    spec = ModelSpec.from_hf_config(tiny_config(family="deepseek_v3"))
    with pytest.raises(ValueError, match="megatron: the deepseek_v3 family's Megatron-core names come from mbridge"):
        parse_layout("megatron:tp=2").validate(spec)
    with pytest.raises(ValueError, match=r"fsdp: tp=2 is modelled for Llama-style.*'kv_a'"):
        parse_layout("fsdp:dp=1,tp=2").validate(spec)
    with pytest.raises(ValueError, match="mtp=1 needs a model with MTP layers"):
        parse_layout("vllm:mtp=1").validate(ModelSpec.from_hf_config(tiny_config(family="gpt_oss")))



#: The published configs, from FSDP2 ranks into vLLM engines with expert parallelism and the MTP
#: drafter where the model has MTP layers (docs/benchmarks.md plans them at full scale).
PUBLISHED = [("deepseek-v3", "vllm:tp=2,dp=2,ep=4,mtp=1"), ("kimi-k2", "vllm:tp=2,dp=2,ep=4"),
             ("kimi-k2", "vllm:tp=2,dp=2,ep=4,quant=fp8_block"), ("glm-4.5", "vllm:tp=2,ep=2,mtp=1"),
             ("gpt-oss-120b", "vllm:tp=2")]


@pytest.mark.parametrize(("name", "target"), PUBLISHED)
def test_published_configs_plan_with_zero_redundancy(name, target):
    """Every byte of the real shapes is sent once: the plan's bytes equal what the readers need."""
    from weightsync.configs import load_spec
    from weightsync.layout.quant_offers import quantized_sources
    from weightsync.plan import plan_statistics

    spec = load_spec(name)
    readers = parse_layout(target).roster(spec)
    writers, _ = quantized_sources(parse_layout("fsdp:dp=2").roster(spec), readers)
    stats = plan_statistics(writers, readers, PlanOptions())
    assert stats.sent_bytes == stats.needed_bytes > 0
