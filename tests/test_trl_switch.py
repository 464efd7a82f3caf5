"""The pieces of weightsync's TRL switch that need no engine: the TRL version check, the
settings it refuses at init, and a PEFT model synced as its merged weights (the end-to-end
GRPO runs are in test_integration_trl.py)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from weightsync.tools.tiny import tiny_config

#: one xdist worker imports vLLM, TRL, Ray and DeepSpeed (docs/benchmarks.md, "make test-fast under 90 s")
pytestmark = pytest.mark.xdist_group("vllm-stack")

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("vllm") is None,
                               reason="needs trl and vllm (weightsync[trl,vllm])")


@pytest.fixture
def trl_switch(monkeypatch):
    """``weightsync.integrations.trl``; TRL's first import sets VLLM_LOGGING_LEVEL=ERROR when it is
    unset, which this undoes after the test."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    return importlib.import_module("weightsync.integrations.trl")


@needs_trl
def test_an_unsupported_trl_release_is_refused_naming_both_versions(trl_switch):
    trl_switch.check_trl_version("1.16.0")
    with pytest.raises(RuntimeError, match=r"supports TRL 1\.16\.\*, found trl 1\.17\.0"):
        trl_switch.check_trl_version("1.17.0")


@needs_trl
@pytest.mark.parametrize(("setting", "message"), [
    ({"vllm_enable_sleep_mode": True}, "vllm_enable_sleep_mode=True with weightsync"),
])
def test_colocate_settings_weightsync_cannot_serve_are_refused_before_vllm_starts(tmp_path, trl_switch, setting,
                                                                                  message):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _trl_grpo

    _trl_grpo.write_model(tmp_path / "model")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate", use_cpu=True,
                      per_device_train_batch_size=2, num_generations=2, report_to="none", **setting)
    with pytest.raises(ValueError, match=message):
        trl_switch.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tmp_path / "model"), reward_funcs=_trl_grpo.reward,
                               args=args, train_dataset=Dataset.from_dict({"prompt": ["w3 w4"] * 4}),
                               processing_class=AutoTokenizer.from_pretrained(tmp_path / "model"))


def _peft_model():
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config()
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{k: v for k, v in config.items()
                                                                     if k != "architectures"}))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                      modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.05 * torch.randn_like(p))  # a trained adapter: B is zero at init
    return model, config


def test_a_peft_model_syncs_its_merged_weights_and_keeps_its_adapter(tmp_path):
    """What TRL sends for a PEFT model (merge, base names, unmerge), bit for bit, without a gather."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync import SyncConfig, WeightReader, WeightWriter
    from weightsync.engines import ModuleEngine
    from weightsync.integrations.trl_sync import merged_adapter, training_source
    from weightsync.meta import connect

    model, config = _peft_model()
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{k: v for k, v in config.items()
                                                                            if k != "architectures"}))
    source = training_source(model, rank=0)
    assert not any("lora" in s.name or "base_layer" in s.name for s in source.layout().shards)
    sync = SyncConfig(num_writers=1, num_readers=1)
    client, server = connect()
    try:
        reader = WeightReader(ModuleEngine(engine_model, config), rank=0, config=sync, meta=client)
        writer = WeightWriter(source, rank=0, config=sync, meta=client)
        applied = threading.Thread(target=reader.update, args=(1,), kwargs={"timeout": 60})
        applied.start()
        with merged_adapter(model):
            writer.write(1)
        applied.join(60)
        writer.close(), reader.close()
    finally:
        client.close(), server.stop()
    got = engine_model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name  # the merged weights, bit for bit
    for name, p in model.named_parameters():  # the adapter is back in place (unmerged: up to rounding)
        assert torch.allclose(p, before[name], atol=1e-6), name


@needs_trl
def test_trl_vllm_serve_starts_vllm_with_the_weightsync_backend_when_asked(trl_switch):
    """``trl vllm-serve`` (TRL 1.16) only execs ``vllm serve`` with dev mode, its NCCL backend and the
    extra arguments after it: ``--weight-transfer-config '{"backend": "weightsync"}'`` wins (vLLM
    takes the last of a repeated option), so TRL's own server command serves weightsync."""
    from trl.scripts.vllm_serve import build_command, make_parser
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args, extra = make_parser().parse_args_and_config(
        args=["--model", "Qwen/Qwen3-0.6B", "--tensor_parallel_size", "2", "--weight-transfer-config",
              '{"backend": "weightsync"}'], return_remaining_strings=True)
    command = build_command(args, extra)
    served = make_arg_parser(FlexibleArgumentParser()).parse_args(command[command.index("serve") + 1:])
    assert served.weight_transfer_config.backend == "weightsync"
    assert served.tensor_parallel_size == 2 and served.logprobs_mode == "processed_logprobs"


@pytest.mark.parametrize(("settings", "asked"), [
    ({}, ""),
    ({"integrity": True}, "integrity"),
    ({"delta_anchor_every": 4, "layer_phases": False}, "delta_anchor_every"),
    ({"commit": "fleet", "layer_phases": False}, "commit"),
    ({"transport": "shm"}, "transport"),
])
def test_a_colocated_replica_takes_the_local_copy_unless_a_setting_needs_the_jobs_path(settings, asked, caplog):
    """The local copy moves nothing between processes, so it cannot honour a transport asked for by
    name, integrity checks, deltas or the fleet-wide commit: with any of them the rank sends through
    the job, and the log says which setting asked for it (never a setting silently ignored)."""
    import logging

    from weightsync.integrations.trl_sync import ColocateSync, TRLSyncSettings

    sync = ColocateSync.__new__(ColocateSync)  # the decision alone: no engine, no process group
    sync.settings, sync.rank, sync.world = TRLSyncSettings(**settings), 0, 2
    with caplog.at_level(logging.INFO, logger="weightsync.integrations.trl_sync"):
        assert sync._local_allowed() is (not asked)
    assert (f"as {asked} asks" in caplog.text) if asked else "local copy" not in caplog.text
