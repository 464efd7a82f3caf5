"""ZeroSource on a real DeepSpeed ZeRO-3 engine: 2 forked gloo ranks on CPU.

The model is the tiny transformers Qwen3-MoE of the DTensor tests (fused experts, sizes
that leave a padded tail on the last rank). After two optimizer steps every region is read
from the live ``ds_tensor`` and compared, bit for bit, with the parameters gathered by
``GatheredParameters`` (test side only); the layout must equal ``deepspeed:dp=2``.
"""

from __future__ import annotations

import sys

import pytest
import torch

from _sources import HF, assert_covered, check_source, hf_canonical, run_ranks, tiny_model
from weightsync.layout import ModelSpec, parse_layout
from weightsync.sources.param_mapping import same_layout

pytestmark = pytest.mark.xdist_group("sources-dtensor")  # shares the transformers import


def import_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Import deepspeed for the CPU once, in the test process (forked ranks inherit it)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install weightsync[transformers])")
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install weightsync[deepspeed])")
    import deepspeed.comm.torch
    import deepspeed.runtime.zero.muon.original_muon  # noqa: F401  (deepspeed.initialize imports inductor via it)
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    # init_distributed JIT-compiles a shared-memory allreduce op (about a minute on 2 cores);
    # None is DeepSpeed's own "op unavailable" answer, and gloo carries the collectives.
    # (``import deepspeed.comm.torch as m`` would bind torch itself: patch via sys.modules.)
    monkeypatch.setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)


def _zero_rank(rank: int, world: int) -> tuple[list, object]:
    import deepspeed

    from weightsync.sources.deepspeed import ZeroSource

    model = tiny_model(HF)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a torch optimizer: no cpu_adam build
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    source = ZeroSource(engine, HF, rank=rank)
    ids = torch.randint(0, HF["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        full = {n: p.data.clone() for n, p in params.items()}
    held = check_source(source, hf_canonical(full, source.spec), {n: p.ds_tensor for n, p in params.items()})
    assert same_layout(source.layout(), parse_layout("deepspeed:dp=2").rank_layout(source.spec, rank))
    padding = [s.shape[0] - sum(r.numel for r in s.regions) for s in source.layout().shards]
    return held, (source.descriptor(), max(padding))


def test_zero3_two_ranks_flat_partitions_after_training_steps(monkeypatch):
    import_deepspeed(monkeypatch)
    results = run_ranks(_zero_rank, 2, timeout=180)
    spec = ModelSpec.from_hf_config(HF)
    assert_covered([held for held, _ in results], {n: t.shape for n, t in spec.canonical_tensors().items()})
    assert [descriptor[0] for _, (descriptor, _) in results] == ["deepspeed:dp=2"] * 2
    assert [padding for _, (_, padding) in results] == [0, 1]  # hidden 31: norms leave 1 pad element on rank 1


def test_stage_two_parameters_are_refused():
    from test_sources_dtensor import module_with
    from weightsync.layout.params import hf_params
    from weightsync.sources.deepspeed import ZeroSource

    shapes = {name: parts.shape for name, parts in hf_params(ModelSpec.from_hf_config(HF)).items()}
    with pytest.raises(ValueError, match="not ZeRO-3 partitioned"):
        ZeroSource(module_with(shapes), HF, rank=0)


def _zero_frontier_rank(rank: int, world: int, family: str) -> tuple[list, object]:
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.sources.deepspeed import ZeroSource
    from weightsync.tools.tiny import tiny_config

    # no MTP layer: outside the forward pass ZeRO-3 leaves it stale (the FSDP2 e2e test covers MTP)
    config = {**tiny_config(family=family), "num_nextn_predict_layers": 0}
    torch.manual_seed(0)  # the same weights on every rank
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"}), dtype=torch.float32)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=ds)
    source = ZeroSource(engine, config, rank=rank)
    ids = torch.randint(0, config["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        full = {n: p.data.clone() for n, p in params.items()}
    buffers = {n: b for n, b in engine.module.named_buffers() if n.endswith("e_score_correction_bias")}
    full.update({n: b.clone() for n, b in buffers.items()})
    spec = source.spec
    canonical = full if spec.family_info.experts == "whole" else hf_canonical(full, spec)
    live = {n: p.ds_tensor for n, p in params.items()} | buffers
    held = check_source(source, canonical, live)
    assert same_layout(source.layout(), parse_layout("deepspeed:dp=2").rank_layout(spec, rank))
    return held, source.descriptor()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_zero3_frontier_families_as_they_are(monkeypatch, family):
    """DeepSeek-V3 (latent attention, shared experts, the router's correction bias), GLM-4.5 and
    gpt-oss under ZeRO-3, after a training step: the source reads every tensor by its HF name, the
    correction bias (a buffer ZeRO-3 leaves whole) included, and its layout is ``deepspeed:dp=2``."""
    import_deepspeed(monkeypatch)
    results = run_ranks(_zero_frontier_rank, 2, family, timeout=240)
    from weightsync.tools.tiny import tiny_config

    spec = ModelSpec.from_hf_config({**tiny_config(family=family), "num_nextn_predict_layers": 0})
    assert_covered([held for held, _ in results], {n: t.shape for n, t in spec.canonical_tensors().items()})
    assert [descriptor[0] for _, descriptor in results] == ["deepspeed:dp=2"] * 2
