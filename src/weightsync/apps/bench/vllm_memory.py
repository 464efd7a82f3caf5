"""``weightsync bench --suite vllm-memory``: a vLLM reader's extra memory during an update,
whole-model staging against phases of whole layers, side by side, on two model sizes.

For each model a writer process syncs two versions into a vLLM engine process
(:mod:`weightsync.integrations.vllm_memory` measures the engine process's peak resident memory
above its resident set before the update, and checks that the update really happened:
greedy output changes with version 1 and comes back, token for token, with version 2).
The target (issue 14): with phases, the extra memory stays within ``max_bucket_bytes``
plus the largest layer, whatever the model size; without, it grows with the model.
:func:`check_on_gpu` runs the same pair on a GPU for ``weightsync doctor`` (device memory
against weightsync's reserve, at a real ``gpu_memory_utilization``).

    rows = run_vllm_memory(bucket_bytes=16 << 20)
    passed, detail = check_on_gpu(gpus=1, timeout=600)
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

from weightsync.integrations.vllm_memory import GPU_MEMORY_UTILIZATION, PREFIX

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


def _writer(checkpoint: Path, job: str, bucket: int, *, phases: bool, timeout: float, device: str) -> None:
    from weightsync.integrations.vllm_memory import transport_for
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig, TransportOptions
    from weightsync.tools.tiny import CanonicalSource, canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    config = json.loads((checkpoint / "config.json").read_text())
    source = CanonicalSource(config, device=device)
    sync = SyncConfig(num_writers=1, num_readers=1, job=job, timeout=timeout, layer_phases=phases,
                      transport=transport_for("cpu" if device == "cpu" else "cuda"),
                      transport_options=TransportOptions(max_bucket_bytes=bucket))
    with WeightWriter(source, rank=0, config=sync) as writer:
        for version, seed in ((1, 1), (2, 2)):  # version 2: the checkpoint the engine started on
            fill_from_canonical(source.layout(), source.tensors(), canonical_weights(config, seed))
            writer.write(version)


def commands(checkpoint: Path, *, job: str, bucket: int, timeout: float, phases: bool, device: str = "cpu",
             gpus: int = 0, gpu_memory_utilization: float | None = None) -> tuple[list[str], list[str]]:
    """The engine (reader) process's command and the writer process's, for one case."""
    from weightsync.integrations.vllm_memory import writer_device

    common = ["--job", job, "--bucket", str(bucket), "--timeout", str(timeout), *(["--phases"] if phases else [])]
    utilization = [] if gpu_memory_utilization is None else ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    reader = [sys.executable, "-m", "weightsync.integrations.vllm_memory", "--checkpoint", str(checkpoint), *common,
              "--device", device, *utilization]
    writer = [sys.executable, "-m", "weightsync.apps.bench.vllm_memory", "writer", "--checkpoint", str(checkpoint),
              *common, "--device", writer_device(device, gpus)]
    return reader, writer


def _run_pair(reader_cmd: list[str], writer_cmd: list[str], *, env: dict[str, str],
              timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run the engine and the writer processes; (the engine's record, or None and why)."""
    reader = subprocess.Popen(reader_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = subprocess.Popen(writer_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = reader.communicate(timeout=timeout * 2)
        _, werr = writer.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        reader.kill()
        writer.kill()
        reader.communicate()
        writer.communicate()
        return None, "timed out"
    lines = [line[len(PREFIX):] for line in out.splitlines() if line.startswith(PREFIX)]
    if reader.returncode or writer.returncode or not lines:
        tail = " | ".join((err or werr).strip().splitlines()[-3:])
        return None, f"reader exit {reader.returncode}, writer exit {writer.returncode}: {tail}"
    return json.loads(lines[-1]), ""


def largest_layer_bytes(config: dict[str, Any]) -> int:
    """The bytes of the model's largest decoder layer (canonical tensors)."""
    from weightsync.layout import ModelSpec
    from weightsync.plan import layer_index

    per_layer: dict[int, int] = {}
    for tensor_name, tensor in ModelSpec.from_hf_config(config).canonical_tensors().items():
        index = layer_index(tensor_name)
        if index is not None:
            per_layer[index] = per_layer.get(index, 0) + tensor.nbytes
    return max(per_layer.values())


def _case(name: str, phases: bool, *, bucket: int, timeout: float, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    from weightsync.layout import ModelSpec
    from weightsync.tools.tiny import write_checkpoint

    config = model_config(name)
    spec = ModelSpec.from_hf_config(config)
    checkpoint = tmp / name
    if not checkpoint.exists():
        write_checkpoint(checkpoint, config, seed=2)
    reader_cmd, writer_cmd = commands(checkpoint, job=f"vllm-mem-{uuid.uuid4().hex[:8]}", bucket=bucket,
                                      timeout=timeout, phases=phases)
    row: dict[str, Any] = {"model": name, "parameters": spec.num_parameters, "mode": "phases" if phases else "whole",
                           "model_bytes": spec.num_parameters * 4, "bucket_bytes": bucket}
    record, error = _run_pair(reader_cmd, writer_cmd, env=env, timeout=timeout)
    if record is None:
        return row | {"error": error}
    largest_layer = largest_layer_bytes(config)
    row |= record
    row["largest_layer_bytes"] = largest_layer
    row["bound_bytes"] = bucket + largest_layer
    row["verified"] = bool(row["changed"] and row["restored"])
    return row


def _env(server: Any) -> dict[str, str]:
    return {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}


def check_on_gpu(*, gpus: int, timeout: float, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                 bucket: int = 16 << 20) -> tuple[bool, str]:
    """``weightsync doctor``'s ``engine/vllm-memory``: the tiny checkpoint (``weightsync.tools.tiny``)
    in a vLLM engine on ``cuda:0`` at a real ``gpu_memory_utilization``, two versions from a
    writer process over CUDA IPC; (passed, the figures) from
    :func:`weightsync.integrations.vllm_memory.device_verdict`."""
    from weightsync.integrations.vllm_memory import device_verdict
    from weightsync.meta.client import EmbeddedMetaServer
    from weightsync.tools.tiny import tiny_config, write_checkpoint

    config = tiny_config()
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-mem-") as tmp, EmbeddedMetaServer() as server:
        checkpoint = Path(tmp) / "tiny"
        write_checkpoint(checkpoint, config, seed=2)
        reader_cmd, writer_cmd = commands(checkpoint, job=f"vllm-mem-{uuid.uuid4().hex[:8]}", bucket=bucket,
                                          timeout=timeout, phases=False, device="cuda", gpus=gpus,
                                          gpu_memory_utilization=gpu_memory_utilization)
        record, error = _run_pair(reader_cmd, writer_cmd, env=_env(server), timeout=timeout)
    if record is None:
        return False, f"the vLLM engine on cuda:0 did not report its memory: {error}"[:500]
    return device_verdict(record, largest_layer_bytes=largest_layer_bytes(config))


def run_vllm_memory(*, bucket_bytes: int = 16 << 20, models: list[str] | None = None, timeout: float = 600.0,
                    meta_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every model, whole-model staging then phases; rows with the peak extra memory and the bound."""
    from weightsync.meta.client import EmbeddedMetaServer

    rows = []
    with tempfile.TemporaryDirectory(prefix="weightsync-vllm-mem-") as tmp, EmbeddedMetaServer() as server:
        env = {**_env(server), **(meta_env or {})}
        for name in models or list(MODELS):
            for phases in (False, True):
                rows.append(_case(name, phases, bucket=bucket_bytes, timeout=timeout, tmp=Path(tmp), env=env))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.bench.vllm_memory")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer")
    w.add_argument("--checkpoint", required=True, type=Path)
    w.add_argument("--job", required=True)
    w.add_argument("--bucket", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    w.add_argument("--phases", action="store_true")
    w.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    _writer(args.checkpoint, args.job, args.bucket, phases=args.phases, timeout=args.timeout, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
