"""One GPU, two processes: weightsync's shared-memory transport over CUDA IPC, 1B-8B models.

A training process (Megatron TP1 layout: fused ``linear_qkv`` per query group and
``linear_fc1``) and an inference process (vLLM TP1: fused ``qkv_proj`` / ``gate_up_proj``)
share one GPU, as in co-located RL. The writer exposes one CUDA allocation by IPC handle
(its tensors live on the GPU, so the transport uses CUDA IPC); each ``write(v)`` packs the writer's shards into it
and the reader copies every op straight into its parameters: two device-to-device copies
per byte, no host round trip. The device's own copy bandwidth (``dst.copy_(src)`` of the
same number of bytes, up to 4 GiB, median of 5) is measured by the writer in the same run,
and every row reports the sync time against one such copy of the model's bytes.

    python benchmarks/gpu.py                       # 1b, 3b, 8b in bf16
    python benchmarks/gpu.py --sizes 8b --reps 10 --json

Timing: the writer's ``write(v)`` with staleness 0, i.e. from the start of packing until the
reader reported version ``v`` applied (median over ``--reps`` after one warm-up). Every
version carries new weights (``WeightPool.at(v)``, filled untimed before ``write(v)``), and
after each version the reader checks every byte it holds against them, untimed, and tells
the writer (a meta-server document) before the writer starts the next version; ``bytes``
is what the reader's transport really received. Without CUDA the script exits with status
2 and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "1b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
           "vocab_size": 128256, "tie_word_embeddings": True},                          # Llama-3.2-1B
    "3b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
           "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
           "vocab_size": 128256, "tie_word_embeddings": True},                          # Llama-3.2-3B
    "8b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "vocab_size": 128256, "tie_word_embeddings": False},                         # Llama-3.1-8B
}
SOURCE, TARGET = "megatron:tp=1", "vllm:tp=1"
PREFIX = "WSGPU "


def _cuda_or_exit() -> None:
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py needs a CUDA device, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). "
              "Run it on a GPU machine; the CPU benchmarks are `weightsync bench`.", file=sys.stderr)
        sys.exit(2)


def _config(size: str, dtype: str) -> dict[str, Any]:
    return {**MODELS[size], "torch_dtype": dtype}


def device_copy_gbps(nbytes: int, reps: int = 5) -> float:
    import torch

    n = max(min(nbytes, 4 << 30), 1 << 20)
    src = torch.ones(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return n / statistics.median(times) / 1e9


def worker(role: str, spec: dict[str, Any]) -> None:
    import torch

    from weightsync.apps.bench.baselines import reader_bytes
    from weightsync.apps.bench.weights import WeightPool, fill, mismatches
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.meta.client import MetaClient
    from weightsync.roles.reader import WeightReader
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.torch_layout import allocate
    from weightsync.transport import TransportOptions

    torch.cuda.set_device(0)
    config = spec["config"]
    model = ModelSpec.from_hf_config(config)
    kind = parse_layout(SOURCE if role == "writer" else TARGET)
    layout = kind.rank_layout(model, 0)
    tensors = allocate(layout, device="cuda")
    pool = WeightPool.for_layout(layout, device="cuda")
    sync = SyncConfig(num_writers=1, num_readers=1, job=spec["job"], transport="shm", timeout=spec["timeout"],
                      transport_options=TransportOptions(slots=1, max_bucket_bytes=spec["max_bucket_bytes"]))
    steps = spec["warmup"] + spec["reps"]
    # The bench's own handshake (not weightsync's): "reader checked version v".
    board = MetaClient.from_env(job=f"{spec['job']}-checks")
    if role == "writer":
        copy_gbps = device_copy_gbps(reader_bytes(layout))
        times, phases = [], []
        with WeightWriter(ShardedSource(SOURCE, config, 0, tensors), rank=0, config=sync) as writer:
            for v in range(steps):
                if v and board.get_document(f"checked/{v - 1}", wait=spec["timeout"]) is None:
                    raise TimeoutError(f"the reader did not check version {v - 1} in time")
                fill(layout, tensors, pool.at(v))  # untimed: "training" made version v
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                result = writer.write(v)
                if v >= spec["warmup"]:
                    times.append(time.perf_counter() - t0)
                    phases.append(result.phases)
        board.close()
        print(PREFIX + json.dumps({"role": role, "seconds": times, "phases": phases, "copy_gbps": copy_gbps,
                                   "peak_allocated": torch.cuda.max_memory_allocated()}), flush=True)
        return
    engine = ShardedEngine(TARGET, config, 0, tensors)
    phases, received, bad = [], [], set()
    with WeightReader(engine, rank=0, config=sync) as reader:
        for v in range(steps):
            result = reader.update(v)
            torch.cuda.synchronize()
            bad.update(mismatches(layout, tensors, pool.at(v)) if result.version == v else ["<wrong version>"])
            board.put_document(f"checked/{v}", b"1")
            if v >= spec["warmup"]:
                phases.append(result.phases)
                received.append(result.nbytes)
    board.close()
    print(PREFIX + json.dumps({"role": role, "bytes": int(statistics.median(received)),
                               "needed_bytes": reader_bytes(layout), "phases": phases,
                               "verified": not bad, "mismatches": sorted(bad)[:5]}), flush=True)


def run_size(size: str, args: argparse.Namespace, meta_env: dict[str, str]) -> dict[str, Any]:
    spec = {"config": _config(size, args.dtype), "job": f"gpu-{size}-{os.getpid()}", "timeout": args.timeout,
            "warmup": 1, "reps": args.reps, "max_bucket_bytes": args.max_bucket_mb << 20}
    env = {**os.environ, **meta_env}
    procs = {role: subprocess.Popen([sys.executable, __file__, "--worker", role, "--spec", json.dumps(spec)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("reader", "writer")}
    out: dict[str, Any] = {}
    errors = []
    for role, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout * (args.reps + 3))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            stdout, stderr = proc.communicate()
            errors.append(f"{role} timed out")
        lines = [json.loads(x[len(PREFIX):]) for x in stdout.splitlines() if x.startswith(PREFIX)]
        if proc.returncode != 0 or not lines:
            errors.append(f"{role} exited {proc.returncode}: {' | '.join(stderr.strip().splitlines()[-3:])}")
        else:
            out[role] = lines[-1]
    row: dict[str, Any] = {"size": size, "dtype": args.dtype, "source": SOURCE, "target": TARGET}
    if errors:
        return row | {"error": "; ".join(errors)}
    from weightsync.layout import ModelSpec

    w, r = out["writer"], out["reader"]
    seconds = statistics.median(w["seconds"])
    copy_seconds = r["bytes"] / (w["copy_gbps"] * 1e9)
    return row | {"parameters": ModelSpec.from_hf_config(spec["config"]).num_parameters, "bytes": r["bytes"],
                  "seconds": seconds, "seconds_reps": w["seconds"], "gbps": r["bytes"] / seconds / 1e9,
                  "device_copy_gbps": w["copy_gbps"], "over_device_copy": seconds / copy_seconds,
                  "verified": r["verified"], "writer_phases": w["phases"][-1], "reader_phases": r["phases"][-1],
                  "writer_peak_allocated": w["peak_allocated"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1b,3b,8b", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-bucket-mb", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--worker", choices=["writer", "reader"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = sorted(set(sizes) - set(MODELS))
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {sorted(MODELS)}")
    _cuda_or_exit()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0
    import torch
    from rich.console import Console
    from rich.table import Table

    from weightsync.meta import EmbeddedMetaServer

    rows = []
    with EmbeddedMetaServer() as server:
        meta_env = {"WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token}
        for size in sizes:
            rows.append(run_size(size, args, meta_env))
    console = Console(stderr=args.json, width=160)
    table = Table(title=f"weightsync shm over CUDA IPC, two processes on one {torch.cuda.get_device_name(0)}")
    for col in ("model", "params", "GB", "seconds", "GB/s", "device copy GB/s", "x device copy", "bitwise"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["size"], "", "", "", "", "", "", f"[red]{r['error'][:80]}[/red]")
            continue
        table.add_row(r["size"], f"{r['parameters'] / 1e9:.2f}B", f"{r['bytes'] / 1e9:.2f}", f"{r['seconds']:.4f}",
                      f"{r['gbps']:.1f}", f"{r['device_copy_gbps']:.1f}", f"{r['over_device_copy']:.2f}",
                      "yes" if r["verified"] else "[red]NO[/red]")
    console.print(table)
    if args.json:
        print(json.dumps({"rows": rows, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    return 0 if all("error" not in r and r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
