"""LoRA adapter sync: the layout and planner facts (fast), and vLLM serving a synced adapter (one engine).

The end-to-end proof: two tensor-parallel trainer ranks each hold their slice of an adapter;
a vLLM engine (tiny Qwen3, float32, in-process) receives it in memory and then generates
exactly what the same engine generates with that adapter loaded from disk; the bytes moved
are the adapter's, each once; the adapter vLLM computes with equals the trainer's bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from launcher import launch as launch_process
from test_engine_vllm import shutdown, start_llm, vllm_env  # noqa: F401  (vllm_env: a fixture)
from weightsync.layout import ModelSpec
from weightsync.layout.lora import LoraSpec
from weightsync.plan import build_plan
from weightsync.sources.lora import LoraSource, peft_name
from weightsync.tools.tiny import lora_weights, tiny_config, write_adapter, write_checkpoint

HERE = Path(__file__).resolve().parent
LORA = LoraSpec(r=8, alpha=16)  # scaling 2: vLLM's folded B is exactly 2 * B


def spec(moe: bool = False) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_config(moe=moe))


# -- layout and plan ---------------------------------------------------------------------------------

def test_canonical_names_and_shapes_follow_peft():
    s = spec()
    canonical = LORA.canonical(s)
    assert canonical["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
    assert canonical["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (128, 8)
    assert canonical["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (8, 128)
    assert len(canonical) == 2 * 7 * s.num_layers
    # hidden 64, q 128, kv 64, mlp 128: per layer A's r*in plus B's out*r, float32
    per_layer = 8 * (64 * 5 + 128 * 2) + 8 * (128 + 64 + 64 + 64 + 128 + 128 + 64)
    assert LORA.nbytes(s) == 2 * per_layer * 4


def test_moe_layers_carry_attention_adapters_only():
    names = LORA.canonical(spec(moe=True))
    assert not any("mlp" in n for n in names)
    assert len(names) == 2 * 4 * 2


def test_tp_shards_follow_the_base_layer():
    shards = {s.name: s for s in LORA.shards(spec(), tp=2, tp_rank=1)}
    pre = "base_model.model.model.layers.0."
    q_b = shards[pre + "self_attn.q_proj.lora_B.weight"]  # column-parallel: B's rows split
    assert q_b.shape == (64, 8) and q_b.regions[0].box.offsets == (64, 0)
    assert shards[pre + "self_attn.q_proj.lora_A.weight"].shape == (8, 64)  # A replicated
    o_a = shards[pre + "self_attn.o_proj.lora_A.weight"]  # row-parallel: A's columns split
    assert o_a.shape == (8, 64) and o_a.regions[0].box.offsets == (0, 64)
    assert shards[pre + "self_attn.o_proj.lora_B.weight"].shape == (64, 8)  # B replicated


def test_two_tp_writers_into_one_reader_move_the_adapter_once():
    s = spec()
    writers = [LORA.rank_layout(s, r, tp=2, tp_rank=r) for r in range(2)]
    plan = build_plan(writers, [LORA.rank_layout(s, 0)])
    assert sum(op.nbytes for op in plan.ops) == LORA.nbytes(s)


def test_fp32_trainer_adapter_into_bf16_engine_moves_bf16_bytes():
    s = spec()  # PEFT keeps adapters in fp32 on a bf16 base; the engine's LoRA dtype decides the bytes
    writers = [LORA.rank_layout(s, r, tp=2, tp_rank=r, dtype="float32") for r in range(2)]
    plan = build_plan(writers, [LORA.rank_layout(s, 0, dtype="bfloat16")])
    assert sum(op.nbytes for op in plan.ops) == LORA.nbytes(s) // 2


def test_bad_specs_and_shapes_name_the_problem():
    with pytest.raises(ValueError, match="qkv_proj"):
        LoraSpec(r=8, alpha=16, target_modules=("qkv_proj",))
    with pytest.raises(ValueError, match="not divisible by 3"):
        LORA.shards(spec(), tp=3, tp_rank=0)
    tensors = lora_weights(tiny_config(), LORA, seed=1)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    with pytest.raises(ValueError, match=r"q_proj.lora_B.weight: float32\[128, 4\], the layout says float32\[128, 8\]"):
        LoraSource({**tensors, name: torch.zeros(128, 4)}, tiny_config(), LORA)
    with pytest.raises(ValueError, match="not targets"):
        LoraSource(tensors, tiny_config(), LoraSpec(r=8, alpha=16, target_modules=("q_proj",)))


def test_spec_round_trips_through_adapter_config():
    assert LoraSpec.from_peft_config(LORA.peft_config()) == LORA
    with pytest.raises(ValueError, match="use_dora=True; only plain LoRA"):
        LoraSpec.from_peft_config({**LORA.peft_config(), "use_dora": True})
    with pytest.raises(ValueError, match=r"\['lm_head'\] not supported"):
        LoraSpec.from_peft_config({**LORA.peft_config(), "target_modules": ["q_proj", "lm_head"]})


def test_peft_names_in_every_form():
    saved = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert peft_name(saved) == saved
    assert peft_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == saved
    assert peft_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") == saved  # injected
    assert peft_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight") is None
    assert peft_name("model.layers.0.self_attn.q_proj.base_layer.weight") is None


def test_source_reads_peft_module_parameters_by_reference():
    tensors = lora_weights(tiny_config(), LORA, seed=1)
    module = torch.nn.Module()
    for i, (name, t) in enumerate(tensors.items()):  # live PeftModel names, plus a frozen base weight
        module.register_parameter(f"p{i}", None)
        setattr(module, f"p{i}", torch.nn.Parameter(t.clone()))
    named = {n.replace(".weight", ".default.weight"): getattr(module, f"p{i}")
             for i, n in enumerate(tensors)}
    source = LoraSource(named, tiny_config(), LORA)
    for name, t in source.tensors().items():
        assert torch.equal(t, tensors[name])
    assert source.tensors()[next(iter(tensors))].data_ptr() == module.p0.data_ptr()


# -- vLLM: the synced adapter serves like the same adapter loaded from disk ---------------------------

HAVE_VLLM = __import__("importlib").util.find_spec("vllm") is not None
PROMPT = [(i * 37) % 500 + 4 for i in range(300)]  # > 2 KV blocks: a stale prefix cache would show


def greedy(llm, prompt, lora_request=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False, lora_request=lora_request)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def lora_llm(request, tmp_path_factory):
    request.getfixturevalue("vllm_env")  # vLLM's environment, restored afterwards
    tmp = tmp_path_factory.mktemp("lora")
    config = tiny_config()
    write_checkpoint(tmp / "base", config, seed=1)
    llm = start_llm(tmp / "base", enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=4)
    yield tmp, config, llm, greedy
    shutdown(llm)


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')")
@pytest.mark.xdist_group("vllm-lora")
@pytest.mark.slow
def test_vllm_adapter_synced_from_tp_trainers_matches_disk(lora_llm):
    from weightsync.engines.vllm_lora import VLLMLoraEngine
    from weightsync.meta import client as meta
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig

    tmp, config, llm, greedy = lora_llm
    disk, base, ref = disk_refs(tmp, config, llm)
    engine = VLLMLoraEngine(llm, LORA, name="policy", lora_id=1)
    assert engine.lora_request is None
    job = f"lora-{uuid.uuid4().hex[:8]}"
    with meta.EmbeddedMetaServer() as server, LoraWriters(server, config, tp=2, job=job, seeds=[2, 3]):
        client = meta.MetaClient(server.address, job=job, token=server.token)
        sync = SyncConfig(num_writers=2, num_readers=1, job=job, timeout=120)
        with WeightReader(engine, rank=0, config=sync, meta=client) as reader:
            for version, seed in ((1, 2), (2, 3)):
                result = reader.update(timeout=120)
                assert result.version == version and engine.weight_version == version
                assert result.nbytes == LORA.nbytes(spec())  # adapter bytes only, each once
                held = engine.adapter_tensors()
                assert held.keys() == disk[seed].keys()
                for name, t in disk[seed].items():
                    expect = t * LORA.scaling if ".lora_B." in name else t
                    assert torch.equal(held[name], expect), name
                assert engine.lora_request is not None
                assert engine.lora_request.lora_path == f"weightsync://policy/v{version}"
                assert greedy(llm, PROMPT, engine.lora_request) == ref[seed]
        client.close()
    assert greedy(llm, PROMPT) == base  # the base model never moved


def disk_refs(tmp, config, llm):
    """Adapters of seeds 2 and 3 on disk, and what the engine generates with each loaded from there."""
    from vllm.lora.request import LoRARequest

    disk = {seed: write_adapter(tmp / f"adapter{seed}", config, LORA, seed) for seed in (2, 3)}
    base = greedy(llm, PROMPT)
    ref = {seed: greedy(llm, PROMPT, LoRARequest(f"disk{seed}", 10 + seed, str(tmp / f"adapter{seed}")))
           for seed in (2, 3)}
    assert len({tuple(base), tuple(ref[2]), tuple(ref[3])}) == 3, "the adapters must change the output"
    return disk, base, ref


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')")
@pytest.mark.xdist_group("vllm-lora")
@pytest.mark.slow
def test_vllm_adapter_in_flight_updates_apply_at_step_boundaries(lora_llm):
    from weightsync.engines.vllm_lora import VLLMLoraEngine
    from weightsync.meta import client as meta
    from weightsync.roles.inflight import InflightReader
    from weightsync.session.sync_session import SyncConfig

    tmp, config, llm, greedy = lora_llm
    _, _, ref = disk_refs(tmp, config, llm)
    seeds = {1: 2, 2: 3}
    engine = VLLMLoraEngine(llm, LORA, name="inflight", lora_id=2)
    job = f"lora-{uuid.uuid4().hex[:8]}"
    with meta.EmbeddedMetaServer() as server, LoraWriters(server, config, tp=2, job=job, seeds=[2, 3]):
        client = meta.MetaClient(server.address, job=job, token=server.token)
        sync = SyncConfig(num_writers=2, num_readers=1, job=job, timeout=120)
        with InflightReader(engine, rank=0, config=sync, meta=client, poll=0.2) as inflight:
            inflight.wait_version(1, timeout=120)
            end = time.monotonic() + 120
            while engine.weight_version != 2 and time.monotonic() < end:  # serve; apply only between steps
                version = engine.weight_version
                assert version is not None and greedy(llm, PROMPT, engine.lora_request) == ref[seeds[version]]
                inflight.step_boundary()
            assert inflight.wait_version(2, timeout=120) == 2
            assert greedy(llm, PROMPT, engine.lora_request) == ref[3]
        client.close()


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')")
@pytest.mark.xdist_group("vllm-lora")
@pytest.mark.slow
def test_vllm_lora_engine_rejects_a_rank_above_max(lora_llm):
    from weightsync.engines.vllm_lora import VLLMLoraEngine

    _, _, llm, _ = lora_llm
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        VLLMLoraEngine(llm, LoraSpec(r=16, alpha=16))


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')")
@pytest.mark.xdist_group("vllm-lora")
@pytest.mark.slow
def test_vllm_lora_engine_direct_update_matches_disk(lora_llm):
    from weightsync.engines.vllm_lora import VLLMLoraEngine

    tmp, config, llm, greedy = lora_llm
    disk, _, ref = disk_refs(tmp, config, llm)
    engine = VLLMLoraEngine(llm, LORA, name="direct", lora_id=3)
    engine.update(disk[3], version=5)
    assert engine.weight_version == 5 and engine.lora_request.lora_path == "weightsync://direct/v5"
    assert greedy(llm, PROMPT, engine.lora_request) == ref[3]
    # The name is reused across versions: a request object of version 5, used after version 6 was
    # applied, generates with version 6's adapter and none of version 5's KV (prefix cache reset at apply).
    stale = engine.lora_request
    engine.update(disk[2], version=6)
    assert engine.lora_request.lora_name == stale.lora_name == "direct"
    assert greedy(llm, PROMPT, stale) == ref[2]
    assert greedy(llm, PROMPT, engine.lora_request) == ref[2]


@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install -e '.[vllm]')")
@pytest.mark.xdist_group("vllm-lora")
def test_vllms_prefix_cache_keys_each_version_of_a_reused_adapter_name_apart():
    """vLLM hashes KV blocks with the adapter's name and path; weightsync's path names the version, so
    the KV of version 1 is never found by a request for version 2 under the same name."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    from vllm.v1.request import Request

    from weightsync.engines.vllm_lora import versioned_lora_request

    def keys(version: int) -> object:
        lora = versioned_lora_request("policy", 1, version)
        request = Request("r", list(range(32)), SamplingParams(max_tokens=1), None, lora_request=lora)
        return generate_block_hash_extra_keys(request, 0, 16, 0)[0]

    assert versioned_lora_request("policy", 1, 2).lora_name == "policy"
    assert keys(1) != keys(2) and keys(2) == keys(2)


class LoraWriters:
    """Trainer ranks in subprocesses (tests/lora_writer_process.py), writing versions 1.. with ``seeds``."""

    def __init__(self, server, config, *, tp, job, seeds):
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "OMP_NUM_THREADS": "1"}
        args = ["--config", json.dumps(config), "--r", str(LORA.r), "--alpha", str(LORA.alpha), "--tp", str(tp),
                "--job", job, "--seeds", ",".join(map(str, seeds))]
        self.procs = [launch_process([sys.executable, str(HERE / "lora_writer_process.py"), *args,
                                      "--rank", str(rank)], env=env) for rank in range(tp)]

    def __enter__(self):
        return self.procs

    def __exit__(self, *exc):
        for proc in self.procs:
            try:
                _, err = proc.communicate(timeout=120 if exc[0] is None else 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if exc[0] is None:
                assert proc.returncode == 0, err[-2000:]
