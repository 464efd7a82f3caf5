"""``weightsync bench --suite fewer-bytes``: FP8 quantize-on-send against full bf16 syncs.

The same model, the same training layout (two FSDP processes holding bf16) and the same
transport (torch/gloo, the network transport) in one run; only what the reader asks for
differs: the bf16 weights, 128x128-block FP8 (``hf:quant=fp8_block``) or per-channel FP8
(``hf:quant=fp8_channel``). Every version a reader receives is checked bitwise: bf16 against
the trainer's weights, FP8 against :func:`weightsync.tools.codecs.fp8.reference_quantize` of the full
tensors. Times are the writers' ``write()`` (quantize + send + until the reader applied it),
the slower writer per version, median over the timed versions.

    rows = run_fewer_bytes(model="qwen3-0.2b", versions=4)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import torch

from weightsync.apps.bench.vllm_memory import MODELS, model_config

MODES = {"bf16": "hf", "fp8_block": "hf:quant=fp8_block", "fp8_channel": "hf:quant=fp8_channel"}
SEEDS = (1, 2)  # versions alternate between two sets of weights (generating them is not what is measured)


def _config(model: str) -> dict[str, Any]:
    return {**model_config(model), "torch_dtype": "bfloat16"}


def _writer(model: str, job: str, rank: int, *, versions: int, bucket: int, timeout: float) -> None:
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig, TransportOptions
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.tiny import canonical_weights
    from weightsync.tools.torch_layout import fill_from_canonical

    torch.set_num_threads(1)
    config = _config(model)
    source = ShardedSource("fsdp:dp=2", config, rank)
    weights = {seed: {n: t.to(torch.bfloat16) for n, t in canonical_weights(config, seed).items()} for seed in SEEDS}
    sync = SyncConfig(num_writers=2, num_readers=1, job=job, timeout=timeout, transport="torch",
                      transport_options=TransportOptions(max_bucket_bytes=bucket))
    with WeightWriter(source, rank=rank, config=sync) as writer:
        for version in range(1, versions + 1):
            fill_from_canonical(source.layout(), source.tensors(), weights[SEEDS[version % 2]])
            result = writer.write(version)
            print("WSFEWER " + json.dumps({"version": version, "seconds": result.seconds, "nbytes": result.nbytes,
                                           "quantize": result.phases.get("quantize", 0.0)}), flush=True)


def _expected(config: dict[str, Any], mode: str) -> dict[int, dict[str, torch.Tensor]]:
    """What the reader's tensors must hold for each seed, by checkpoint name."""
    from weightsync.layout import ModelSpec
    from weightsync.layout.quant import SCHEMES, quantized_tensors
    from weightsync.tools.codecs.fp8 import reference_quantize
    from weightsync.tools.tiny import canonical_weights

    quantized = set(quantized_tensors(ModelSpec.from_hf_config(config))) if mode != "bf16" else set()
    out: dict[int, dict[str, torch.Tensor]] = {}
    for seed in SEEDS:
        tensors = {}
        for name, value in canonical_weights(config, seed).items():
            weight = value.to(torch.bfloat16)
            if name in quantized:
                q, scale = reference_quantize(weight, SCHEMES[mode])
                tensors[name] = q.view(torch.uint8)
                tensors[name[: -len("weight")] + SCHEMES[mode].scale_suffix] = scale
            else:
                tensors[name] = weight
        out[seed] = tensors
    return out


def _case(model: str, mode: str, *, versions: int, bucket: int, timeout: float, env: dict[str, str],
          address: str, token: str) -> dict[str, Any]:
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.layout import ModelSpec
    from weightsync.meta.client import MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig, TransportOptions

    config = _config(model)
    spec = ModelSpec.from_hf_config(config)
    expected = _expected(config, mode)
    job = f"fewer-{uuid.uuid4().hex[:8]}"
    writers = [subprocess.Popen([sys.executable, "-m", "weightsync.apps.bench.fewer_bytes", "writer", "--model", model,
                                 "--job", job, "--rank", str(rank), "--versions", str(versions), "--bucket",
                                 str(bucket), "--timeout", str(timeout)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    engine = ShardedEngine(MODES[mode], config, 0)
    sync = SyncConfig(num_writers=2, num_readers=1, job=job, timeout=timeout, transport="torch",
                      transport_options=TransportOptions(max_bucket_bytes=bucket))
    row: dict[str, Any] = {"model": model, "parameters": spec.num_parameters, "mode": mode, "versions": versions}
    wrong: list[str] = []
    try:
        with MetaClient(address, job=job, token=token) as meta, \
                WeightReader(engine, rank=0, config=sync, meta=meta) as reader:
            for version in range(1, versions + 1):
                result = reader.update(version, timeout=timeout)
                want = expected[SEEDS[version % 2]]
                for name, tensor in engine.tensors.items():
                    got = tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
                    if not torch.equal(got, want[name]):
                        wrong.append(f"v{version} {name}")
                row["reader_nbytes"] = result.nbytes
        outs = [w.communicate(timeout=timeout) for w in writers]
    except Exception as exc:  # a failed case is a row with its error, not a crashed suite
        for w in writers:
            w.kill()
        return row | {"error": f"{type(exc).__name__}: {exc}"[:300]}
    records: dict[int, list[dict[str, Any]]] = {}
    for w, (out, err) in zip(writers, outs, strict=True):
        if w.returncode:
            return row | {"error": f"writer exit {w.returncode}: {err.strip().splitlines()[-1:]}"}
        for line in out.splitlines():
            if line.startswith("WSFEWER "):
                rec = json.loads(line[len("WSFEWER "):])
                records.setdefault(rec["version"], []).append(rec)
    timed = [v for v in sorted(records) if v > 1]  # version 1 plans and connects
    row["seconds"] = statistics.median(max(r["seconds"] for r in records[v]) for v in timed)
    row["quantize_seconds"] = statistics.median(max(r["quantize"] for r in records[v]) for v in timed)
    row["nbytes"] = sum(r["nbytes"] for r in records[timed[-1]])
    row["verified"] = not wrong
    if wrong:
        row["error"] = f"{len(wrong)} tensors differ, e.g. {wrong[:3]}"
    return row


def run_fewer_bytes(*, model: str = "qwen3-0.2b", versions: int = 4, bucket_bytes: int = 64 << 20,
                    timeout: float = 600.0, modes: list[str] | None = None) -> list[dict[str, Any]]:
    """Each mode in turn on the same model and layout; rows with bytes, seconds and ratios to bf16."""
    from weightsync.meta.client import EmbeddedMetaServer

    rows = []
    with EmbeddedMetaServer() as server:
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "OMP_NUM_THREADS": "1"}
        for mode in modes or list(MODES):
            started = time.perf_counter()
            row = _case(model, mode, versions=versions, bucket=bucket_bytes, timeout=timeout, env=env,
                        address=server.address, token=server.token)
            row["wall_seconds"] = time.perf_counter() - started
            rows.append(row)
    full = next((r for r in rows if r["mode"] == "bf16" and "error" not in r), None)
    for r in rows:
        if full is not None and "error" not in r:
            r["bytes_vs_bf16"] = r["nbytes"] / full["nbytes"]
            r["seconds_vs_bf16"] = r["seconds"] / full["seconds"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.bench.fewer_bytes")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer")
    w.add_argument("--model", required=True, choices=sorted(MODELS))
    w.add_argument("--job", required=True)
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--versions", type=int, required=True)
    w.add_argument("--bucket", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    _writer(args.model, args.job, args.rank, versions=args.versions, bucket=args.bucket, timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
