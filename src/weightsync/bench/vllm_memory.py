"""``weightsync bench --suite vllm-memory``: a vLLM reader's extra memory during an update,
whole-model staging against phases of whole layers, side by side, on two model sizes.

For each model a writer process syncs two versions into a vLLM engine process
(:mod:`weightsync.integrations.vllm_memory` measures the engine process's peak resident memory
above its resident set before the update, and checks that the update really happened:
greedy output changes with version 1 and comes back, token for token, with version 2).
The target (issue 14): with phases, the extra memory stays within ``max_bucket_bytes``
plus the largest layer, whatever the model size; without, it grows with the model.

    rows = run_vllm_memory(bucket_bytes=16 << 20)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

#: name -> HF config of a Qwen3-style model (random weights; vocab kept small so layers dominate)
MODELS: dict[str, dict[str, Any]] = {
    "qwen3-30m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 64},
    "qwen3-0.2b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64},
    "qwen3-0.4b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 32,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64},
}


def model_config(name: str) -> dict[str, Any]:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} for the vLLM suites; known: {', '.join(MODELS)}")
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 4096,
            "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float32",
            "bos_token_id": 1, "eos_token_id": 2, **MODELS[name]}


def _writer(config: dict[str, Any], job: str, bucket: int, phases: bool, timeout: float) -> None:
    from weightsync.session import SyncConfig, TransportOptions
    from weightsync.tiny import CanonicalSource, canonical_weights
    from weightsync.torch_layout import fill_from_canonical
    from weightsync.writer import WeightWriter

    source = CanonicalSource(config)
    sync = SyncConfig(num_writers=1, num_readers=1, job=job, timeout=timeout, layer_phases=phases, transport="torch",
                      transport_options=TransportOptions(max_bucket_bytes=bucket))
    with WeightWriter(source, rank=0, config=sync) as writer:
        for version, seed in ((1, 1), (2, 2)):  # version 2: the checkpoint the engine started on
            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))
            writer.write(version)


def _case(name: str, phases: bool, *, bucket: int, timeout: float, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    from weightsync.layout import ModelSpec
    from weightsync.plan import layer_index
    from weightsync.tiny import write_checkpoint

    config = model_config(name)
    spec = ModelSpec.from_hf_config(config)
    checkpoint = tmp / name
    if not checkpoint.exists():
        write_checkpoint(checkpoint, config, seed=2)
    job = f"vllm-mem-{uuid.uuid4().hex[:8]}"
    reader = subprocess.Popen([sys.executable, "-m", "weightsync.integrations.vllm_memory", "--checkpoint",
                               str(checkpoint), "--job", job, "--bucket", str(bucket), "--timeout", str(timeout),
                               *(["--phases"] if phases else [])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    writer = subprocess.Popen([sys.executable, "-m", "weightsync.bench.vllm_memory", "writer", "--model", name,
                               "--job", job, "--bucket", str(bucket), "--timeout", str(timeout),
                               *(["--phases"] if phases else [])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    row: dict[str, Any] = {"model": name, "parameters": spec.num_parameters, "mode": "phases" if phases else "whole",
                           "model_bytes": spec.num_parameters * 4, "bucket_bytes": bucket}
    try:
        out, err = reader.communicate(timeout=timeout * 2)
        _, werr = writer.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        reader.kill()
        writer.kill()
        return row | {"error": "timed out"}
    lines = [line[len("WSVLLMMEM "):] for line in out.splitlines() if line.startswith("WSVLLMMEM ")]
    if reader.returncode or writer.returncode or not lines:
        tail = " | ".join((err or werr).strip().splitlines()[-3:])
        return row | {"error": f"reader exit {reader.returncode}, writer exit {writer.returncode}: {tail}"}
    canonical = spec.canonical_tensors()
    per_layer: dict[int | None, int] = {}
    for tensor_name, tensor in canonical.items():
        index = layer_index(tensor_name)
        per_layer[index] = per_layer.get(index, 0) + tensor.nbytes
    largest_layer = max(v for k, v in per_layer.items() if k is not None)
    row |= json.loads(lines[-1])
    row["largest_layer_bytes"] = largest_layer
    row["bound_bytes"] = bucket + largest_layer
    row["verified"] = bool(row["changed"] and row["restored"])
    return row


def run_vllm_memory(*, bucket_bytes: int = 16 << 20, models: list[str] | None = None, timeout: float = 600.0,
                    meta_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every model, whole-model staging then phases; rows with the peak extra memory and the bound."""
    from weightsync.meta.client import EmbeddedMetaServer

    rows = []
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-mem-") as tmp, EmbeddedMetaServer() as server:
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
               **(meta_env or {})}
        for name in models or list(MODELS):
            for phases in (False, True):
                rows.append(_case(name, phases, bucket=bucket_bytes, timeout=timeout, tmp=Path(tmp), env=env))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.bench.vllm_memory")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer")
    w.add_argument("--model", required=True, choices=sorted(MODELS))
    w.add_argument("--job", required=True)
    w.add_argument("--bucket", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    w.add_argument("--phases", action="store_true")
    args = parser.parse_args(argv)
    _writer(model_config(args.model), args.job, args.bucket, args.phases, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
