"""TRL's own vLLM weight sync against weightsync's, side by side in one run (a script, not a test).

Two training ranks each build ``weightsync.integrations.trl.GRPOTrainer`` in colocate mode: one
in-process vLLM engine per rank, as TRL builds it. The ranks hold the model as accelerate runs
them on CPU, data-parallel (DDP: a replica each), or with ``--fsdp`` sharded by FSDP2
(``fully_shard`` per decoder layer; accelerate enables FSDP only on accelerators, so the script
shards the model itself and gives TRL the FSDP2 flag accelerate would). Each round changes the
weights once, then syncs them into the same engines twice, in alternating order:

* ``trl``: TRL 1.16's own ``VLLMGeneration.sync_weights`` (the base class's method on the same
  object): every parameter gathered whole on every rank (FSDP2: ``full_tensor()``), one
  ``load_weights`` call each, then a prefix-cache reset. On vLLM's CPU build a
  ``load_weights`` after start-up needs a layerwise-reload session (linear layers are repacked
  into oneDNN handles), so the loop runs inside one;
* ``weightsync``: the switch's sync. DDP: each engine loads its own rank's replica through
  vLLM's loader in one reload session (the local copy: nothing crosses a process); FSDP2: both
  ranks write their shards over shared memory, each engine receives the whole model and loads it
  in one reload session.

It reports seconds per sync (the slower rank) and the peak resident memory the sync adds to the
main process (VmHWM reset before each sync, minus the RSS then), and checks that both paths
leave the engines generating the same greedy tokens. TRL's server mode cannot run here: its
NCCL weight-transfer group needs CUDA.

    python benchmarks/trl_sync.py [--fsdp] [--hidden 512 --layers 8 --vocab 32000] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROMPT = [5 + (7 * i) % 480 for i in range(40)]


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    from weightsync.tools.tiny import tiny_config

    config = tiny_config()
    config.update(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                  num_key_value_heads=max(1, args.hidden // 128), head_dim=64)
    return config


@contextlib.contextmanager
def reload_session(llm: Any) -> Iterator[None]:
    """What vLLM's CPU build needs around ``load_weights`` after start-up (module docstring)."""
    from vllm.config import set_current_vllm_config

    from weightsync.engines.vllm import ReloadSession

    config = llm.llm_engine.vllm_config
    session = ReloadSession(llm.llm_engine.model_executor.driver_worker.model_runner.model, config)
    session.begin()
    try:
        with set_current_vllm_config(config):
            yield
    finally:
        session.end()


def greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    return list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig
    from trl.generation.vllm_generation import VLLMGeneration

    from weightsync.integrations.trl import GRPOTrainer
    from weightsync.tools.rss import reset_peak_rss, status_bytes

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    grpo = GRPOConfig(output_dir=str(Path(args.dir) / f"out{rank}"), use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=256, per_device_train_batch_size=2, num_generations=2, use_cpu=True,
                      report_to="none", save_strategy="no", bf16=False)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32), args=grpo,
                          reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          train_dataset=Dataset.from_dict({"prompt": ["w3 w4"] * 4}),
                          processing_class=AutoTokenizer.from_pretrained(args.dir))
    generation = trainer.vllm_generation
    model, version = generation.model, 0
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        generation._dist.fsdp_version = 2  # what accelerate's FSDP2 plugin tells TRL on an accelerator
    for round_ in range(args.rounds + 1):  # round 0 warms both paths up (weightsync plans there)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0 + 1e-3)  # the same change on every rank
        order = ("trl", "weightsync") if round_ % 2 == 0 else ("weightsync", "trl")
        tokens = {}
        for method in order:
            dist.barrier()
            reset_peak_rss()
            rss, start = status_bytes("VmRSS"), time.perf_counter()
            if method == "trl":
                with reload_session(generation.llm):
                    VLLMGeneration.sync_weights(generation)  # TRL 1.16's own colocate path
            else:
                version += 1
                generation.sync.sync(version)
            seconds, peak = time.perf_counter() - start, status_bytes("VmHWM") - rss
            tokens[method] = greedy(generation.llm)
            print("RESULT " + json.dumps({"rank": rank, "round": round_, "method": method, "seconds": seconds,
                                          "peak_bytes": peak, "tokens": tokens[method]}), flush=True)
        if tokens["trl"] != tokens["weightsync"]:
            raise SystemExit(f"rank {rank} round {round_}: the paths disagree: {tokens}")
    generation.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    from weightsync.tools.tiny import write_checkpoint, write_tokenizer

    with tempfile.TemporaryDirectory(prefix="trl-sync-") as tmp:
        config = model_config(args)
        write_checkpoint(Path(tmp), config, seed=1)
        write_tokenizer(Path(tmp), args.vocab)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_HOST_IP": "127.0.0.1"}
        cmd = [sys.executable, __file__, "--rank-of", tmp, "--rounds", str(args.rounds),
               *(["--fsdp"] if args.fsdp else [])]
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=args.timeout) for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            if p.returncode != 0:
                raise SystemExit(f"a rank failed:\n{err[-4000:]}")
        params = sum(v.numel() for v in _checkpoint(Path(tmp)).values())
    rows = [json.loads(line[7:]) for out, _ in outs for line in out.splitlines() if line.startswith("RESULT ")]
    return [{**r, "params": params} for r in rows]


def _checkpoint(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: the median over timed rounds of the slower rank's seconds, and rank 0's peak."""
    out: dict[str, Any] = {"params": rows[0]["params"]}
    for method in ("trl", "weightsync"):
        timed = [r for r in rows if r["method"] == method and r["round"] > 0]
        rounds = sorted({r["round"] for r in timed})
        out[method] = {
            "seconds": statistics.median(max(r["seconds"] for r in timed if r["round"] == k) for k in rounds),
            "peak_mb_main": statistics.median(r["peak_bytes"] for r in timed if r["rank"] == 0) / 1e6,
        }
    out["trl_over_weightsync"] = out["trl"]["seconds"] / out["weightsync"]["seconds"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (default: DDP replicas)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # a rank's process
    args = parser.parse_args()
    if args.rank_of:
        args.dir = args.rank_of
        rank_main(args)
        return 0
    result = summary(launch(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['params'] / 1e6:.1f}M parameters, 2 {'FSDP2' if args.fsdp else 'DDP'} ranks, colocated "
              f"vLLM (CPU), median of {args.rounds} rounds")
        print("| path | seconds per sync | peak extra memory, main process |")
        print("| --- | --- | --- |")
        for method in ("trl", "weightsync"):
            r = result[method]
            print(f"| {method} | {r['seconds']:.3f} | {r['peak_mb_main']:.0f} MB |")
        print(f"TRL / weightsync: {result['trl_over_weightsync']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
