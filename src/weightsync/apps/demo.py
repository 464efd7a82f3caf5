"""The end-to-end demo: 2 training processes -> 2 inference processes, several versions.

:func:`run_demo` starts an embedded meta server and four worker processes (plain
subprocesses: nothing is pickled between them). Writers hold a Qwen3-style model in a
training layout (Megatron TP2 by default: fused ``linear_qkv`` per query group and
``linear_fc1`` [gate_r; up_r]); readers hold it in an inference layout (vLLM style, TP1 x 2
replicas: fused ``qkv_proj`` and ``gate_up_proj``). Each step the writers change every
weight, writer 0 saves the canonical checkpoint, all writers ``write(step)``, and each reader
``update()``s in place and then verifies its weights against the checkpoint tensor by
tensor (bitwise) with :mod:`weightsync.tools.verify`. Workers print one JSON line per step; the
parent returns them as a typed :class:`DemoResult` (``weightsync demo`` prints it as a table,
``weightsync doctor`` checks it).

    result = run_demo(size="tiny", steps=2)
    assert result.ok, result.failures
    python -m weightsync.apps.demo worker --role writer --rank 0 --spec '<json>'   # what run_demo runs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.apps.demo_records import (
    _RECORDS,
    FAULT_SECONDS,
    DemoResult,
    ReaderKilled,
    ReaderStep,
    Record,
    WriterFailed,
    WriterStep,
)
from weightsync.clock.deadline import Deadline

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
    #: ``TransportOptions.nixl_mode`` (only with ``transport="nixl"``: SyncConfig refuses it elsewhere)
    nixl_mode: str = "auto"
    #: ``SyncConfig.layer_phases``: each version moves in phases of whole layers
    layer_phases: bool = False
    #: per role, each rank's ``SyncConfig.host`` (its node name: ``routed`` picks shared memory
    #: between ranks of one node, torch across); empty: every rank on this host
    hosts: dict[str, list[str]] = field(default_factory=dict)
    #: per role, environment variables added to its processes (e.g. ``CUDA_VISIBLE_DEVICES``)
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the reader rank that SIGKILLs itself as it starts receiving the last version (-1: none);
    #: its writers must fail that version within FAULT_SECONDS naming it, and exit cleanly
    kill_reader: int = -1
    #: how ``kill_reader`` fails: "kill" (SIGKILL: it dies) or "stop" (SIGSTOP: it hangs, alive,
    #: until the demo kills it at the end)
    fault: str = "kill"
    #: reader 0 moves the job to a new epoch after this version (-1: never), as a failure would:
    #: every transport connection is formed again for the next version
    new_epoch_at: int = -1
    #: every rank in one process, a thread each: a trainer and an engine sharing a process
    same_process: bool = False

    def device(self, role: str, rank: int) -> str:
        return self.devices[role][rank] if self.devices else "cpu"

    def host(self, role: str, rank: int) -> str:
        return self.hosts[role][rank] if self.hosts else ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__)




def canonical_values(config: Mapping[str, Any], step: int) -> dict[str, Any]:
    """Deterministic weights for ``step`` (every process computes the same tensors)."""
    import torch

    from weightsync.layout import ModelSpec
    from weightsync.tools.torch_layout import TORCH_DTYPES

    spec = ModelSpec.from_hf_config(config)
    out = {}
    for i, (name, tensor) in enumerate(spec.canonical_tensors().items()):
        gen = torch.Generator().manual_seed(1000 * step + i)
        out[name] = torch.randn(tensor.shape, generator=gen).to(TORCH_DTYPES[tensor.dtype])
    return out


# -- the workers -------------------------------------------------------------------------------

def run_writer(spec: DemoSpec, rank: int) -> None:
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.roles.writer import WeightWriter
    from weightsync.session.sync_session import SyncConfig
    from weightsync.sources.module import ShardedSource
    from weightsync.tools.torch_layout import allocate, fill_from_canonical
    from weightsync.tools.verify import save_canonical
    from weightsync.transport import TransportOptions

    layout = parse_layout(spec.source).rank_layout(ModelSpec.from_hf_config(spec.config), rank)
    source = ShardedSource(spec.source, spec.config, rank, allocate(layout, device=spec.device("writer", rank)))
    config = _sync_config(spec, SyncConfig, TransportOptions, spec.host("writer", rank))
    with WeightWriter(source, rank=rank, config=config) as writer:
        for step in range(spec.steps):
            t0 = time.perf_counter()
            values = canonical_values(spec.config, step)
            fill_from_canonical(source.layout(), source.tensors(), values)
            if rank == 0:
                save_canonical(values, os.path.join(spec.checkpoints, f"step{step}"))
            train_seconds = time.perf_counter() - t0
            try:
                result = writer.write(step, timeout=spec.timeout)
            except Exception as exc:
                if spec.kill_reader < 0 or step != spec.steps - 1:
                    raise
                # the version its reader died in: the error is the result, and this process lives on
                _emit(WriterFailed(rank=rank, version=step, error=f"{type(exc).__name__}: {exc}", at=time.time()))
                break
            _emit(WriterStep(rank=rank, version=step, nbytes=result.nbytes, phases=result.phases,
                             train_seconds=train_seconds, device_bytes=_device_bytes(spec.device("writer", rank))))


def run_reader(spec: DemoSpec, rank: int) -> None:
    from weightsync.engines.buffers import ShardedEngine
    from weightsync.roles.reader import WeightReader
    from weightsync.session.sync_session import SyncConfig
    from weightsync.tools.verify import verify_rank
    from weightsync.transport import TransportOptions

    engine = ShardedEngine(spec.target, spec.config, rank, device=spec.device("reader", rank))
    pointers = {n: t.data_ptr() for n, t in engine.tensors.items()}
    config = _sync_config(spec, SyncConfig, TransportOptions, spec.host("reader", rank))
    with WeightReader(engine, rank=rank, config=config) as reader:
        for step in range(spec.steps):
            if rank == spec.kill_reader and step == spec.steps - 1:
                _die_receiving(reader, rank, step, signal.SIGSTOP if spec.fault == "stop" else signal.SIGKILL)
            result = reader.update(timeout=spec.timeout)
            if rank == 0 and step == spec.new_epoch_at:
                reader.session.channel.advance_epoch(reader.session.channel.current_epoch())
            report = verify_rank(engine.layout(), engine.tensors,
                                 os.path.join(spec.checkpoints, f"step{result.version}"))
            in_place = all(t.data_ptr() == pointers[n] for n, t in engine.tensors.items())
            bad = [t.name for t in report.tensors.values() if t.status != "ok"]
            _emit(ReaderStep(rank=rank, version=result.version, nbytes=result.nbytes, phases=result.phases,
                             gbps=result.gbps, verified=report.matches, mismatches=bad[:5], in_place=in_place,
                             num_phases=planned.num_phases if (planned := reader.session.planned) else 1))


def _device_bytes(device: str) -> int:
    """What torch's allocator holds on a CUDA ``device`` once the CUDA IPC blocks readers let go
    of are collected (``torch.cuda.ipc_collect``); 0 for host memory."""
    if not device.startswith("cuda"):
        return 0
    import torch

    torch.cuda.ipc_collect()
    return int(torch.cuda.memory_allocated(torch.device(device)))


def _die_receiving(reader: Any, rank: int, version: int, how: int = signal.SIGKILL) -> None:
    """SIGKILL (or SIGSTOP: ``how``) this process as its transport starts receiving ``version``
    (its writers are sending): a peer dying, or hanging, mid-transfer, as a crashed engine does."""
    transport = reader.session.planned.transport
    receive = transport.receive

    def dying(v: int, *args: Any, **kwargs: Any) -> Any:
        if v >= version:
            _emit(ReaderKilled(rank=rank, version=v, at=time.time()))
            os.kill(os.getpid(), how)
        return receive(v, *args, **kwargs)

    transport.receive = dying


def _sync_config(spec: DemoSpec, sync_cls: Any, opts_cls: Any, host: str = "") -> Any:
    return sync_cls(num_writers=spec.num_writers, num_readers=spec.num_readers, transport=spec.transport,
                    transport_options=opts_cls(max_bucket_bytes=spec.max_bucket_bytes,
                                               delta_anchor_every=spec.delta_anchor_every,
                                               nixl_mode=spec.nixl_mode),
                    timeout=spec.timeout, layer_phases=spec.layer_phases, host=host)




_EMIT = threading.Lock()  # ranks in threads of one process (same_process) share stdout


def _emit(step: Record) -> None:
    role = next(name for name, cls in _RECORDS.items() if isinstance(step, cls))
    with _EMIT:
        sys.stdout.write(PREFIX + json.dumps({"role": role, **asdict(step)}) + "\n")
        sys.stdout.flush()


def _use_device(spec: DemoSpec, role: str, rank: int) -> None:
    """Make a rank's GPU current (for its thread: CUDA's current device is per thread)."""
    device = spec.device(role, rank)
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def run_all(spec: DemoSpec) -> int:
    """Every rank of the job in this process, a thread each (``same_process``); 0 when every
    rank finished, 1 when one raised (its traceback on stderr) or did not end in time."""
    failed: list[str] = []

    def run(role: str, rank: int) -> None:
        try:
            _use_device(spec, role, rank)
            (run_writer if role == "writer" else run_reader)(spec, rank)
        except BaseException:
            failed.append(f"{role} {rank}")
            traceback.print_exc()

    threads = [threading.Thread(target=run, args=(role, rank), name=f"{role}-{rank}", daemon=True)
               for role, n in (("writer", spec.num_writers), ("reader", spec.num_readers)) for rank in range(n)]
    for thread in threads:
        thread.start()
    deadline = Deadline.after(spec.timeout * (spec.steps + 1))
    for thread in threads:
        thread.join(timeout=deadline.remaining(0.0))
    stuck = [t.name for t in threads if t.is_alive()]
    if failed or stuck:
        print(f"ranks failed: {failed}; did not end in time: {stuck}", file=sys.stderr)
        return 1
    return 0


def _parse(line: str) -> Record:
    record = json.loads(line[len(PREFIX):])
    return _RECORDS[record.pop("role")](**record)  # type: ignore[no-any-return]


# -- the parent ----------------------------------------------------------------------------------

def run_demo(*, size: str = "small", source: str = "megatron:tp=2", target: str = "vllm:tp=1,replicas=2",
             steps: int = 3, transport: str = "auto", max_bucket_bytes: int = 32 << 20, timeout: float = 120.0,
             devices: dict[str, list[str]] | None = None, delta_anchor_every: int = 0, nixl_mode: str = "auto",
             layer_phases: bool = False, hosts: dict[str, list[str]] | None = None,
             env: dict[str, dict[str, str]] | None = None, kill_reader: int = -1,
             same_process: bool = False, fault: str = "kill", new_epoch_at: int = -1) -> DemoResult:
    """Run the demo (see module docstring); a failure is in the result, never raised.

    ``weightsync doctor`` runs its GPU checks through these options (each a :class:`DemoSpec`
    field, documented there): ``devices`` places each rank's tensors (``{"writer": ["cuda:0"],
    "reader": ["cuda:1"]}``); ``delta_anchor_every``, ``nixl_mode`` and ``layer_phases`` are the
    job's settings; ``hosts`` gives ranks node names (``routed``'s two routes on one machine);
    ``env`` adds environment variables per role (``CUDA_VISIBLE_DEVICES``); ``kill_reader``
    kills a reader mid-transfer of the last version: then the result is ok when every writer's
    ``write`` of it raised within :data:`FAULT_SECONDS` naming that reader and the writer
    exited cleanly (``writer_errors``), and every earlier version arrived bitwise.
    ``same_process`` runs every rank in one process, a thread each (CUDA IPC's in-process path).
    ``fault="stop"`` SIGSTOPs ``kill_reader`` instead (a hung peer: its writers must fail in time
    the same way; the demo kills it at the end). ``new_epoch_at``: reader 0 moves the job to a
    new epoch after that version (``WriterStep.device_bytes`` then shows the trainer's GPU
    memory coming back to one set of CUDA IPC slots).

    Raises:
        ValueError: an unknown size, layouts the model does not fit, settings the job refuses
            (e.g. ``nixl_mode`` without ``transport="nixl"``), or per-role options that do not
            name each rank of each role.
    """
    from weightsync.layout import ModelSpec, parse_layout
    from weightsync.meta.client import EmbeddedMetaServer

    config = model_config(size)
    spec_model = ModelSpec.from_hf_config(config)
    src, dst = parse_layout(source), parse_layout(target)
    src.validate(spec_model)
    dst.validate(spec_model)
    counts = {"writer": src.world_size, "reader": dst.world_size}
    _check_options(counts, steps=steps, devices=devices, hosts=hosts, env=env, kill_reader=kill_reader)
    if fault not in ("kill", "stop"):
        raise ValueError(f"run_demo fault={fault!r}: 'kill' or 'stop'")
    if same_process and (env or kill_reader != -1):
        raise ValueError(f"run_demo same_process=True with env={env!r}, kill_reader={kill_reader}: ranks in one "
                         "process share its environment and its death; use separate processes for those")
    with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as tmp, EmbeddedMetaServer() as server:
        spec = DemoSpec(config=config, source=src.describe(), target=dst.describe(), num_writers=src.world_size,
                        num_readers=dst.world_size, steps=steps, transport=transport, checkpoints=tmp,
                        max_bucket_bytes=max_bucket_bytes, timeout=timeout, devices=devices or {},
                        delta_anchor_every=delta_anchor_every, nixl_mode=nixl_mode, layer_phases=layer_phases,
                        hosts=hosts or {}, env=env or {}, kill_reader=kill_reader, same_process=same_process,
                        fault=fault, new_epoch_at=new_epoch_at)
        _job_config(spec)  # the job's own refusals (e.g. nixl_mode without NIXL), here rather than in each worker
        base = {**os.environ, "WEIGHTSYNC_META_ADDR": server.address, "WEIGHTSYNC_META_TOKEN": server.token,
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs = []
        for role, n in {"all": 1}.items() if same_process else counts.items():
            for rank in range(n):
                cmd = [sys.executable, "-m", "weightsync.apps.demo", "worker", "--role", role, "--rank", str(rank),
                       "--spec", spec.to_json()]
                procs.append((role, rank, subprocess.Popen(cmd, env={**base, **spec.env.get(role, {})},
                                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                           text=True)))
        records, failures = _collect(procs, deadline=Deadline.after(timeout * (steps + 2)), killed=kill_reader,
                                     stopped=fault == "stop")
    writers = [s for s in records if isinstance(s, WriterStep)]
    readers = [s for s in records if isinstance(s, ReaderStep)]
    killed = [s for s in records if isinstance(s, ReaderKilled)]
    writer_errors = [s for s in records if isinstance(s, WriterFailed)]
    if kill_reader >= 0:
        failures += _fault_failures(spec, killed, writer_errors)
    ok = not failures and all(r.verified and r.in_place for r in readers)
    return DemoResult(ok=ok, writers=writers, readers=readers, failures=failures, size=size, source=spec.source,
                      target=spec.target, parameters=spec_model.num_parameters, killed=killed,
                      writer_errors=writer_errors)


def _check_options(counts: Mapping[str, int], *, steps: int, devices: Mapping[str, list[str]] | None,
                   hosts: Mapping[str, list[str]] | None, env: Mapping[str, Mapping[str, str]] | None,
                   kill_reader: int) -> None:
    """Refuse per-role options that would be ignored or fail inside a worker (module rule:
    never ignore a setting)."""
    for name, value in (("devices", devices), ("hosts", hosts)):
        if value and ({k: len(v) for k, v in value.items()} != dict(counts)):
            raise ValueError(f"run_demo {name}={value!r}: needs one entry per rank of each role, "
                             f"{dict(counts)} for this source and target")
    if env and (set(env) - set(counts) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for role in env.values() for k, v in role.items())):
        raise ValueError(f"run_demo env={env!r}: needs {{'writer' or 'reader': {{NAME: value}}}} of strings")
    if kill_reader != -1:
        if not 0 <= kill_reader < counts["reader"]:
            raise ValueError(f"run_demo kill_reader={kill_reader}: no such reader ({counts['reader']} reader(s))")
        if counts["reader"] != 1 or steps < 2:
            raise ValueError(f"run_demo kill_reader={kill_reader} with {counts['reader']} reader(s) and steps={steps}: "
                             "the fault needs one reader (others would wait for the failed version) and steps >= 2 "
                             "(a version that arrives before the one the reader dies in)")


def _job_config(spec: DemoSpec) -> Any:
    from weightsync.session.sync_session import SyncConfig
    from weightsync.transport import TransportOptions

    return _sync_config(spec, SyncConfig, TransportOptions)


def _fault_failures(spec: DemoSpec, killed: list[ReaderKilled], errors: list[WriterFailed]) -> list[str]:
    """What the ``kill_reader`` fault should have produced and did not (empty: all of it)."""
    last = spec.steps - 1
    if [k.version for k in killed] != [last]:
        return [f"reader {spec.kill_reader} did not die receiving version {last} (saw {killed})"]
    out = []
    for rank in range(spec.num_writers):
        error = next((e for e in errors if e.rank == rank and e.version == last), None)
        if error is None:
            out.append(f"writer {rank}: write({last}) did not fail after reader {spec.kill_reader} died")
        elif error.at - killed[0].at > FAULT_SECONDS or f"reader {spec.kill_reader}" not in error.error:
            out.append(f"writer {rank}: failed {error.at - killed[0].at:.1f} s after reader {spec.kill_reader} died "
                       f"(at most {FAULT_SECONDS:.0f} s, naming it): {error.error[:300]}")
    return out


def _collect(procs: list[tuple[str, int, subprocess.Popen[str]]], deadline: Deadline, killed: int = -1,
             stopped: bool = False) -> tuple[list[Record], list[str]]:
    steps: list[Record] = []
    failures: list[str] = []
    for role, rank, proc in procs:  # writers first: a stopped reader is killed once they ended
        if stopped and (role, rank) == ("reader", killed):
            proc.kill()
        try:
            out, err = proc.communicate(timeout=deadline.remaining(1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{role} {rank} timed out")
        steps += [_parse(line) for line in out.splitlines() if line.startswith(PREFIX)]
        expected = -signal.SIGKILL if (role, rank) == ("reader", killed) else 0
        if proc.returncode != expected:
            tail = err.strip().splitlines()[-3:]
            failures.append(f"{role} {rank} exited {proc.returncode}: {' | '.join(tail)}")
    # Make sure nothing outlives the demo, whatever happened.
    for _, _, proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return steps, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.apps.demo")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--role", choices=["writer", "reader", "all"], required=True)  # all: same_process
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    spec = DemoSpec(**json.loads(args.spec))
    if args.role == "all":
        return run_all(spec)
    _use_device(spec, args.role, args.rank)  # this process's GPU, for every library in it
    (run_writer if args.role == "writer" else run_reader)(spec, args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
