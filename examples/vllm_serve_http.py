"""FSDP2 trainers -> a ``vllm serve`` process, through vLLM's own weight-transfer API.

    python examples/vllm_serve_http.py [--steps 6]

The only weightsync-specific lines are the backend names: the server runs with
``--weight-transfer-config '{"backend": "weightsync"}'`` and the trainers build a
``WeightSyncTrainerInitInfo``; everything else is vLLM's API (``WeightTransferTrainerFactory``,
``HTTPVLLMWeightSyncClient``, ``ModuleSource``). Two trainer processes shard a tiny Qwen3 with
FSDP2 (gloo, CPU) and learn a fixed continuation of a prompt; after every step each trainer
calls ``send_weights()``: every rank sends its own shards (no gather), rank 0 drives the
server's start / update / finish. Rank 0 then asks the server's OpenAI endpoint for a greedy
completion, which moves toward the target as the weights change.

Needs ``pip install -e '.[vllm]'`` (docs/engines.md). The RL routes of ``vllm serve`` are
enabled by ``VLLM_SERVER_DEV_MODE=1``; expose them only on a trusted network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

PROMPT = [17 + 3 * i for i in range(40)]
TARGET = [101, 202, 303, 404, 105, 206, 307, 408]
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 512, "tie_word_embeddings": True, "torch_dtype": "float32",
}
WORLD = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def completion(url: str, model: str) -> tuple[list[int], str]:
    import httpx

    body = {"model": model, "prompt": PROMPT, "max_tokens": len(TARGET), "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    tokens = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    return tokens, httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


def train(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3ForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo
    from weightsync.session.sync_session import SyncError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = Qwen3ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ids = torch.tensor([PROMPT + TARGET])
    labels = torch.tensor([[-100] * len(PROMPT) + TARGET])

    info = WeightSyncTrainerInitInfo(rank=rank, num_writers=WORLD, num_readers=1, meta_address=args.meta,
                                     meta_token=args.token, model_config=CONFIG)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(args.url),
                                                       source=ModuleSource(model))
    for step in range(1, args.steps + 1):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        t0 = time.perf_counter()
        try:
            engine.send_weights()  # every rank; returns once the server serves the new weights
        except SyncError as exc:
            # The server keeps its version if the failure never reached its weights; if it did, its
            # weight version (on every completion) is "invalid:<step>". The next step's version, in
            # full, recovers it: go on training.
            print(f"step {step}: the sync failed ({exc}); the next step's version recovers the server", flush=True)
            continue
        if rank == 0:
            tokens, version = completion(args.url, args.checkpoint)
            hits = sum(a == b for a, b in zip(tokens, TARGET, strict=True))
            print(f"step {step}: loss {loss.item():.3f}, synced in {time.perf_counter() - t0:.2f}s; server "
                  f"(weights {version}): {tokens} {hits}/{len(TARGET)} on target", flush=True)
    engine.shutdown()
    dist.destroy_process_group()


@contextlib.contextmanager
def vllm_server(checkpoint: str):
    import httpx

    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
           "--max-num-seqs", "2", "--skip-tokenizer-init", "--kv-cache-memory-bytes", str(32 << 20),
           "--weight-transfer-config", json.dumps({"backend": "weightsync"})]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not start (run its command by hand to see why)")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    for hidden in ("trainer-rank", "checkpoint", "url", "meta", "token"):
        parser.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_rank is not None:
        train(int(args.trainer_rank), args)
        return 0

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from weightsync.meta.client import EmbeddedMetaServer

    with tempfile.TemporaryDirectory(prefix="vllm-serve-http-") as tmp, EmbeddedMetaServer() as meta:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**CONFIG)).save_pretrained(tmp)
        with vllm_server(tmp) as url:
            print(f"vllm serve is up at {url}; server at start: {completion(url, tmp)[0]}", flush=True)
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
            trainers = [subprocess.Popen([sys.executable, __file__, "--trainer-rank", str(rank), "--checkpoint", tmp,
                                          "--url", url, "--meta", meta.address, f"--token={meta.token}",
                                          "--steps", str(args.steps), "--lr", str(args.lr)], env=env)
                        for rank in range(WORLD)]
            try:
                codes = [proc.wait(timeout=600) for proc in trainers]
            finally:
                for proc in trainers:
                    if proc.poll() is None:
                        proc.kill()
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
