"""The end-to-end demo: 2 training processes -> 2 inference processes, several versions.

:func:`run_demo` starts an embedded meta server and four worker processes (plain
subprocesses: nothing is pickled between them). Writers hold a Qwen3-style model in a
training layout (Megatron TP2 by default: fused ``linear_qkv`` per query group and
``linear_fc1`` [gate_r; up_r]); readers hold it in an inference layout (vLLM style, TP1 x 2
replicas: fused ``qkv_proj`` and ``gate_up_proj``). Each step the writers change every
weight, writer 0 saves the canonical checkpoint, all writers ``write(step)``, and each reader
``update()``s in place and then verifies its weights against the checkpoint tensor by
tensor (bitwise) with :mod:`weightsync.verify`. Workers print one JSON line per step; the
parent returns them as a typed :class:`DemoResult` (``weightsync demo`` prints it as a table,
``weightsync doctor`` checks it).

    result = run_demo(size="tiny", steps=2)
    assert result.ok, result.failures
    python -m weightsync.demo worker --role writer --rank 0 --spec '<json>'   # what run_demo runs
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
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.deadline import Deadline

#: How a worker's line on stdout starts (the rest is one JSON record).
PREFIX = "WEIGHTSYNC "

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
    #: ``TransportOptions.delta_anchor_every`` (0: every version in full)
    delta_anchor_every: int = 0

    def device(self, role: str, rank: int) -> str:
        return self.devices[role][rank] if self.devices else "cpu"

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


@dataclass(frozen=True, kw_only=True)
class WriterStep:
    """One ``write`` of one writer process."""

    rank: int
    version: int
    nbytes: int
    phases: dict[str, float]
    train_seconds: float


@dataclass(frozen=True, kw_only=True)
class ReaderStep:
    """One ``update`` of one reader process, and what checking its weights found."""

    rank: int
    version: int
    nbytes: int
    phases: dict[str, float]
    gbps: float
    verified: bool  # every tensor bitwise equal to the checkpoint of this version
    mismatches: list[str]  # the first tensors that differ
    in_place: bool  # every buffer kept its storage

    @property
    def transfer_seconds(self) -> float:
        return sum(v for k, v in self.phases.items() if k.startswith("receive."))


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """What :func:`run_demo` saw: every worker's steps, the failures, and whether all checks passed."""

    ok: bool
    writers: list[WriterStep]
    readers: list[ReaderStep]
    failures: list[str]
    size: str
    source: str
    target: str
    parameters: int


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


# -- the workers -------------------------------------------------------------------------------

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
            _emit(WriterStep(rank=rank, version=step, nbytes=result.nbytes, phases=result.phases,
                             train_seconds=train_seconds))


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
            _emit(ReaderStep(rank=rank, version=result.version, nbytes=result.nbytes, phases=result.phases,
                             gbps=result.gbps, verified=report.matches, mismatches=bad[:5], in_place=in_place))


def _sync_config(spec: DemoSpec, sync_cls: Any, opts_cls: Any) -> Any:
    return sync_cls(num_writers=spec.num_writers, num_readers=spec.num_readers, transport=spec.transport,
                    transport_options=opts_cls(max_bucket_bytes=spec.max_bucket_bytes,
                                               delta_anchor_every=spec.delta_anchor_every), timeout=spec.timeout)


def _emit(step: WriterStep | ReaderStep) -> None:
    role = "writer" if isinstance(step, WriterStep) else "reader"
    print(PREFIX + json.dumps({"role": role, **asdict(step)}), flush=True)


def _parse(line: str) -> WriterStep | ReaderStep:
    record = json.loads(line[len(PREFIX):])
    return (WriterStep if record.pop("role") == "writer" else ReaderStep)(**record)


# -- the parent ----------------------------------------------------------------------------------

def run_demo(*, size: str = "small", source: str = "megatron:tp=2", target: str = "vllm:tp=1,replicas=2",
             steps: int = 3, transport: str = "auto", max_bucket_bytes: int = 32 << 20, timeout: float = 120.0,
             devices: dict[str, list[str]] | None = None, delta_anchor_every: int = 0) -> DemoResult:
    """Run the demo (see module docstring); a failure is in the result, never raised.

    ``devices`` places each rank's tensors (``{"writer": ["cuda:0"], "reader": ["cuda:1"]}``);
    ``weightsync doctor`` uses it to check GPU placements, and ``delta_anchor_every`` to check deltas there.

    Raises:
        ValueError: an unknown size, or layouts the model does not fit.
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
                        max_bucket_bytes=max_bucket_bytes, timeout=timeout, devices=devices or {},
                        delta_anchor_every=delta_anchor_every)
        env = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs = []
        for role, n in (("writer", spec.num_writers), ("reader", spec.num_readers)):
            for rank in range(n):
                cmd = [sys.executable, "-m", "weightsync.demo", "worker", "--role", role, "--rank", str(rank),
                       "--spec", spec.to_json()]
                procs.append((role, rank, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                           stderr=subprocess.PIPE, text=True)))
        steps_seen, failures = _collect(procs, deadline=Deadline.after(timeout * (steps + 2)))
    writers = [s for s in steps_seen if isinstance(s, WriterStep)]
    readers = [s for s in steps_seen if isinstance(s, ReaderStep)]
    ok = not failures and all(r.verified and r.in_place for r in readers)
    return DemoResult(ok=ok, writers=writers, readers=readers, failures=failures, size=size, source=spec.source,
                      target=spec.target, parameters=spec_model.num_parameters)


def _collect(procs: list[tuple[str, int, subprocess.Popen[str]]], deadline: Deadline
             ) -> tuple[list[WriterStep | ReaderStep], list[str]]:
    steps: list[WriterStep | ReaderStep] = []
    failures: list[str] = []
    for role, rank, proc in procs:
        try:
            out, err = proc.communicate(timeout=deadline.remaining(1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{role} {rank} timed out")
        steps += [_parse(line) for line in out.splitlines() if line.startswith(PREFIX)]
        if proc.returncode != 0:
            tail = err.strip().splitlines()[-3:]
            failures.append(f"{role} {rank} exited {proc.returncode}: {' | '.join(tail)}")
    # Make sure nothing outlives the demo, whatever happened.
    for _, _, proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return steps, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.demo")
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
