"""A Hugging Face transformers model as an in-process engine (``ModuleEngine``).

Training ranks in Megatron TP2 layout (fused ``linear_qkv`` per query group, ``linear_fc1``
[gate; up]) write checkpoint B; a real transformers model started on checkpoint A receives
it in place. The proof: every parameter equals a fresh model built on B bitwise, no
parameter moved in memory, and greedy generation equals the fresh model's token for token.
The MoE case uses transformers' fused expert parameters (``experts.gate_up_proj``).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from weightsync.tools.tiny import canonical_weights, tiny_config
from writer_process import writer_processes

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[transformers]')")

PROMPT = torch.arange(4, 4 + 40).unsqueeze(0)
NEW_TOKENS = 12


def hf_model(config: dict[str, Any], seed: int) -> torch.nn.Module:
    """A transformers model holding ``canonical_weights(config, seed)``."""
    from weightsync.sources.module import ModuleSource
    from weightsync.tools.torch_layout import fill_from_canonical

    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    source = ModuleSource(model, config)
    fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))
    return model


def greedy(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, PROMPT.shape[1]:].tolist()


@pytest.fixture
def one_torch_thread():
    """Generation compares token lists; one intra-op thread keeps the two writers and this
    process off each other's cores. The count is put back so later tests see the default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_sync_into_transformers_model_matches_fresh_model(moe, one_torch_thread):
    from weightsync.engines import ModuleEngine
    from weightsync.meta import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig

    config = tiny_config(moe=moe)
    engine_model, fresh_b = hf_model(config, seed=1), hf_model(config, seed=2)
    assert greedy(engine_model) != greedy(fresh_b), "A and B must generate differently for the proof to mean anything"
    pointers = {name: p.data_ptr() for name, p in engine_model.named_parameters()}
    engine = ModuleEngine(engine_model, config)
    layout = "megatron:tp=2,ep=2,etp=1" if moe else "megatron:tp=2"

    job = f"hf-{uuid.uuid4().hex[:8]}"
    with EmbeddedMetaServer() as server, writer_processes(server, config, layout, job=job, seeds=[2]):
        client = MetaClient(server.address, job=job, token=server.token)
        sync = SyncConfig(num_writers=2, num_readers=1, job=job, timeout=60)
        with WeightReader(engine, rank=0, config=sync, meta=client) as reader:
            result = reader.update(timeout=60)
        client.close()

    assert result.version == 1 == engine.weight_version
    expected = dict(fresh_b.named_parameters())
    for name, param in engine_model.named_parameters():
        assert torch.equal(param, expected[name]), name
        assert param.data_ptr() == pointers[name], f"{name} was reallocated, not updated in place"
    assert result.nbytes == sum(p.numel() * p.element_size() for p in engine_model.parameters())
    assert greedy(engine_model) == greedy(fresh_b)


def test_module_layout_of_a_transformers_moe_model_covers_every_canonical_tensor_once():
    """The engine's canonical view covers each canonical tensor exactly (fused experts included)."""
    from weightsync.layout import ModelSpec
    from weightsync.sources.module import ModuleSource
    from weightsync.tools.verify import union_volume

    config = tiny_config(moe=True)
    layout = ModuleSource(hf_model(config, seed=2), config).layout()
    boxes: dict[str, list[Any]] = {}
    for shard in layout.shards:
        for region in shard.regions:
            boxes.setdefault(region.canonical, []).append(region.box)
    canonical = ModelSpec.from_hf_config(config).canonical_tensors()
    assert set(boxes) == set(canonical)
    for name, tensor in canonical.items():
        volume = sum(b.numel for b in boxes[name])
        assert union_volume(boxes[name]) == volume == torch.Size(tensor.shape).numel(), name


def test_a_transformers_engine_receives_the_correction_bias():
    """The router's ``e_score_correction_bias`` is a transformers buffer: ModuleEngine and
    ModuleSource list it with the parameters, so a sync does not leave it stale."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.engines import ModuleEngine
    from weightsync.sources import ModuleSource
    from weightsync.tools.tiny import tiny_config

    config = {**tiny_config(family="glm4_moe"), "num_nextn_predict_layers": 0}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"}), dtype=torch.float32)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = dict(model.named_buffers())[name]
    for side in (ModuleEngine(model, config), ModuleSource(model, config)):
        assert side.layout().shard(name).dtype == "float32"
        tensors = side.receive_buffers() if isinstance(side, ModuleEngine) else side.tensors()
        assert tensors[name].data_ptr() == bias.data_ptr()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_frontier_names_and_shapes_are_transformers_own(family, tmp_path):
    """The canonical tables of the frontier families equal transformers 5: its parameter (and
    correction-bias buffer) names and shapes in memory, and the names ``save_pretrained``
    writes (all but the MTP layer, which transformers does not build)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.layout.params import hf_params
    from weightsync.tools.tiny import tiny_config

    config = tiny_config(family=family)
    spec = ModelSpec.from_hf_config(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"}), dtype=torch.float32)
    in_memory = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    mtp = {n for n, (_, layer) in spec.roles().items() if layer is not None and spec.is_mtp_layer(layer)}
    ours = {n: p.shape for n, p in hf_params(spec).items() if not n.startswith(f"model.layers.{spec.num_layers}.")}
    assert {n: in_memory.get(n) for n in ours} == ours
    assert not {n for n, _ in model.named_parameters()} - set(ours)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    checkpoint = {s.name: s.shape for s in parse_layout("hf").rank_layout(spec, 0).shards
                  if not any(r.canonical in mtp for r in s.regions)}
    assert saved == checkpoint
