"""FSDP2 training ranks -> a vLLM engine, weights synced after every optimizer step.

    python examples/fsdp_to_vllm.py [--steps 6]

Two trainer processes shard a tiny Qwen3 (transformers) with FSDP2 (gloo, CPU) and train
it on a toy objective: after a fixed prompt, produce a fixed target sequence. After each
step every trainer calls ``WeightWriter.write(step)``, which sends exactly its own shards'
bytes. The vLLM engine in this process (in-process, CPU) receives them straight into its
staging buffers, reloads, and generates greedily from the prompt: the output moves toward
the target as the weights change, and every output names the weight version it came from.

Needs ``pip install -e '.[vllm]'`` (docs/engines.md); transformers comes with vLLM.

The trainers describe their shards with ``DTensorSource``, which reads each parameter's
local FSDP2 shard and its place in the global tensor (no gather, no copy).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = [17 + 3 * i for i in range(40)]  # token ids; any will do
TARGET = [101, 202, 303, 404, 105, 206, 307, 408]
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention has nothing smaller
    "max_position_embeddings": 512, "tie_word_embeddings": True, "torch_dtype": "float32",
}
WORLD = 2


# -- trainers ----------------------------------------------------------------------------------

def train(rank: int, checkpoint: str, steps: int, job: str, lr: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3ForCausalLM

    from weightsync import SyncConfig, WeightWriter
    from weightsync.sources.dtensor import DTensorSource

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.tensor([PROMPT + TARGET])
    labels = torch.tensor([[-100] * len(PROMPT) + TARGET])  # learn the target, given the prompt

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    source = DTensorSource(model, config, rank=rank)  # between steps: parameters are sharded
    with WeightWriter(source, rank=rank, config=SyncConfig(num_writers=WORLD, num_readers=1, job=job)) as writer:
        for step in range(1, steps + 1):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            result = writer.write(step)  # returns once the engine applied it
            if rank == 0:
                print(f"[trainer] step {step}: loss {loss.item():.3f}, sent {result.nbytes / 1e3:.0f} kB "
                      f"from rank 0 in {result.seconds:.3f}s", flush=True)
    dist.destroy_process_group()


# -- the engine ----------------------------------------------------------------------------------

def serve(checkpoint: str, steps: int, job: str, server: Any) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from weightsync import SyncConfig, WeightReader
    from weightsync.engines.vllm import VLLMEngine
    from weightsync.meta.client import MetaClient

    llm = LLM(model=checkpoint, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
              kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=len(TARGET), ignore_eos=True, detokenize=False)

    def show(label: str) -> None:
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
        hits = sum(a == b for a, b in zip(out.token_ids, TARGET, strict=True))
        versions = [span.version for span in out.weight_versions]
        print(f"[vllm]    {label}: {list(out.token_ids)}  {hits}/{len(TARGET)} on target, weights {versions}",
              flush=True)

    print(f"[vllm]    target : {TARGET}", flush=True)
    show("start ")
    engine = VLLMEngine(llm)
    meta = MetaClient(server.address, job=job, token=server.token)
    with WeightReader(engine, rank=0, config=SyncConfig(num_writers=WORLD, num_readers=1, job=job),
                      meta=meta) as reader:
        for _ in range(steps):
            result = reader.update()
            show(f"step {result.version}")
            print(f"[vllm]    version {result.version}: {result.nbytes / 1e3:.0f} kB received, "
                  f"reload {result.phases.get('apply', 0.0) * 1e3:.0f} ms", flush=True)
    meta.close()
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--trainer-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="fsdp-to-vllm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_rank is not None:
        train(args.trainer_rank, args.checkpoint, args.steps, args.job, args.lr)
        return 0

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from weightsync.meta.client import EmbeddedMetaServer

    with tempfile.TemporaryDirectory(prefix="fsdp-to-vllm-") as tmp, EmbeddedMetaServer() as server:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**CONFIG)).save_pretrained(tmp)  # the weights both sides start from
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        trainers = [subprocess.Popen([sys.executable, __file__, "--trainer-rank", str(rank), "--checkpoint", tmp,
                                      "--steps", str(args.steps), "--job", args.job, "--lr", str(args.lr)], env=env)
                    for rank in range(WORLD)]
        try:
            started = time.perf_counter()
            serve(tmp, args.steps, args.job, server)
            codes = [proc.wait(timeout=120) for proc in trainers]
        finally:
            for proc in trainers:
                if proc.poll() is None:
                    proc.kill()
        print(f"done in {time.perf_counter() - started:.1f}s")
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
