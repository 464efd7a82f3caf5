"""``weightsync doctor``: what works on this machine, checked for real, in about a minute.

weightsync's GPU paths (NCCL, CUDA IPC, NIXL on GPU memory, the vLLM and SGLang adapters on
GPU) were written without a GPU to run them on. The doctor is how the first user with one
finds out what works: every check moves real weights between real processes (the demo's
workers: a tiny model, two versions, each reader checks every byte against the
checkpoint) on the placements the hardware allows, and a check that cannot run here says
why instead of vanishing from the table.

    report = run_checks(DoctorOptions())
    for check in report.checks: print(check.name, check.status, check.detail)

Checks (skipped with the reason when the hardware or a package is missing):

* ``meta-server``: an embedded meta server answers;
* ``cpu/<transport>``: gloo, shared memory (snapshot slots), file and NIXL (DRAM)
  syncs between processes on this host;
* ``gpu/nccl-2gpu``: NCCL between a writer on ``cuda:0`` and a reader on ``cuda:1`` (every
  NCCL check needs nccl4py, ``pip install weightsync[gpu]``: weightsync drives NCCL through it,
  transport/nccl_comm.py, and says so instead of running without it);
* ``gpu/same-gpu``: a writer and a reader on one GPU: ``auto`` must pick CUDA IPC (NCCL
  refuses two ranks on one GPU) and ``torch`` must be refused with the reason;
* ``gpu/cuda-ipc-2gpu``: CUDA IPC from ``cuda:0`` into ``cuda:1`` (the storage's own device);
* ``gpu/nixl-vram``: NIXL between GPU memories;
* ``gpu/bench``: one bench-sized case on the GPU(s), with its GB/s;
* ``gpu/nccl-4ranks``: NCCL between two writers and two readers, several peers per round;
* ``gpu/delta``: delta versions over NCCL between two GPUs;
* the other GPU paths a real job uses (issue 23; :data:`PLANNED`): listed with the reason
  they did not run, until the doctor runs them (``docs/gpu.md`` names the CPU test that
  covers each one's rules under the device model);
* ``engine/vllm``, ``engine/sglang``: an update of a live engine through weightsync
  (``--engines``; they start an engine, which takes a minute on its own).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

Status = Literal["passed", "failed", "skipped"]


@dataclass(slots=True)
class Check:
    """One line of the doctor's table."""

    name: str
    status: Status
    detail: str = ""
    seconds: float = 0.0
    gbps: float | None = None


@dataclass(kw_only=True)
class DoctorOptions:
    """What to check: engines take a minute each, so they are asked for explicitly."""

    engines: bool = False
    timeout: float = 120.0
    only: tuple[str, ...] = ()  # check-name prefixes; empty: all


@dataclass(slots=True)
class Environment:
    """What the checks need to know about this machine (read once)."""

    torch: str
    cuda_build: str | None
    gpus: int
    gpu_names: list[str] = field(default_factory=list)
    nixl: bool = False
    nccl4py: bool = False  # the NCCL transport's binding (transport/nccl_comm.py)
    vllm: bool = False
    sglang: bool = False
    versions: dict[str, str] = field(default_factory=dict)
    topology: str = ""  # ``nvidia-smi topo -m``, where present

    @classmethod
    def probe(cls) -> Environment:
        import torch

        from weightsync.transport.nccl_comm import nccl4py_missing

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(torch=torch.__version__, cuda_build=torch.version.cuda, gpus=gpus,
                   gpu_names=[torch.cuda.get_device_name(i) for i in range(gpus)],
                   nixl=bool(importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl")),
                   nccl4py=nccl4py_missing() is None,
                   vllm=importlib.util.find_spec("vllm") is not None,
                   sglang=importlib.util.find_spec("sglang") is not None,
                   versions=_versions(), topology=_topology())


def _versions() -> dict[str, str]:
    """Installed versions of what a GPU path depends on (for a bug report)."""
    out = {}
    for name in ("weightsync", "torch", "vllm", "sglang", "nixl", "nixl-cu12", "nccl4py", "nvidia-nccl-cu12",
                 "nvidia-nccl-cu13", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _topology() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], check=False, capture_output=True, text=True,
                              timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi topo -m failed: {exc}"


@dataclass(slots=True)
class DoctorReport:
    environment: Environment
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status != "failed" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"environment": asdict(self.environment), "checks": [asdict(c) for c in self.checks], "ok": self.ok}


def _sync(transport: str, devices: dict[str, list[str]] | None, timeout: float, *,
          source: str = "megatron:tp=1", target: str = "vllm:tp=1", size: str = "tiny",
          delta_anchor_every: int = 0) -> Check:
    """Two versions of a model between real processes, every byte checked."""
    from weightsync.demo import run_demo

    result = run_demo(size=size, source=source, target=target, steps=3 if delta_anchor_every else 2,
                      transport=transport, timeout=timeout, devices=devices, delta_anchor_every=delta_anchor_every)
    if not result.ok:
        bad = [f"version {r.version}: {r.mismatches}" for r in result.readers if not r.verified]
        return Check("", "failed", "; ".join(result.failures + bad)[:500] or "weights differ")
    gbps = max((r.gbps for r in result.readers), default=0.0)
    return Check("", "passed", f"{len(result.readers)} version(s) arrived bitwise, in place", gbps=gbps)


def _meta_server(env: Environment, options: DoctorOptions) -> Check:
    from weightsync.meta import connect

    client, server = connect(job="doctor")
    try:
        ok = client.status().get("job") == "doctor"
    finally:
        client.close()
        if server is not None:
            server.stop()
    return Check("", "passed" if ok else "failed", "embedded server on 127.0.0.1" if ok else "no answer")


def _cpu(transport: str) -> Callable[[Environment, DoctorOptions], Check]:
    def check(env: Environment, options: DoctorOptions) -> Check:
        if transport == "nixl" and not env.nixl:
            return Check("", "skipped", "NIXL is not installed (pip install 'weightsync[nixl]')")
        return _sync(transport, None, options.timeout)
    return check


def _needs_gpus(n: int, env: Environment) -> str | None:
    if env.gpus >= n:
        return None
    return f"needs {n} GPU(s); this machine has {env.gpus}" + ("" if env.cuda_build else " (CPU build of torch)")


def _needs_nccl(gpus: int, env: Environment) -> str | None:
    """Why an NCCL check cannot run here: too few GPUs, nccl4py missing, or both."""
    from weightsync.transport.nccl_comm import MISSING

    reasons = [r for r in (_needs_gpus(gpus, env), None if env.nccl4py else MISSING) if r]
    return "; ".join(reasons) or None


def _nccl_two_gpus(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_nccl(2, env):
        return Check("", "skipped", reason)
    return _sync("torch", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, options.timeout)


def _same_gpu(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", reason)
    from weightsync.devices import RankPlacement, choose_transport

    ranks = [RankPlacement("writer", 0, "here", "cuda:0"), RankPlacement("reader", 0, "here", "cuda:0")]
    if choose_transport("auto", ranks).name != "shm":
        return Check("", "failed", "auto did not pick CUDA IPC for a writer and a reader on one GPU")
    try:
        choose_transport("torch", ranks)
        return Check("", "failed", "transport 'torch' was not refused for two ranks on one GPU")
    except ValueError:
        pass
    check = _sync("auto", {"writer": ["cuda:0"], "reader": ["cuda:0"]}, options.timeout)
    check.detail = f"auto -> CUDA IPC: {check.detail}"
    return check


def _ipc_two_gpus(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_gpus(2, env):
        return Check("", "skipped", reason)
    return _sync("shm", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, options.timeout)


def _nixl_vram(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", reason)
    if not env.nixl:
        return Check("", "skipped", "NIXL is not installed (pip install 'weightsync[nixl]')")
    reader = "cuda:1" if env.gpus > 1 else "cuda:0"
    return _sync("nixl", {"writer": ["cuda:0"], "reader": [reader]}, options.timeout)


def _gpu_bench(env: Environment, options: DoctorOptions) -> Check:
    """One bench case on the GPU: a 0.2B-parameter model, two versions, trainer and engine
    on one GPU (CUDA IPC), or on two (NCCL) when there are two."""
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", reason)
    reader = "cuda:1" if env.gpus > 1 else "cuda:0"
    check = _sync("auto", {"writer": ["cuda:0"], "reader": [reader]}, options.timeout,
                  source="megatron:tp=1", target="vllm:tp=1", size="medium")
    check.detail = f"medium model, cuda:0 -> {reader}: {check.detail}"
    return check


def _nccl_four_ranks(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_nccl(4, env):
        return Check("", "skipped", reason)
    check = _sync("torch", {"writer": ["cuda:0", "cuda:1"], "reader": ["cuda:2", "cuda:3"]}, options.timeout,
                  source="megatron:tp=2", target="vllm:tp=1,replicas=2")
    check.detail = f"2 writers x 2 readers: {check.detail}"
    return check


def _gpu_delta(env: Environment, options: DoctorOptions) -> Check:
    """Delta versions over NCCL (transport/nccl_delta.py: the torch-op codec, the header
    exchange, the copies on the writer's GPU): three versions, a full one then deltas."""
    if reason := _needs_nccl(2, env):
        return Check("", "skipped", f"delta versions over NCCL (the torch transport between GPUs): {reason}; its "
                                    "rules are covered on CPU by tests/test_nccl_delta.py under the device model")
    check = _sync("torch", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, options.timeout, delta_anchor_every=4)
    check.detail = f"NCCL delta, cuda:0 -> cuda:1: {check.detail}"
    return check


#: GPU paths a real job uses that the doctor lists but does not run yet: name -> (GPUs it
#: needs, what it would check).
PLANNED: dict[str, tuple[int, str]] = {
    "gpu/nccl-abort": (2, "a killed peer: the trainer survives with a clear error within 10 s"),
    "gpu/cuda-ipc-same-process": (1, "CUDA IPC between a trainer and an engine in one process"),
    "gpu/cuda-ipc-visible-devices": (2, "CUDA IPC across processes with different CUDA_VISIBLE_DEVICES"),
    "gpu/nixl-push": (1, "NIXL in push mode on GPU memory"),
    "gpu/nixl-pull": (1, "NIXL in pull mode on GPU memory"),
    "gpu/phases-shm": (1, "layer phases over CUDA IPC"),
    "gpu/phases-routed": (2, "layer phases over the routed transport"),
    "gpu/fp8": (1, "FP8 quantisation on GPU, bitwise against the CPU reference"),
    "engine/vllm-memory": (1, "the vLLM worker backend with a real gpu_memory_utilization, peak memory "
                              "against the reserve"),
}


def _planned(name: str) -> Callable[[Environment, DoctorOptions], Check]:
    gpus, what = PLANNED[name]

    def check(env: Environment, options: DoctorOptions) -> Check:
        if reason := (_needs_nccl if name.startswith("gpu/nccl") else _needs_gpus)(gpus, env):
            return Check("", "skipped", f"{what}: {reason}")
        return Check("", "skipped", f"{what}: not run by this version of the doctor (its rules are covered on "
                                    "CPU by the device model: docs/gpu.md)")
    return check


def _engine(name: str) -> Callable[[Environment, DoctorOptions], Check]:
    def check(env: Environment, options: DoctorOptions) -> Check:
        if not getattr(env, name):
            return Check("", "skipped", f"{name} is not installed")
        if name == "sglang" and not env.gpus:
            return Check("", "skipped", "SGLang needs a CUDA GPU")
        if not options.engines:
            return Check("", "skipped", "starts an engine (a minute or more): run with --engines")
        import importlib

        module = importlib.import_module(f"weightsync.integrations.{name}_selfcheck")
        passed, detail = module.self_check(timeout=options.timeout)
        return Check("", "passed" if passed else "failed", detail)
    return check


#: name -> check, in the order the table shows them.
CHECKS: dict[str, Callable[[Environment, DoctorOptions], Check]] = {
    "meta-server": _meta_server,
    "cpu/gloo": _cpu("torch"),
    "cpu/shm": _cpu("shm"),
    "cpu/file": _cpu("file"),
    "cpu/nixl": _cpu("nixl"),
    "gpu/nccl-2gpu": _nccl_two_gpus,
    "gpu/same-gpu": _same_gpu,
    "gpu/cuda-ipc-2gpu": _ipc_two_gpus,
    "gpu/nixl-vram": _nixl_vram,
    "gpu/bench": _gpu_bench,
    "gpu/nccl-4ranks": _nccl_four_ranks,
    "gpu/delta": _gpu_delta,
    **{name: _planned(name) for name in PLANNED},
    "engine/vllm": _engine("vllm"),
    "engine/sglang": _engine("sglang"),
}


def run_checks(options: DoctorOptions, *, on_check: Callable[[Check], None] | None = None) -> DoctorReport:
    """Run every check (a failure is reported, never raised) and return the report."""
    env = Environment.probe()
    checks = []
    for name, fn in CHECKS.items():
        if options.only and not any(name.startswith(p) for p in options.only):
            continue
        t0 = time.perf_counter()
        try:
            check = fn(env, options)
        except Exception as exc:  # a check that crashes is a failed check, with its reason
            logger.debug("doctor check %s crashed", name, exc_info=True)
            check = Check("", "failed", f"{type(exc).__name__}: {exc}"[:500])
        check.name, check.seconds = name, time.perf_counter() - t0
        checks.append(check)
        if on_check is not None:
            on_check(check)
    return DoctorReport(env, checks)
