"""The end-to-end demo: 2 training processes -> 2 inference processes, several versions.

``weightsync demo`` (this module: the command, the parent and the workers) starts an
embedded meta server and four worker processes (plain subprocesses: nothing is pickled
between them). Writers hold a Qwen3-style model in a
training layout (Megatron TP2 by default: fused ``linear_qkv`` per query group and
``linear_fc1`` [gate_r; up_r]); readers hold it in an inference layout (vLLM style, TP1 x 2
replicas: fused ``qkv_proj`` and ``gate_up_proj``). Each step the writers change every
weight, writer 0 saves the canonical checkpoint, all writers ``write(step)``, and each reader
``update()``s in place and then verifies its weights against the checkpoint tensor by
tensor (bitwise) with :mod:`weightsync.verify`. Workers print one JSON line per step; the
parent prints a table.

    python -m weightsync.commands.demo worker --role writer --rank 0 --spec '<json>'   # what the parent runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.deadline import Deadline

SIZES: Mapping[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000},
    "small": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000},
    "medium": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000},
}


def model_config(size: str, dtype: str = "float32") -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": False,
            "torch_dtype": dtype, **SIZES[size]}


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    """Everything a worker needs, passed as JSON on its command line."""

    config: dict[str, Any]
    source: str
    target: str
    num_writers: int
    num_readers: int
    steps: int
    transport: str
    checkpoints: str
    max_bucket_bytes: int
    timeout: float
    #: per role, the device of each rank's tensors ("cpu", "cuda:N"); empty: every rank on cpu
    devices: dict[str, list[str]] = field(default_factory=dict)

    def device(self, role: str, rank: int) -> str:
        return self.devices[role][rank] if self.devices else "cpu"

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def canonical_values(config: Mapping[str, Any], step: int) -> dict[str, Any]:
    """Deterministic weights for ``step`` (every process computes the same tensors)."""
    import torch

    from weightsync.layout import ModelSpec
    from weightsync.torch_layout import TORCH_DTYPES

    spec = ModelSpec.from_hf_config(config)
    out = {}
    for i, (name, tensor) in enumerate(spec.canonical_tensors().items()):
        gen = torch.Generator().manual_seed(1000 * step + i)
        out[name] = torch.randn(tensor.shape, generator=gen).to(TORCH_DTYPES[tensor.dtype])
    return out


def run_writer(spec: DemoSpec, rank: int) -> None:
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.session import SyncConfig
    from weightsync.sources.module import ShardedSource
    from weightsync.torch_layout import allocate, fill_from_canonical
    from weightsync.transport import TransportOptions
    from weightsync.verify import save_canonical
    from weightsync.writer import WeightWriter

    layout = parse_layout(spec.source).rank_layout(ModelSpec.from_hf_config(spec.config), rank)
    source = ShardedSource(spec.source, spec.config, rank, allocate(layout, device=spec.device("writer", rank)))
    config = _sync_config(spec, SyncConfig, TransportOptions)
    with WeightWriter(source, rank=rank, config=config) as writer:
        for step in range(spec.steps):
            t0 = time.perf_counter()
            values = canonical_values(spec.config, step)
            fill_from_canonical(source.layout(), source.tensors(), values)
            if rank == 0:
                save_canonical(values, os.path.join(spec.checkpoints, f"step{step}"))
            train_seconds = time.perf_counter() - t0
            result = writer.write(step, timeout=spec.timeout)
            _emit({"role": "writer", "rank": rank, "version": step, "bytes": result.nbytes,
                   "phases": result.phases, "train_seconds": train_seconds})


def run_reader(spec: DemoSpec, rank: int) -> None:
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.reader import WeightReader
    from weightsync.session import SyncConfig
    from weightsync.transport import TransportOptions
    from weightsync.verify import verify_rank

    engine = ShardedEngine(spec.target, spec.config, rank, device=spec.device("reader", rank))
    pointers = {n: t.data_ptr() for n, t in engine.tensors.items()}
    config = _sync_config(spec, SyncConfig, TransportOptions)
    with WeightReader(engine, rank=rank, config=config) as reader:
        for _ in range(spec.steps):
            result = reader.update(timeout=spec.timeout)
            report = verify_rank(engine.layout(), engine.tensors,
                                 os.path.join(spec.checkpoints, f"step{result.version}"))
            in_place = all(t.data_ptr() == pointers[n] for n, t in engine.tensors.items())
            bad = [t.name for t in report.tensors.values() if t.status != "ok"]
            _emit({"role": "reader", "rank": rank, "version": result.version, "bytes": result.nbytes,
                   "phases": result.phases, "gbps": result.gbps, "verified": report.matches,
                   "mismatches": bad[:5], "in_place": in_place})


def _sync_config(spec: DemoSpec, sync_cls: Any, opts_cls: Any) -> Any:
    return sync_cls(num_writers=spec.num_writers, num_readers=spec.num_readers, transport=spec.transport,
                    transport_options=opts_cls(max_bucket_bytes=spec.max_bucket_bytes), timeout=spec.timeout)


def _emit(record: dict[str, Any]) -> None:
    print("WEIGHTSYNC " + json.dumps(record), flush=True)


# -- the command ---------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default small, ~58M params)")
    p.add_argument("--source", default="megatron:tp=2", help="training layout (default megatron:tp=2)")
    p.add_argument("--target", default="vllm:tp=1,replicas=2", help="inference layout (default vllm:tp=1,replicas=2)")
    p.add_argument("--steps", type=int, default=3, help="training steps, one sync after each")
    p.add_argument("--transport", default="auto", help="auto | torch | shm | file | nixl")
    p.add_argument("--max-bucket-mb", type=int, default=32, help="staging memory bound per process")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for each sync")


def run(args: argparse.Namespace) -> int:
    result = run_demo(size=args.size, source=args.source, target=args.target, steps=args.steps,
                      transport=args.transport, max_bucket_bytes=args.max_bucket_mb << 20, timeout=args.timeout)
    return 0 if result["ok"] else 1


# -- parent -----------------------------------------------------------------------------------

def run_demo(*, size: str = "small", source: str = "megatron:tp=2", target: str = "vllm:tp=1,replicas=2",
             steps: int = 3, transport: str = "auto", max_bucket_bytes: int = 32 << 20, timeout: float = 120.0,
             quiet: bool = False, devices: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Run the demo; returns the per-step records and whether every check passed.

    ``devices`` places each rank's tensors (``{"writer": ["cuda:0"], "reader": ["cuda:1"]}``);
    ``weightsync doctor`` uses it to check GPU placements.
    """
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.meta.client import EmbeddedMetaServer

    config = model_config(size)
    spec_model = ModelSpec.from_hf_config(config)
    src, dst = parse_layout(source), parse_layout(target)
    src.validate(spec_model)
    dst.validate(spec_model)
    with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as tmp, EmbeddedMetaServer() as server:
        spec = DemoSpec(config=config, source=src.describe(), target=dst.describe(), num_writers=src.world_size,
                        num_readers=dst.world_size, steps=steps, transport=transport, checkpoints=tmp,
                        max_bucket_bytes=max_bucket_bytes, timeout=timeout, devices=devices or {})
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs = []
        for role, n in (("writer", spec.num_writers), ("reader", spec.num_readers)):
            for rank in range(n):
                cmd = [sys.executable, "-m", "weightsync.commands.demo", "worker", "--role", role, "--rank", str(rank),
                       "--spec", spec.to_json()]
                procs.append((role, rank, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                           stderr=subprocess.PIPE, text=True)))
        records, failures = _collect(procs, deadline=Deadline.after(timeout * (steps + 2)))
    ok = not failures and all(r.get("verified") and r.get("in_place") for r in records if r["role"] == "reader")
    result = {"ok": ok, "records": records, "failures": failures, "size": size, "source": spec.source,
              "target": spec.target, "parameters": spec_model.num_parameters}
    if not quiet:
        _print_table(result)
    return result


def _collect(procs: list[tuple[str, int, subprocess.Popen[str]]], deadline: Deadline
             ) -> tuple[list[dict[str, Any]], list[str]]:
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    for role, rank, proc in procs:
        try:
            out, err = proc.communicate(timeout=deadline.remaining(1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{role} {rank} timed out")
        records += [json.loads(line[len("WEIGHTSYNC "):]) for line in out.splitlines()
                    if line.startswith("WEIGHTSYNC ")]
        if proc.returncode != 0:
            tail = err.strip().splitlines()[-3:]
            failures.append(f"{role} {rank} exited {proc.returncode}: {' | '.join(tail)}")
    # Make sure nothing outlives the demo, whatever happened.
    for _, _, proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return records, failures


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    readers = sorted((r for r in result["records"] if r["role"] == "reader"), key=lambda r: (r["version"], r["rank"]))
    table = Table(title=f"weightsync demo: {result['source']} -> {result['target']} "
                        f"({result['parameters'] / 1e6:.1f}M parameters)")
    for col in ("version", "reader", "MB", "wait s", "transfer s", "apply s", "GB/s", "bitwise", "in place"):
        table.add_column(col, justify="right")
    for r in readers:
        ph = r["phases"]
        transfer = sum(v for k, v in ph.items() if k.startswith("receive."))
        table.add_row(str(r["version"]), str(r["rank"]), f"{r['bytes'] / 1e6:.1f}", f"{ph.get('wait', 0):.3f}",
                      f"{transfer:.3f}", f"{ph.get('apply', 0):.4f}", f"{r['gbps']:.2f}",
                      "yes" if r["verified"] else "NO", "yes" if r["in_place"] else "NO")
    console.print(table)
    writers = [r for r in result["records"] if r["role"] == "writer"]
    if writers:
        phases: dict[str, float] = {}
        for r in writers:
            for k, v in r["phases"].items():
                phases[k] = phases.get(k, 0.0) + v / len(writers)
        console.print("writer phases (mean seconds per write): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items())))
    for failure in result["failures"]:
        console.print(f"[red]FAILED[/red] {failure}")
    console.print("[green]demo OK: every version arrived bitwise-equal, in place[/green]" if result["ok"]
                  else "[red]demo FAILED[/red]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.commands.demo")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--role", choices=["writer", "reader"], required=True)
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    spec = DemoSpec(**json.loads(args.spec))
    device = spec.device(args.role, args.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # this process's GPU, for every library in it
    (run_writer if args.role == "writer" else run_reader)(spec, args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
