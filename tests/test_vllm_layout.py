"""The ``vllm`` layout kind's tables equal vLLM's own loaders, recorded by a dry run.

``weightsync.engines.vllm_layout.record_rank`` builds each model on the meta device for a
TP/DP/EP rank and runs vLLM 0.32's ``load_weights`` on recording tensors. For every family
(Llama-style, Qwen2 with biases and tied embeddings, Qwen3-MoE, Mixtral, DeepSeek-V3 with its
MTP drafter, GLM-4.5 with its MTP drafter, gpt-oss) and parallelism the kinds model, both
cut the same local tensors out of the same canonical values, element for element. One
process records everything: building vLLM's config per model dominates (seconds), each
rank's dry run takes a fraction of a second.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from weightsync.layout import ModelSpec, RankLayout, parse_layout
from weightsync.plan.reference import cut_shards, random_canonical
from weightsync.tools.tiny import tiny_config

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
              pytest.mark.slow, pytest.mark.xdist_group("vllm-layout"), pytest.mark.timeout(600)]

MIXTRAL = {**tiny_config(moe=True), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "num_local_experts": 4, "intermediate_size": 32}
QWEN2 = {**tiny_config(tie=True), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
         "head_dim": None}  # vLLM's Qwen2 takes head_dim = hidden_size / heads
MODELS = {"qwen3": tiny_config(), "qwen2": QWEN2, "qwen3_moe": tiny_config(moe=True), "mixtral": MIXTRAL,
          **{f: tiny_config(family=f) for f in ("deepseek_v3", "glm4_moe", "gpt_oss")}}
#: (tp, dp, expert parallel); tp=4 replicates KV heads where a model has 2.
PARALLEL = [(1, 1, False), (2, 1, False), (4, 1, False), (2, 1, True), (1, 2, False), (2, 2, False), (2, 2, True)]


def _local(shard, spec, values):
    return cut_shards(RankLayout(0, (shard,), spec.canonical_tensors()), values)[shard.name]


@pytest.fixture(scope="module")
def vllm_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_HOST_IP", "127.0.0.1")
        yield


@pytest.mark.parametrize("family", list(MODELS))
def test_tables_equal_vllms_loaders(vllm_env, family):
    from weightsync.engines.vllm_layout import record_rank

    config = MODELS[family]
    spec = ModelSpec.from_hf_config(config)
    values = random_canonical(spec.canonical_tensors(), seed=1)
    ones = {name: np.ones_like(v) for name, v in values.items()}  # which elements hold anything
    checked = 0
    for tp, dp, ep in PARALLEL:
        if (ep and not spec.is_moe) or spec.num_heads % tp or (spec.is_mla and tp > 2):
            continue
        mtp = bool(spec.mtp_layers)
        kind = parse_layout(f"vllm:tp={tp},dp={dp},ep={tp * dp if ep else 1},mtp={int(mtp)}")
        try:
            kind.validate(spec)
        except ValueError:  # e.g. gpt-oss and Mixtral with tp=4 > 2 KV heads: vLLM cannot build them either
            continue
        for rank in range(tp * dp):
            table = {s.name: s for s in kind.shards(spec, rank) if s.regions}
            recorded = {s.name: s for s in record_rank(config, tp=tp, dp=dp, ep=ep, rank=rank, mtp=mtp)}
            where = f"{family} {kind.describe()} rank {rank}"
            assert sorted(table) == sorted(recorded), where
            for name, shard in table.items():
                other = recorded[name]
                assert (shard.shape, shard.dtype) == (other.shape, other.dtype), f"{where}: {name}"
                assert np.array_equal(_local(shard, spec, values), _local(other, spec, values)), f"{where}: {name}"
                assert np.array_equal(_local(shard, spec, ones), _local(other, spec, ones)), f"{where}: {name}"
                checked += 1
    assert checked


def test_install_makes_the_kind_use_the_recording(vllm_env):
    from weightsync.engines.vllm_layout import install, record_rank
    from weightsync.layout.kinds.vllm import recorder_in_use, use_recorder

    config = tiny_config(family="deepseek_v3")
    spec = ModelSpec.from_hf_config(config)
    install()
    try:
        assert recorder_in_use()
        shards = parse_layout("vllm:tp=2,replicas=2,mtp=1").rank_layout(spec, 3).shards
        assert shards == record_rank(config, tp=2, rank=1, mtp=True)  # replica 1, TP rank 1
    finally:
        use_recorder(None)
    assert not recorder_in_use()


def test_a_loader_that_computes_is_refused(vllm_env):
    """A loader doing arithmetic on a checkpoint tensor cannot be recorded: the error names the op."""
    import torch

    from weightsync.engines.vllm_layout import RecordingTensor, _Recorder
    from weightsync.layout import Box, Region

    param = torch.nn.Parameter(torch.empty(4, device="meta"))
    recorder = _Recorder({"w": param})
    src = RecordingTensor("x", torch.empty(4, device="meta"), Region("x", Box((0,), (4,)), 0, (1,)), recorder)
    param.data.copy_(src.narrow(0, 0, 4))
    assert recorder.regions["w"] == [Region("x", Box((0,), (4,)), 0, (1,))]
    with pytest.raises(NotImplementedError, match=r"mul.*not a slice"):
        param.data.copy_(src * 2)


def test_weightsync_plan_from_vllms_loaders(vllm_env, tmp_path, capsys):
    """``weightsync plan --vllm-loaders``: DeepSeek-V3 with its MTP drafter, FSDP2 into vLLM TP2,
    planned on the recorded layout and run in numpy: every element once, bitwise."""
    import json

    from weightsync.cli import main
    from weightsync.layout.kinds.vllm import use_recorder

    (tmp_path / "config.json").write_text(json.dumps(MODELS["deepseek_v3"]))
    try:
        assert main(["plan", "--config", str(tmp_path), "--source", "fsdp:dp=2", "--target", "vllm:tp=2,mtp=1",
                     "--vllm-loaders", "--verify", "--json"]) == 0
    finally:
        use_recorder(None)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # vLLM logs to stdout before it
    assert out["vllm_layouts"] == "vLLM's loaders" and out["verified"]
    assert out["sent_bytes"] == out["needed_bytes"]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_recording_one_layer_of_each_kind_equals_recording_them_all(vllm_env, family):
    """A layer's layout depends on its kind, not its index: the default recording (a model cut to
    one layer of each kind, the others renamed from it) equals the whole model's, MTP included."""
    from weightsync.engines.vllm_layout import record_rank

    config = {**MODELS[family], "num_hidden_layers": 4}
    if family == "deepseek_v3":
        config["first_k_dense_replace"] = 2
    else:
        config["layer_types"] = ["sliding_attention", "full_attention"] * 2
    mtp = family == "deepseek_v3"
    for rank in (0, 1):
        cut = record_rank(config, tp=2, ep=True, rank=rank, mtp=mtp)
        whole = record_rank(config, tp=2, ep=True, rank=rank, mtp=mtp, every_layer=True)
        assert {s.name: s for s in cut} == {s.name: s for s in whole}
        assert [s.name for s in cut] == [s.name for s in whole]


def test_a_recording_leaves_vllms_rope_cache_as_it_was(vllm_env):
    """A recording builds rotary embeddings on meta; vLLM memoises them process-wide.

    Left in ``_ROPE_DICT``, the next real engine of the same shape in this process (a test, or
    an in-process trainer's engine) takes the meta one and fails at its first forward.
    """
    from vllm.model_executor.layers import rotary_embedding

    from weightsync.engines.vllm_layout import record_rank

    before = dict(rotary_embedding._ROPE_DICT)
    record_rank({**tiny_config(), "rope_theta": 12345.0}, tp=1)  # a key no other test builds
    assert rotary_embedding._ROPE_DICT == before
    assert not any(r.cos_sin_cache.is_meta for r in rotary_embedding._ROPE_DICT.values())
