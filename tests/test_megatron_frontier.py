"""Megatron-core trainers of DeepSeek-V3, GLM-4.5 and gpt-oss on CPU, synced into a transformers model bitwise.

Four forked gloo ranks each build their stage of a real megatron-core ``GPTModel`` (the local
spec: no Transformer Engine on CPU) of a tiny DeepSeek-V3 (latent attention, a dense first layer,
shared experts, the router's expert bias, an MTP layer; TP 2 x DP 2, EP 2) or GLM-4.5 (q/k/v
biases, QK norm, shared experts, expert bias, an MTP layer; TP 2 x PP 2, EP 2, so the last
stage holds the MTP layer and an embedding of its own) or gpt-oss (sinks, biases everywhere, whole
experts with interleaved gate/up; TP 2 x DP 2, EP 2). Each rank loads checkpoint values the
way mbridge's ``load_weights`` does (its ``_weight_to_mcore_format`` and
``_weight_split_across_tp``, run on the real tensors; gpt-oss's experts as megatron-bridge's gpt-oss bridge
does, de-interleaving ``gate_up_proj``'s columns). Then, on every rank:

* ``MegatronSource`` finds every canonical value where its layout says, in the live tensors;
* its layout equals the ``megatron`` kind's, laid out from mbridge and megatron-core's specs;
* the ranks write the version through ``WeightWriter``, and a transformers model of the family
  (with its MTP layer appended, as a trainer of it does) receives it in place: every parameter
  and buffer equals the checkpoint's, bitwise.

**A test-only device shim.** megatron-core 0.16.1 cannot build these models on a CPU-only torch,
for these reasons, each patched in the forked ranks only (``cpu_shims`` in ``tests/_megatron_trainer.py``):

1. MLA's ``RotaryEmbedding`` and the router's ``expert_bias`` buffers are allocated on
   ``torch.cuda.current_device()``, which raises without CUDA: it returns ``"cpu"`` here;
2. ``MultiLatentAttention.__init__`` tests ``isinstance(linear_proj, TELinear)``, and
   ``TELinear`` is None without Transformer Engine: its ``HAVE_TE`` is set False;
3. the local MLA spec passes ``k_channels``/``v_channels`` to ``DotProductAttention``, which does
   not take them: the core attention, which has no parameters, is an ``IdentityOp``;
4. with MTP layers and PP > 1 the last stage's embedding is moved ``.cuda()`` (as tied
   embeddings are, ``tests/test_sources_megatron.py``): ``Tensor.cuda`` returns the tensor.

The parameters are megatron-core's own (names, shapes, partition attributes); the model cannot
run a forward pass, which a weight sync does not need.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import torch

from _frontier_trainer import add_mtp_layers
from _megatron_trainer import build, cpu_shims, load_like_mbridge
from _sources import assert_covered, check_source, run_ranks
from meta_proc import MetaServerProcess
from weightsync.layout import ModelSpec, parse_layout
from weightsync.sources.param_mapping import same_layout
from weightsync.tools.tiny import canonical_weights, tiny_config

pytestmark = [pytest.mark.xdist_group("sources-megatron"), pytest.mark.slow]

SEED = 3
#: family -> (megatron-core parallelism, the same as a ``megatron`` layout kind)
CASES = {
    "deepseek_v3": ({"tp": 2, "pp": 1, "ep": 2, "etp": 1}, "megatron:tp=2,dp=2,ep=2,etp=1"),
    "glm4_moe": ({"tp": 2, "pp": 2, "ep": 2, "etp": 1}, "megatron:tp=2,pp=2,ep=2,etp=1"),
    "gpt_oss": ({"tp": 2, "pp": 1, "ep": 2, "etp": 1}, "megatron:tp=2,dp=2,ep=2,etp=1"),
}


def import_libraries() -> None:
    """Import megatron-core and mbridge once, in the test process (forked ranks inherit them)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install weightsync[megatron])")
    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install weightsync[megatron])")
    import mbridge.models  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.post_training.modelopt.gpt.state_dict_hooks  # noqa: F401
    import transformers  # noqa: F401


def _rank(rank: int, world: int, family: str, job: str) -> list:
    from megatron.core import parallel_state as ps

    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.megatron import MegatronSource, _tensors
    from weightsync.sources.megatron_names import install

    cpu_shims()
    hf = tiny_config(family=family)
    par, kind = CASES[family]
    model = build(hf, par)
    spec = ModelSpec.from_hf_config(hf)
    canonical = canonical_weights(hf, SEED)
    load_like_mbridge(model, spec, canonical)
    source = MegatronSource(model, hf)
    held = check_source(source, canonical, _tensors(model), staged=source._staged)
    install()
    assert same_layout(source.layout(), parse_layout(kind).rank_layout(spec, rank)), rank
    with WeightWriter(source, rank=rank, config=SyncConfig(num_writers=world, num_readers=1, job=job,
                                                           timeout=120)) as writer:
        writer.write(1)
    ps.destroy_model_parallel()
    return held


def hf_model(hf: dict[str, Any]) -> torch.nn.Module:
    """A transformers model of ``hf`` with its MTP layer, holding arbitrary values."""
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    add_mtp_layers(model, hf)
    return model


@pytest.mark.parametrize("family", list(CASES))
def test_megatron_trainer_syncs_a_transformers_model_bitwise(family, tmp_path, monkeypatch):
    import_libraries()
    from weightsync.engines import ModuleEngine
    from weightsync.meta.client import MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.module import ModuleSource
    from weightsync.tools.torch_layout import fill_from_canonical

    hf = tiny_config(family=family)
    model, expected = hf_model(hf), hf_model(hf)
    fill_from_canonical(ModuleSource(expected, hf).layout(), ModuleSource(expected, hf).tensors(),
                        canonical_weights(hf, SEED))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters(), strict=True))
    engine = ModuleEngine(model, hf)
    job = f"megatron-{uuid.uuid4().hex[:8]}"
    with MetaServerProcess(tmp_path) as server:
        monkeypatch.setenv("WEIGHTSYNC_META_ADDR", server.address)
        monkeypatch.setenv("WEIGHTSYNC_META_TOKEN", server.token)

        def read() -> int:
            with MetaClient(server.address, job=job, token=server.token) as client, \
                    WeightReader(engine, rank=0, config=SyncConfig(num_writers=4, num_readers=1, job=job,
                                                                   timeout=120), meta=client) as reader:
                return reader.update(1, timeout=150).nbytes

        *_, nbytes = run_ranks(_rank, 4, family, job, timeout=300, alongside=read)
    assert nbytes == engine.layout().nbytes  # every byte once
    want = dict(expected.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    if hf.get("num_nextn_predict_layers"):
        mtp = [n for n in want if n.startswith(f"model.layers.{hf['num_hidden_layers']}.")]
        assert any(n.endswith("eh_proj.weight") for n in mtp) and any("experts" in n for n in mtp)


#: Tiny configs of the families the ``megatron`` kind's own rules name.
HAND = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 8, "torch_dtype": "float32"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 8, "tie_word_embeddings": True, "torch_dtype": "float32"},
    "qwen3": tiny_config(),
    "qwen3_moe": tiny_config(moe=True),
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 1000,
                "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 8, "num_local_experts": 4, "torch_dtype": "float32"},
}


@pytest.mark.parametrize("family", list(HAND))
def test_rules_derived_from_mbridge_and_megatron_core_equal_the_kinds_own(family, monkeypatch):
    """The Llama-style families, laid out from mbridge's mappings and megatron-core's layer specs,
    equal the ``megatron`` kind's own rules on every rank (TP, PP, EP, expert TP, grouped experts)."""
    import_libraries()
    from weightsync.layout.kinds import megatron as kind_module
    from weightsync.layout.kinds.base import _memo_tables
    from weightsync.sources.megatron_names import install

    spec = ModelSpec.from_hf_config(HAND[family])
    kinds = ["megatron:tp=2", "megatron:tp=2,pp=2,dp=2"]
    if spec.is_moe:
        kinds += ["megatron:tp=2,dp=2,ep=2,etp=1", "megatron:tp=2,dp=2,ep=2,grouped=1"]
    install()
    try:
        for text in kinds:
            kind = parse_layout(text)
            for rank in range(kind.world_size):
                hand = kind.rank_layout(spec, rank)
                _memo_tables.cache_clear()
                with monkeypatch.context() as patch:
                    patch.setattr(kind_module.MegatronLayout, "_derived", lambda self, spec: True)
                    derived = kind.rank_layout(spec, rank)
                _memo_tables.cache_clear()
                assert same_layout(hand, derived), (text, rank)
    finally:
        kind_module.use_params(None)  # the kind refuses the other families again, as without mbridge


#: (family, config changes, Megatron trainer, engine): the Megatron layouts laid out from mbridge.
PLANS = [
    ("deepseek_v3", {}, "megatron:tp=2,pp=2,ep=2,etp=1", "vllm:tp=2,mtp=1"),
    ("deepseek_v3", {"q_lora_rank": None}, "megatron:tp=2,dp=2,ep=4,etp=1,grouped=1", "vllm:tp=2,dp=2,ep=4,mtp=1"),
    ("glm4_moe", {}, "megatron:tp=2,pp=2,dp=2,ep=2,etp=2", "vllm:tp=2,mtp=1"),
    ("glm4_moe", {}, "megatron:tp=1,pp=2,dp=2,ep=2", "hf:replicas=2"),
    ("gpt_oss", {}, "megatron:tp=2,dp=2,ep=2,etp=1", "vllm:tp=2"),
    ("gpt_oss", {}, "megatron:tp=2,dp=2,ep=2,etp=2", "vllm:tp=2,ep=2"),
]


@pytest.mark.parametrize(("family", "changes", "source", "target"), PLANS)
def test_megatron_plans_of_the_derived_families_have_zero_redundancy(family, changes, source, target):
    """Megatron trainers of DeepSeek-V3 (with and without a query LoRA) and GLM-4.5, MTP layers
    included, into vLLM engines drafting with MTP and HF replicas: the plan sends exactly the bytes
    the readers need, and running it in numpy writes every destination element once, bitwise."""
    import_libraries()
    from test_planner import execute_and_check, needed_bytes
    from weightsync.layout.kinds.megatron import use_params
    from weightsync.plan import PlanOptions, build_plan
    from weightsync.sources.megatron_names import install

    spec = ModelSpec.from_hf_config({**tiny_config(family=family), **changes})
    install()
    try:
        sources = parse_layout(source).all_rank_layouts(spec)
    finally:
        use_params(None)
    dests = parse_layout(target).all_rank_layouts(spec)
    plan = build_plan(sources, dests, PlanOptions(min_split_bytes=0, allow_unneeded_sources=True))
    execute_and_check(spec.canonical_tensors(), sources, dests, plan)
    assert plan.stats.sent_bytes == plan.stats.needed_bytes == needed_bytes(dests)
    mtp = [s for layout in sources for s in layout.shards if s.name.startswith("mtp.layers.0.")]
    assert any(s.name.endswith("eh_proj.weight") for s in mtp) == bool(spec.mtp_layers), [s.name for s in mtp]


def _gpt_oss_rank(rank: int, world: int) -> tuple[list[str], list[str], list]:
    """One TP 2 x EP 2 rank of a megatron-core gpt-oss (local spec, the test-only device shim): its
    parameters, the shards ``MegatronSource`` names them as, and the canonical boxes each holds."""
    from megatron.core import parallel_state as ps

    from weightsync.sources.megatron import MegatronSource

    cpu_shims()
    hf = tiny_config(family="gpt_oss")
    model = build(hf, {"tp": 2, "pp": 1, "ep": 2, "etp": 1})
    windows = [layer.self_attention.core_attention.scale_mask_softmax.window_size for layer in model.decoder.layers]
    assert windows == [(hf["sliding_window"] - 1, 0), None], windows  # sliding, then full, as the checkpoint
    params = [n for n, _ in model.named_parameters()]
    layout = MegatronSource(model, hf).layout()
    ps.destroy_model_parallel()
    return params, [s.name for s in layout.shards], [[(r.canonical, r.box) for r in s.regions] for s in layout.shards]


def test_megatron_names_of_gpt_oss_cover_every_parameter_once():
    """megatron-core 0.16.1 builds gpt-oss on CPU (sinks, sliding windows, biased experts and router,
    TP 2 x EP 2). The names derived from megatron-core's modules and mbridge's Qwen2-MoE bridge (plus
    gpt-oss's own few) give every parameter exactly one shard, no two parameters of a rank hold the same
    canonical element, and the ranks together hold every element of every canonical tensor."""
    import_libraries()
    spec = ModelSpec.from_hf_config(tiny_config(family="gpt_oss"))
    ranks = run_ranks(_gpt_oss_rank, 2, timeout=180)
    for params, shards, _ in ranks:
        for held in ("self_attention.core_attention.softmax_offset", "self_attention.linear_proj.bias",
                     "mlp.router.bias", "mlp.experts.local_experts.1.linear_fc1.bias",
                     "mlp.experts.local_experts.1.linear_fc2.bias"):
            assert f"decoder.layers.1.{held}" in params, held
        assert sorted(params) == sorted(shards)  # one shard per parameter (shard names are unique)
    for _, _, regions in ranks:
        count = {name: np.zeros(t.shape, dtype=np.int32) for name, t in spec.canonical_tensors().items()}
        for shard in regions:
            for name, box in shard:
                count[name][box.slices()] += 1
        assert all(c.max() <= 1 for c in count.values()), [n for n, c in count.items() if c.max() > 1]
    assert_covered([[pair for shard in regions for pair in shard] for _, _, regions in ranks],
                   {name: t.shape for name, t in spec.canonical_tensors().items()})
