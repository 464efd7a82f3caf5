"""Processes for tests/test_integration_trl.py: a TRL GRPOTrainer rank on weightsync's switch.

    python tests/_trl_grpo.py train --model DIR --out DIR --mode server --url URL   # env: RANK, WORLD_SIZE, ...
    python tests/_trl_grpo.py colocate-reference DIR [DIR ...]   # fresh engines built as TRL builds its own

Everything is built here, nothing comes from a hub: the tiny Qwen3 checkpoint and a word-level
tokenizer over its 512 ids (:func:`write_model`), the prompts, and the reward. After each
optimizer step a callback syncs vLLM (version = the global step; TRL's own sync at the next
generation is then a no-op), saves the trainer's full weights (rank 0) and prints one
``RESULT`` line per rank: the bytes this rank sent, the bytes of the shards it holds, and the
engine's greedy tokens and weight version (server mode: on rank 0); in colocate mode also the
digest of every tensor its engine worker holds, which the references give per TP worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def write_model(path: Path) -> dict[str, Any]:
    """The tiny Qwen3 checkpoint (seed 1) with a word-level tokenizer: ``w3 w4 ...`` are ids 3, 4, ..."""
    from weightsync.tools.tiny import tiny_config, write_checkpoint, write_tokenizer

    config = tiny_config()
    write_checkpoint(path, config, seed=1)
    write_tokenizer(path)
    return config


def reward(completions: list[str], **_: Any) -> list[float]:
    """The mean word id of a completion, scaled to [0, 1): varies within every group of two."""
    return [sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) / (512.0 * max(1, len(c.split())))
            for c in completions]


def train(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from weightsync.engines.vllm_state import engine_states
    from weightsync.integrations.trl import GRPOTrainer, TRLSyncSettings
    from weightsync.tools.engine_state import wire_digests

    sys.path.insert(0, str(HERE))
    from _vllm_native import _greedy, completion
    from vllm_in_process import inspect_models_here

    inspect_models_here()  # the colocated engine TRL builds in this process
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(args.out)
    config = json.loads((Path(args.model) / "config.json").read_text())
    prompts = [" ".join(f"w{3 + (7 * i + j) % 500}" for j in range(6)) for i in range(16)]
    grpo = GRPOConfig(
        output_dir=str(out / f"trainer{rank}"), use_vllm=True, vllm_mode=args.mode, vllm_server_base_url=args.url,
        vllm_server_timeout=300, vllm_max_model_length=256, vllm_gpu_memory_utilization=0.3,
        per_device_train_batch_size=2, num_generations=2, max_completion_length=8, max_steps=args.steps,
        learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
        bf16=False, disable_tqdm=True, vllm_tensor_parallel_size=args.tp)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
                          reward_funcs=reward, args=grpo, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=AutoTokenizer.from_pretrained(args.model),
                          weightsync=TRLSyncSettings(job=f"trl-{args.mode}", timeout=120.0, transport=args.transport))
    generation = trainer.vllm_generation

    if args.mode == "server":
        engine_dtype = generation.vllm_client.get_server_info()["model_config"]["dtype"] if rank == 0 else ""
    else:
        engine_dtype = str(generation.llm.llm_engine.model_config.dtype)
    engine_dtype = engine_dtype.removeprefix("torch.")

    class Probe(TrainerCallback):
        def on_step_end(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = int(state.global_step)
            generation.sync_weights()  # version `step`: what TRL's next generation would send
            model = trainer.model
            held = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            result = {"rank": rank, "version": generation.sync.version, "nbytes": generation.sync.last_result.nbytes,
                      "held": sum(t.numel() * t.element_size() for t in held),
                      "held_numel": sum(t.numel() for t in held), "dtype": engine_dtype,
                      "model_numel": sum(t.numel() for t in full.values()),
                      "model_bytes": sum(t.numel() * t.element_size() for t in full.values())}
            if rank == 0:
                path = out / f"v{step}"
                path.mkdir(parents=True)
                (path / "config.json").write_text(json.dumps(config))
                save_file({k: v.contiguous() for k, v in full.items()}, str(path / "model.safetensors"))
            if args.mode == "server" and rank == 0:
                result["tokens"], result["weight_version"] = completion(args.url, args.model)
                result["states"] = [wire_digests(t) for _, t in engine_states(args.url)]  # every worker it serves with
            elif args.mode == "colocate":
                result["tokens"], result["weight_version"] = _greedy(generation.llm), generation.llm.get_weight_version()
                result["state"] = _wire_state(generation.llm)  # this rank's worker: its TP rank's shards
            print("RESULT " + json.dumps(result), flush=True)

    trainer.add_callback(Probe())
    try:
        trainer.train()
    finally:
        generation.close()
    logged = [{k: v for k, v in row.items() if k.startswith("weightsync/")} for row in trainer.state.log_history]
    print("LOGGED " + json.dumps({"rank": rank, "rows": [row for row in logged if row]}), flush=True)


def _wire_state(llm: Any) -> dict[str, Any]:
    from weightsync.engines.vllm_state import engine_state
    from weightsync.tools.engine_state import wire_digests

    return wire_digests(engine_state(llm)[1])


def colocate_reference(paths: list[str], tp: int = 1) -> None:
    """Greedy tokens of a fresh engine per checkpoint, built with the arguments TRL 1.16 gives its
    colocated ``LLM`` (VLLMGeneration._init_vllm; the engine's dtype is vLLM's choice for a float32
    checkpoint, bfloat16 on CPU, where a different batch budget may flip a greedy token); with
    ``tp`` > 1 its TP workers are processes of its own (TRL's are the training ranks)."""
    from vllm import LLM

    from weightsync.engines.vllm_state import engine_states
    from weightsync.tools.engine_state import wire_digests

    sys.path.insert(0, str(HERE))
    from _vllm_native import _greedy

    parallel: dict[str, Any] = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    from vllm_in_process import before_engine_start

    for path in paths:
        before_engine_start()
        llm = LLM(model=path, max_model_len=256, max_num_seqs=2, seed=0, max_num_batched_tokens=4096,
                  logprobs_mode="processed_logprobs", kv_cache_memory_bytes=32 << 20, **parallel)
        states = [wire_digests(tensors) for _, tensors in engine_states(llm)]  # one per TP worker, by rank
        print("RESULT " + json.dumps({"path": path, "tokens": _greedy(llm), "states": states}), flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--model", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--mode", choices=["server", "colocate"], required=True)
    t.add_argument("--url", default=None)
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--tp", type=int, default=1, help="vllm_tensor_parallel_size")
    t.add_argument("--transport", default="auto", help="TRLSyncSettings.transport (a name keeps the job's path)")
    r = sub.add_parser("colocate-reference")
    r.add_argument("paths", nargs="+")
    r.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if args.cmd == "train":
        train(args)
    else:
        colocate_reference(args.paths, args.tp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
