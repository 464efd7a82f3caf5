"""The parent of ``weightsync bench``: runs each case's worker processes and makes the rows.

For each :class:`~weightsync.apps.bench.cases.Case` it starts ``W + R`` worker processes
(:mod:`weightsync.apps.bench.worker`) against one embedded meta server, waits for their JSON
records, and turns them into rows: one per method, timed as the slowest rank of each
sync (median over the repetitions), with the bytes that really reached the readers (a
baseline's engine worker receives whole tensors; weightsync exactly its slices), GB/s of
those bytes, whether every reader held every version bitwise, speed-up over every
baseline of the same case, and the ratio to the physical limit measured by the same
processes in the same run (one memcpy of the bytes one reader must hold; gloo loopback
bandwidth for methods that move bytes over gloo). The awex peer runs as a subprocess of
its own Python (:func:`run_awex_peer`), so weightsync never imports it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.apps.bench.baselines import BASELINES
from weightsync.apps.bench.cases import LAYOUTS, Case
from weightsync.apps.bench.worker import PREFIX
from weightsync.clock.deadline import Deadline

#: Methods whose bytes cross gloo: their physical limit is loopback bandwidth, not memcpy.
GLOO_METHODS = ("weightsync-torch", "per-param-broadcast", "bucketed-broadcast", "awex-p2p")

#: awex_common shape name of each benchmark model the awex peer can reproduce.
AWEX_SHAPES = {"qwen3-0.2b": "qwen3-mid", "tiny-awex": "tiny"}


@dataclass(kw_only=True)
class BenchOptions:
    max_bucket_bytes: int = 64 << 20
    baseline_bucket_bytes: int = 512 << 20
    slots: int = 1
    timeout: float = 900.0
    awex_python: str = ""
    awex_script: str = ""
    memory_fraction: float = 0.8


@dataclass(kw_only=True)
class CaseResult:
    case: Case
    rows: list[dict[str, Any]] = field(default_factory=list)
    limits: dict[str, float] = field(default_factory=dict)
    failure: str = ""
    skipped: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mem_available() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def estimated_memory(case: Case) -> int:
    """Rough peak bytes of a case: writers + readers + shm slot + rank 0's gathered model + file."""
    from weightsync.layout import ModelSpec, parse_layout

    spec = ModelSpec.from_hf_config(case.config())
    model = spec.num_parameters * (2 if case.dtype == "bf16" else 4)
    copies = int(getattr(parse_layout(case.target), "replicas", 1))
    return model * (3 + copies) + (400 << 20) * (2 + parse_layout(case.target).world_size)


def run_case(case: Case, options: BenchOptions, *, meta_env: dict[str, str],
             on_method: Callable[[str], None] | None = None) -> CaseResult:
    """Run one case's workers to completion (or failure) and build its rows."""
    from weightsync.layout import parse_layout

    result = CaseResult(case=case)
    available = _mem_available()
    need = estimated_memory(case)
    if available and need > options.memory_fraction * available:
        result.skipped = (f"needs about {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available")
        return result
    world = parse_layout(case.source).world_size + parse_layout(case.target).world_size
    run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
    scratch = tempfile.mkdtemp(prefix="weightsync-bench-")
    spec = {"config": case.config(), "source": case.source, "target": case.target, "methods": list(case.methods),
            "reps": case.reps, "warmup": case.warmup, "port": free_port(), "timeout": options.timeout,
            "scratch": scratch,
            "options": {"max_bucket_bytes": options.max_bucket_bytes, "slots": options.slots,
                        "baseline_bucket_bytes": options.baseline_bucket_bytes, "run_id": run_id,
                        "job_prefix": f"bench-{run_id}"}}
    import weightsync

    package_root = str(Path(weightsync.__file__).resolve().parents[1])
    env = {**os.environ, **meta_env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
    procs: list[tuple[subprocess.Popen[bytes], str, str]] = []
    try:
        for g in range(world):
            out, err = os.path.join(scratch, f"rank{g}.out"), os.path.join(scratch, f"rank{g}.err")
            with open(out, "wb") as fo, open(err, "wb") as fe:
                cmd = [sys.executable, "-m", "weightsync.apps.bench.worker", "--spec", json.dumps(spec),
                       "--rank", str(g)]
                procs.append((subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe), out, err))
        result.failure = _wait(procs, deadline=Deadline.after(options.timeout * 2), on_method=on_method)
        records = [rec for _, out, _ in procs for rec in _records(out)]
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
        for leftover in glob.glob(f"/dev/shm/weightsync-bench-{run_id}*"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
    for rec in records:
        if rec.get("event") == "limits":
            result.limits = {k: v for k, v in rec.items() if k != "event"}
    result.rows = build_rows(case, [r for r in records if r.get("event") == "method"], result.limits)
    return result


def _records(path: str) -> list[dict[str, Any]]:
    with open(path, errors="replace") as f:
        return [json.loads(line[len(PREFIX):]) for line in f if line.startswith(PREFIX)]


def _wait(procs: list[tuple[subprocess.Popen[bytes], str, str]], *, deadline: Deadline,
          on_method: Callable[[str], None] | None) -> str:
    """Wait for every worker; returns "" or what went wrong (stops all on the first failure)."""
    seen = 0
    while True:
        if on_method is not None:
            done = [r for r in _records(procs[0][1]) if r.get("event") == "method"]
            for rec in done[seen:]:
                on_method(rec["method"])
            seen = len(done)
        codes = [p.poll() for p, _, _ in procs]
        if all(c == 0 for c in codes):
            return ""
        bad = [(g, c) for g, c in enumerate(codes) if c not in (None, 0)]
        if bad or deadline.expired:
            for p, _, _ in procs:
                if p.poll() is None:
                    p.kill()
            if not bad:
                return "timed out"
            g, code = bad[0]
            with open(procs[g][2], errors="replace") as f:
                tail = " | ".join(f.read().strip().splitlines()[-3:])
            return f"rank {g} exited {code}: {tail}"
        time.sleep(0.2)


def _transport_of(method: str) -> str:
    if method == "weightsync-shm-zero-copy":
        return "shm (zero-copy)"
    if method.startswith("weightsync-"):
        return method.removeprefix("weightsync-")
    if method.startswith("safetensors-"):
        return "file (" + method.removeprefix("safetensors-") + ")"
    return "gloo"


def build_rows(case: Case, records: Sequence[dict[str, Any]], limits: dict[str, float]) -> list[dict[str, Any]]:
    """One row per method of a case (see module docstring for the definitions)."""
    from weightsync.layout import ModelSpec

    spec = ModelSpec.from_hf_config(case.config())
    rows: list[dict[str, Any]] = []
    for method in case.methods:
        recs = [r for r in records if r["method"] == method]
        if not recs or any("error" in r for r in recs):
            errors = [r["error"] for r in recs if "error" in r]
            rows.append(_row_base(case, spec, method) | {"error": errors[0] if errors else "no result"})
            continue
        reps = min(len(r["seconds"]) for r in recs)
        walls = [max(r["seconds"][i] for r in recs) for i in range(reps)]
        readers = [r for r in recs if r["role"] == "reader"]
        writers = [r for r in recs if r["role"] == "writer"]
        row = _row_base(case, spec, method) | {
            "bytes": sum(int(statistics.median(r["received_bytes"])) for r in readers),
            "needed_bytes": sum(r["bytes"] for r in readers),
            "per_reader_bytes": max(r["bytes"] for r in readers),
            "seconds": statistics.median(walls),
            "seconds_reps": walls,
            "first_sync_seconds": max(r["first_sync_seconds"] for r in recs),
            "peak_extra_bytes": max(r["peak_extra_bytes"] for r in recs),
            "peak_extra_writer_bytes": max((r["peak_extra_bytes"] for r in writers), default=0),
            "peak_extra_reader_bytes": max((r["peak_extra_bytes"] for r in readers), default=0),
            "reader_shared_mapped_bytes": max((r["shared_mapped_bytes"] for r in readers), default=0),
            "verified": all(r.get("verified", False) for r in readers),
            "mismatches": sorted({m for r in readers for m in r.get("mismatches", [])})[:5],
            "phases": {"writer": _mean_phases(writers[0]["phases"]) if writers else {},
                       "reader": _mean_phases(readers[0]["phases"]) if readers else {}},
        }
        rows.append(row)
    add_ratios(rows, limits)
    return rows


def _row_base(case: Case, spec: Any, method: str) -> dict[str, Any]:
    return {"case": case.name, "model": case.model, "parameters": spec.num_parameters, "dtype": case.dtype,
            "layout": case.layout, "source": LAYOUTS[case.layout][0], "target": LAYOUTS[case.layout][1],
            "method": method, "transport": _transport_of(method)}


def _mean_phases(phases: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for p in phases for k in p})
    return {k: statistics.fmean(p.get(k, 0.0) for p in phases) for k in keys}


def add_ratios(rows: list[dict[str, Any]], limits: dict[str, float]) -> None:
    """Fill gbps, speed-ups over the case's baselines and ratios to the measured limits."""
    base = {r["method"]: r["seconds"] for r in rows if r["method"] in BASELINES and "seconds" in r}
    memcpy = limits.get("memcpy_gbps", 0.0) * 1e9
    loop = limits.get("loopback_gbps", 0.0) * 1e9
    for row in rows:
        if "seconds" not in row:
            continue
        s = row["seconds"]
        row["gbps"] = row["bytes"] / s / 1e9 if s > 0 else 0.0
        row["speedup_vs"] = {b: t / s for b, t in base.items() if b != row["method"]}
        if memcpy:
            row["memcpy_seconds"] = row["per_reader_bytes"] / memcpy
            row["over_memcpy"] = s / row["memcpy_seconds"]
        use_loop = row["method"] in GLOO_METHODS and loop
        row["limit"] = "gloo loopback" if use_loop else "memcpy"
        limit_bw = loop if use_loop else memcpy
        if limit_bw:
            row["limit_seconds"] = row["per_reader_bytes"] / limit_bw
            row["over_limit"] = s / row["limit_seconds"]


def run_awex_peer(case: Case, options: BenchOptions) -> dict[str, Any] | None:
    """awex's planner + p2p send/recv over gloo on this case's shapes (its own Python).

    Runs ``awex_p2p_bench.py <shape> <iters> <dtype> group`` and takes awex's own timed
    region per iteration (barrier to barrier on the exchange group, slowest rank,
    including op building and the non-contiguous copy-back), median after one warm-up.
    Returns a row, or None when no awex interpreter is configured.
    """
    if not options.awex_python:
        return None
    script = options.awex_script or default_awex_script()
    shape = AWEX_SHAPES.get(case.model)
    if shape is None:
        return _row_base(case, _spec(case), "awex-p2p") | {"error": f"awex peer has no shape for {case.model}"}
    cmd = [options.awex_python, script, shape, str(case.reps + case.warmup), case.dtype, "group"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "AWEX_MASTER_ADDR": "127.0.0.1"}
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=options.timeout, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _row_base(case, _spec(case), "awex-p2p") | {"error": f"awex peer did not run: {exc}"}
    return parse_awex_output(case, proc.stdout, proc.returncode, proc.stderr)


def parse_awex_output(case: Case, stdout: str, returncode: int = 0, stderr: str = "") -> dict[str, Any]:
    row = _row_base(case, _spec(case), "awex-p2p")
    head = next((json.loads(line) for line in stdout.splitlines() if line.startswith('{"shape"')), None)
    times = [float(m.group(1)) for m in re.finditer(r"^iter \d+: transfer_phase_s=([0-9.]+)", stdout, re.M)]
    if returncode != 0 or head is None or len(times) <= case.warmup:
        tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
        return row | {"error": f"awex peer failed (exit {returncode}): {tail}"}
    walls = times[case.warmup:]
    return row | {"bytes": int(head["bytes_moved_total"]), "per_reader_bytes": int(head["model_bytes"]),
                  "seconds": statistics.median(walls), "seconds_reps": walls,
                  "verified": "ALL_BITWISE_EQUAL" in stdout, "peak_extra_bytes": -1,
                  "note": "awex 0.9.0 TransferPlanBuilder + nccl_build_send/recv_ops + batch_send_recv "
                          "over gloo; metadata computed locally, meta server skipped"}


def _spec(case: Case) -> Any:
    from weightsync.layout import ModelSpec

    return ModelSpec.from_hf_config(case.config())


def default_awex_script() -> str:
    """``benchmarks/awex_peer/awex_p2p_bench.py`` of the source checkout this package runs from."""
    import weightsync

    return str(Path(weightsync.__file__).resolve().parents[2] / "benchmarks" / "awex_peer" / "awex_p2p_bench.py")
