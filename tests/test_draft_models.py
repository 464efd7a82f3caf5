"""A separately trained EAGLE-style draft model, synced as a second model of the target's job (issue 40).

The trainer holds a target (a Llama) and its draft head (EAGLE: ``fc [H, 2H]`` and one decoder
layer), the engine both; one job moves both models under their own names (the draft's under
``draft.``: ``weightsync.layout.models``), each byte once. Each version changes every tensor of
both models; after each, the engine's target and draft equal fresh models built from the
trainer's weights: parameters bitwise, and so their outputs on the same input.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from weightsync.engines.buffers import ModelsEngine, ModuleEngine, NamedEngine
from weightsync.layout.models import merge, named_layout, prefixed
from weightsync.meta import EmbeddedMetaServer, MetaClient
from weightsync.roles.reader import WeightReader
from weightsync.roles.writer import WeightWriter
from weightsync.session.sync_session import SyncConfig
from weightsync.sources.module import ModelsSource, ModuleSource, NamedSource

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 256, "torch_dtype": "float32", "tie_word_embeddings": False,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"}


def models(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Llama and an EAGLE head for it, every tensor drawn from ``seed`` (norms too)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})

    class EagleHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
            self.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, 0)])

    gen = torch.Generator().manual_seed(seed)
    target, draft = LlamaForCausalLM(config).eval(), EagleHead().eval()
    with torch.no_grad():
        for module in (target, draft):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return target, draft


def test_a_draft_model_is_synced_as_a_second_model_of_the_job():
    target, draft = models(0)  # the engine starts on other weights than every version
    engine = ModelsEngine({"": ModuleEngine(target, CONFIG), "draft.": NamedEngine(draft)})
    sync = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=60)
    trainer_target, trainer_draft = models(1)
    errors: list[BaseException] = []
    step = threading.Barrier(2, timeout=60)

    def write(server) -> None:
        try:
            source = ModelsSource({"": ModuleSource(trainer_target, CONFIG), "draft.": NamedSource(trainer_draft)})
            with WeightWriter(source, rank=0, config=sync, meta=MetaClient(server.address, token=server.token)) as w:
                for version in (1, 2):
                    new_target, new_draft = models(version)
                    with torch.no_grad():
                        for mine, theirs in ((trainer_target, new_target), (trainer_draft, new_draft)):
                            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
                                p.copy_(q)
                    w.write(version)
                    step.wait()
        except BaseException as exc:
            errors.append(exc)
            step.abort()

    with EmbeddedMetaServer() as server:
        writer = threading.Thread(target=write, args=(server,))
        writer.start()
        try:
            with WeightReader(engine, rank=0, config=sync, meta=MetaClient(server.address, token=server.token)) as r:
                for version in (1, 2):
                    result = r.update(version)
                    fresh_target, fresh_draft = models(version)
                    for mine, fresh in ((target, fresh_target), (draft, fresh_draft)):
                        for (name, p), q in zip(mine.state_dict().items(), fresh.state_dict().values(), strict=True):
                            assert torch.equal(p, q), (version, name)
                    tokens = torch.arange(8)[None]
                    assert torch.equal(target(tokens).logits, fresh_target(tokens).logits)
                    hidden = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(version))
                    assert torch.equal(draft.fc(hidden), fresh_draft.fc(hidden))
                    assert result.nbytes == sum(t.numel() * 4 for t in (*target.state_dict().values(),
                                                                        *draft.state_dict().values()))
                    step.wait()
        finally:
            writer.join(60)
    assert not errors, errors


def test_models_of_one_job_must_not_share_names():
    layout = named_layout({"fc.weight": ((4, 8), "float32")}, 0)
    with pytest.raises(ValueError, match="put one under a prefix"):
        merge([layout, layout], 0)
    both = merge([layout, prefixed(layout, "draft.")], 0)
    assert sorted(both.canonical) == ["draft.fc.weight", "fc.weight"]


def _engine_config(method: str | None, model: str = "", tp: int = 1) -> Any:
    """The parts of a vLLM config that the drafter's set-up reads."""
    from types import SimpleNamespace

    speculative = None if method is None else SimpleNamespace(method=method, model=model,
                                                              draft_model_config=SimpleNamespace(model=model))
    return SimpleNamespace(speculative_config=speculative, parallel_config=SimpleNamespace(tensor_parallel_size=tp))


def test_a_separate_drafters_tensors_are_read_from_its_checkpoint_and_an_engine_without_one_is_refused(tmp_path):
    from safetensors.torch import save_file

    from weightsync.engines.vllm_model import drafter_checkpoint

    save_file({"fc.weight": torch.zeros(4, 8), "layers.0.mlp.down_proj.weight": torch.zeros(4, 2)},
              str(tmp_path / "model.safetensors"))
    assert drafter_checkpoint(_engine_config("eagle", str(tmp_path))) == {
        "fc.weight": (4, 8), "layers.0.mlp.down_proj.weight": (4, 2)}
    for method in (None, "mtp", "ngram"):  # no drafter of its own: nothing to sync
        with pytest.raises(ValueError, match="no drafter of its own"):
            drafter_checkpoint(_engine_config(method, str(tmp_path)))
    with pytest.raises(ValueError, match="'org/eagle-head' is not a directory of safetensors files"):
        drafter_checkpoint(_engine_config("eagle", "org/eagle-head"))


def test_syncing_a_drafter_of_a_tp_engine_is_refused_by_name(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from weightsync.engines import vllm_model

    save_file({"fc.weight": torch.zeros(4, 8)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(vllm_model, "staging_quant", lambda config: None)
    monkeypatch.setattr("weightsync.engines.vllm_parallel.check_parallel", lambda config: None)
    with pytest.raises(ValueError, match="needs an engine of one TP worker"):
        vllm_model.check_supported(_engine_config("eagle", str(tmp_path), tp=2), drafter=True)
